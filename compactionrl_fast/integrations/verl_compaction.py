"""The verl-free parts of the verl plug-in (docs/verl.md): the paper's advantages over verl's V1 batch
layout, and an `Engine` over verl's `server_manager`.

verl's V1 agent-loop workers store every output of an agent loop as one row under the key
`{uid}_{session_id}_{index}` (`AgentLoopWorkerTQ._agent_loop_postprocess`): `uid` names the prompt,
`session_id` one of its `rollout.n` samples, `index` the output's position in the session. With the
`compaction_agent` loop a session is one compacted rollout and its outputs are its segments, in order.
`verl_trainer.CompactionSyncTrainer` reads the keys and calls `compaction_advantages`;
`verl_agent.CompactionAgentLoop` drives our compaction loop through `ServerManagerEngine`.
"""
from __future__ import annotations

import torch

from ..ops import place_final_rewards, segment_params
from ..ops._validate import trusted_layout
from ..rollout.engines.base import Engine, Generation, caps_list
from ._common import CRITIC_TARGETS, cfg_get, critic_returns, masked_whiten
from .padded import as_bool_mask, flat, row_table, segment_gae_padded
from .verl import ADV_ESTIMATOR, gae_options


def session_rows(keys):
    """(rollout id, segment index) of each row from verl's batch keys `{uid}_{session_id}_{index}`.

    Args:
        keys: [B] strings. Returns two lists of B: the `{uid}_{session_id}` and the int `index`.
    Raises ValueError naming the key when one is not in that form, or when a rollout's indices are not
    0..n-1 (a missing or repeated output).
    """
    ids, pos, seen = [], [], {}
    for k in keys:
        parts = str(k).rsplit("_", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"batch key {k!r} is not verl's '{{uid}}_{{session_id}}_{{index}}' "
                             "(written by AgentLoopWorkerTQ._agent_loop_postprocess)")
        rid, i = f"{parts[0]}_{parts[1]}", int(parts[2])
        if i in seen.setdefault(rid, set()):
            raise ValueError(f"batch keys: output index {i} of session {rid!r} appears twice")
        seen[rid].add(i)
        ids.append(rid)
        pos.append(i)
    for rid, s in seen.items():
        if s != set(range(len(s))):
            raise ValueError(f"batch keys: session {rid!r} has output indices {sorted(s)}, not 0..{len(s) - 1} "
                             "(a segment of the rollout is missing from the batch)")
    return ids, pos


def compaction_options(config):
    """segment_gae keyword arguments and flags from verl's `algorithm` config (the `compaction_gae` keys
    of integrations/verl.py, plus `critic_target`: "local" (default) or "corrected")."""
    kw, flags = gae_options(config)
    target = cfg_get(cfg_get(config, ADV_ESTIMATOR) or {}, "critic_target", "local")
    if target not in CRITIC_TARGETS:
        raise ValueError(f"algorithm.{ADV_ESTIMATOR}.critic_target must be one of {CRITIC_TARGETS}, got {target!r}")
    flags["critic_target"] = target
    return kw, flags


