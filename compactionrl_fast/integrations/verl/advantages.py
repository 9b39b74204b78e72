"""The paper's advantages over verl's V1 batch layout (the verl-free part of the trainer mode, docs/verl.md).

verl's V1 agent-loop workers store every output of an agent loop as one row under the key
`{uid}_{session_id}_{index}` (`AgentLoopWorkerTQ._agent_loop_postprocess`): `uid` names the prompt,
`session_id` one of its `rollout.n` samples, `index` the output's position in the session. With the
`compaction_agent` loop a session is one compacted rollout and its outputs are its segments, in order.
`trainer.CompactionSyncTrainer` reads the keys and calls `compaction_advantages`.
"""
from __future__ import annotations

import torch

from ...ops import place_final_rewards
from ...ops._validate import trusted_layout
from .._common import critic_returns, masked_whiten
from ..padded import as_bool_mask, flat, row_table, segment_gae_padded
from ._options import compaction_options


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