def compaction_advantages(keys, token_level_scores, values, response_mask, config=None, *, token_level_rewards=None):
    """The paper's advantages and returns for a verl V1 batch (rows = segments, keyed as verl keys them).

    Each `{uid}_{session_id}` is one rollout, its rows in `index` order. The rollout's reward is counted
    once: verl copies the final output's score onto every earlier output, so each row's `token_level_scores`
    must sum to the same value (else ValueError); that value is placed by `place_final_rewards` ("paper":
    on every segment's last trainable token; "stitched": on the rollout's last one). Per-token terms verl
    added on top of the scores (a KL penalty: `token_level_rewards - token_level_scores`) are kept per token.

    Args:
        keys: [B] batch keys. token_level_scores, values, response_mask: [B, L] (mask 0/1, any dtype).
        config: verl's `algorithm` config (keys in `compaction_options`).
        token_level_rewards: [B, L] or None (= the scores).
    Returns:
        (advantages [B, L], returns [B, L]) float32, 0 where the mask is 0 (padding rows included).
        returns are segment_gae's ("local") or advantages + values ("corrected"); advantages are whitened
        over the batch only with `whiten: true`.
    """
    kw, flags = compaction_options(config)
    mask = as_bool_mask("response_mask", response_mask)
    B, L = mask.shape
    if len(keys) != B:
        raise ValueError(f"batch keys must have one entry per row (B={B}), got {len(keys)}")
    scores = flat("token_level_scores", token_level_scores, B, L).view(B, L)
    flat("values", values, B, L)
    extra = None
    if token_level_rewards is not None:
        extra = flat("token_level_rewards", token_level_rewards, B, L).view(B, L).float() - scores.float()
    ids, pos = session_rows(keys)
    table = row_table(B, L, ids, pos, mask.device)
    order = torch.tensor(table.order, dtype=torch.int64, device=mask.device)
    row_score = scores.sum(-1, dtype=torch.float64)[order]  # [B] in segment order
    n_seg = table.cu_segments.diff()
    rollout_score = row_score[table.cu_segments[1:] - 1]  # [R] the last segment's score
    per_row = torch.repeat_interleave(rollout_score, n_seg)
    bad = (row_score != per_row).nonzero()
    if bad.numel():
        b = table.order[int(bad[0])]
        raise ValueError(f"token_level_scores: the rows of rollout {ids[b]!r} carry different rewards "
                         f"({row_score[int(bad[0])].item()} at output {pos[b]}, {per_row[int(bad[0])].item()} at "
                         "its last); verl copies the final output's reward onto the others, one per rollout")
    mode = "stitched" if kw["cross_segment"] == "stitched" else "paper"
    mask_o = mask if table.seg_start is None else mask.index_select(0, order)
    with trusted_layout():
        placed = place_final_rewards(rollout_score.float(), mask_o.reshape(B * L), table.cu_seqlens,
                                     table.cu_segments, mode=mode).view(B, L)
    if table.seg_start is None:
        rewards = placed
    else:
        rewards = torch.empty_like(placed).index_copy_(0, order, placed)
    if extra is not None:
        rewards = rewards + extra
    adv, ret = segment_gae_padded(rewards, values, mask, ids, segment_index=pos, **kw)
    ret = critic_returns(adv, ret, values, mask, flags["critic_target"])
    if flags["whiten"]:
        adv = masked_whiten(adv, mask)
    return adv, ret


def check_row_lengths(keys, response_lengths, **fields):
    """ValueError naming the field and the row when a field's row has another length than its response.

    Args:
        keys: [B] batch keys. response_lengths: [B] ints. fields: name -> [B] ints (None: not checked).
    verl stores rows unpadded; padding them to the batch width would hide a short row (its last tokens read
    as 0), so the lengths are compared before."""
    want = torch.as_tensor(response_lengths).long()
    for name, lens in fields.items():
        if lens is None:
            continue
        bad = (torch.as_tensor(lens).long() != want).nonzero()
        if bad.numel():
            b = int(bad[0])
            raise ValueError(f"{name}: row {keys[b]!r} has {int(torch.as_tensor(lens)[b])} values for a response of "
                             f"{int(want[b])} tokens; every per-token field must have its response's length")


def compaction_metrics(keys, response_mask, extra_fields, config=None):
    """The recipe's numbers for verl's metrics, as the paper tracks them (its Figures 3-4).

    Args:
        keys: [B] batch keys `{uid}_{session}_{index}`. response_mask: [B, L] 0/1.
        extra_fields: [B] dicts of the rows (`segment_kind`, `compactions`, `finish_reason`; padding rows
            without them are skipped).
        config: verl's `algorithm` config (the cross-segment scale uses its gamma and lambda).
    Returns a dict of floats under `compaction/`: per rollout, compactions, segments and summary tokens
    (mean, max); trainable tokens per segment of each kind (mean) and their share; the cross-segment scale
    `(gamma*lam)^N_later` of each segment (mean, min; 1 with cross_segment none/stitched); the fraction of
    rollouts with each finish reason."""
    mask = as_bool_mask("response_mask", response_mask)
    real = [i for i, e in enumerate(extra_fields) if isinstance(e, dict) and "segment_kind" in e]
    if not real:
        return {}
    keys = [keys[i] for i in real]
    extra = [extra_fields[i] for i in real]
    mask = mask[torch.tensor(real, device=mask.device)]
    ids, pos = session_rows(keys)
    B, L = mask.shape
    table = row_table(B, L, ids, pos, mask.device)
    order = table.order  # rows in segment order, rollout by rollout
    n_tok = mask.sum(-1).tolist()
    kw, _ = compaction_options(config)
    mask_o = mask.index_select(0, torch.tensor(order, device=mask.device)).reshape(B * L)
    scale = segment_params(mask_o, table.cu_seqlens, table.cu_segments, **kw)[2]  # [B] segments in order
    cu = table.cu_segments.tolist()
    rollouts = [order[a:b] for a, b in zip(cu[:-1], cu[1:])]  # each rollout's rows, in index order
    out = {}

    def stat(name, xs):
        xs = [float(x) for x in xs]
        if xs:
            out[f"compaction/{name}/mean"] = sum(xs) / len(xs)
            out[f"compaction/{name}/max"] = max(xs)

    stat("compactions_per_rollout", [extra[r[-1]]["compactions"] for r in rollouts])
    stat("segments_per_rollout", [len(r) for r in rollouts])
    stat("summary_tokens_per_rollout", [sum(n_tok[i] for i in r if extra[i]["segment_kind"] == "summary")
                                        for r in rollouts])
    total = sum(n_tok) or 1
    for kind in sorted({e["segment_kind"] for e in extra}):
        rows = [i for i, e in enumerate(extra) if e["segment_kind"] == kind]
        out[f"compaction/trainable_tokens_per_segment/{kind}/mean"] = sum(n_tok[i] for i in rows) / len(rows)
        out[f"compaction/trainable_tokens_share/{kind}"] = sum(n_tok[i] for i in rows) / total
    out["compaction/cross_segment_scale/mean"] = float(scale.mean())
    out["compaction/cross_segment_scale/min"] = float(scale.min())
    reasons = [str(extra[r[-1]]["finish_reason"]) for r in rollouts]
    for why in sorted(set(reasons)):
        out[f"compaction/finish_reason/{why}"] = reasons.count(why) / len(reasons)
    out["compaction/rollouts"] = float(len(rollouts))
    return out


class ServerManagerEngine(Engine):
    """An `Engine` over verl's `server_manager` (`LLMServerClient`): each prompt of a round is one
    `await server_manager.generate(request_id, prompt_ids=..., sampling_params=...)`, all of a round
    concurrently. `generate` returns a coroutine, which `arun_rollouts` awaits.

    Args:
        server_manager: verl's client (anything with that async `generate`).
        sampling_params: verl's per-sample dict (temperature, top_p, top_k, ...); `max_tokens`,
            `stop_token_ids`, `logprobs` and a seed are set per request from the loop's arguments.
        request_id: the session's sticky id (every call of a rollout goes to the same server, which keeps
            its prefix cache); round-robin between rollouts is verl's.
    """

    def __init__(self, server_manager, sampling_params=None, request_id="compaction"):
        if not callable(getattr(server_manager, "generate", None)):
            raise TypeError(f"server_manager must have an async generate(), got {type(server_manager).__name__}")
        self.server_manager = server_manager
        self.sampling_params = dict(sampling_params or {})
        self.request_id = str(request_id)
        self.global_steps = None  # (first, last) weight version the servers reported, over every call

    def _saw_steps(self, extra):
        """Track the weight versions (verl's `min_global_steps` / `max_global_steps`) of one server output."""
        lo = extra.get("min_global_steps", extra.get("global_steps"))
        hi = extra.get("max_global_steps", extra.get("global_steps"))
        if lo is None or hi is None:
            return
        if self.global_steps is None:
            self.global_steps = (int(lo), int(hi))
        else:
            self.global_steps = (min(self.global_steps[0], int(lo)), max(self.global_steps[1], int(hi)))

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        """Coroutine of `Engine.generate`: verl's sampling params win over the loop's temperature/top_p
        (validation sets its own); the loop's caps and stop tokens are always applied."""
        import asyncio

        caps = caps_list(max_new_tokens, len(prompts))
        keys = cache_keys if cache_keys is not None else range(len(prompts))

        async def one(prompt, cap, key):
            params = dict(self.sampling_params)
            params.setdefault("temperature", temperature)
            params.setdefault("top_p", top_p)
            params.update(max_tokens=cap, stop_token_ids=list(stop_token_ids), logprobs=True)
            if seed is not None:
                params["seed"] = int(seed)
            out = await self.server_manager.generate(f"{self.request_id}-{key}", prompt_ids=list(prompt),
                                                     sampling_params=params)
            ids = list(out.token_ids)
            lps = getattr(out, "log_probs", None)
            if lps is None or len(lps) != len(ids):
                raise ValueError("server_manager.generate returned no per-token log_probs (or a wrong number); "
                                 "the compaction agent loop needs them (actor_rollout_ref.rollout.calculate_log_probs)")
            self._saw_steps(getattr(out, "extra_fields", None) or {})
            stopped = bool(ids) and ids[-1] in stop_token_ids
            return Generation(ids, [float(x) for x in lps], "stop" if stopped else "length")

        async def all_of():
            return list(await asyncio.gather(*(one(p, c, k) for p, c, k in zip(prompts, caps, keys))))

        return all_of()

    def load_weights(self, state_dict) -> None:
        raise NotImplementedError("verl syncs the servers' weights itself (checkpoint_manager.update_weights)")
