"""The PPO loop of CompactionRL: rollouts -> pack -> critic values -> segment_gae -> critic and actor updates.

One step on a global batch of rollouts (each rank holds its share, cut into micro-batches):

1. critic update 1: a forward of the critic gives the values of the states before each trainable token;
   detached, they are the "old" values: `place_final_rewards` + `segment_gae` turn them into advantages
   and returns; `value_loss` on them is back-propagated (no separate no-grad pass is needed);
2. critic updates 2..K: the same value loss against the same returns;
3. actor update(s): `linear_logprobs` of the trainable tokens, `ppo_policy_loss` with the advantages.

Every loss is a token-level mean over the whole global batch: each micro-batch's loss is divided by the
global count (`global_token_count` over micro-batches and ranks), gradients are summed over
micro-batches and all-reduced (summed) over ranks, so the update equals the single-process full-batch
update. The math lives in the ops; this file only wires them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, diagnostics
from .config import TrainConfig, to_dict
from .model import action_index, actor_logprobs, critic_hidden

# ----------------------------------------------------------------------------------------------
# distributed helpers (no-ops in a single process)


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_sum(x: float, group=None) -> float:
    if world()[1] == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t)


def all_reduce_grads(params, group=None) -> None:
    """Sum gradients over ranks in one flat buffer (the losses already carry the global denominator)."""
    if world()[1] == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    o = 0
    for g in grads:
        g.copy_(flat[o:o + g.numel()].view_as(g))
        o += g.numel()


# ----------------------------------------------------------------------------------------------
# state


@dataclass
class State:
    """Models, optimisers and counters of a run. `step` counts actor updates, `critic_step` critic-only steps."""
    cfg: TrainConfig
    actor: Any
    critic: Any
    opt_actor: torch.optim.Optimizer
    opt_critic: torch.optim.Optimizer
    step: int = 0
    critic_step: int = 0
    group: Any = None
    extra: dict = field(default_factory=dict)


def make_state(cfg: TrainConfig, actor, critic, group=None) -> State:
    adam = dict(betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return State(cfg, actor, critic, torch.optim.Adam(actor.parameters(), lr=cfg.actor_lr, **adam),
                 torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr, **adam), group=group)


def save_state(state: State, run_dir: str) -> str:
    return checkpoint.save(run_dir, models={"actor": state.actor, "critic": state.critic},
                           optimizers={"actor": state.opt_actor, "critic": state.opt_critic},
                           step=state.step, extra={"critic_step": state.critic_step, "config": to_dict(state.cfg),
                                                   **state.extra})


def load_state(state: State, run_dir: str) -> None:
    info = checkpoint.load(run_dir, models={"actor": state.actor, "critic": state.critic},
                           optimizers={"actor": state.opt_actor, "critic": state.opt_critic})
    state.step = info["step"]
    state.critic_step = info["extra"].get("critic_step", 0)
    state.extra = {k: v for k, v in info["extra"].items() if k not in ("critic_step", "config")}


# ----------------------------------------------------------------------------------------------
# one step on packed micro-batches


def policy_mask(batch, cfg: TrainConfig):
    """Tokens in the policy loss [T] bool: all trainable tokens, or (ablation) exec tokens only."""
    if cfg.train_summary_tokens:
        return batch.loss_mask
    seg, _, _ = diagnostics.segment_ids(batch)
    return batch.loss_mask & (batch.segment_kind.long()[seg] == diagnostics.EXEC)


def selected_offsets(batch, idx, mask):
    """cu_seqlens [S+1] over the selected positions `idx` (the layout the losses see), and the mask there."""
    seg, _, _ = diagnostics.segment_ids(batch)
    S = batch.cu_seqlens.numel() - 1
    counts = torch.zeros(S, dtype=torch.long).index_add_(0, seg[idx], torch.ones_like(idx))
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]), mask[idx]


def denominator(batches, masks, reduction: str, group=None):
    """Global count of the reduction's units (tokens, segments or rollouts with a masked token)."""
    if reduction == "sum":
        return None
    if reduction == "token-mean":
        from ..ops import global_token_count

        n = global_token_count(torch.cat([m.reshape(-1) for m in masks]), group=group)
        return max(int(n), 1)
    local = 0
    for b, m in zip(batches, masks):
        seg, roll, _ = diagnostics.segment_ids(b)
        S = b.cu_seqlens.numel() - 1
        per_seg = torch.zeros(S, dtype=torch.long).index_add_(0, seg, m.long())
        if reduction == "segment-mean":
            local += int((per_seg > 0).sum())
        else:
            R = b.cu_segments.numel() - 1
            per_roll = torch.zeros(R, dtype=torch.long).index_add_(0, roll, per_seg)
            local += int((per_roll > 0).sum())
    return max(int(global_sum(local, group)), 1)


def advantages(batch, values, cfg: TrainConfig):
    """(advantages [T], returns [T]) of a packed batch from critic values [T], via the package's ops."""
    from ..ops import place_final_rewards, segment_gae

    mode = "stitched" if cfg.cross_segment == "stitched" else "paper"
    rewards = place_final_rewards(batch.rollout_rewards.float(), batch.loss_mask, batch.cu_seqlens,
                                  batch.cu_segments, mode=mode)
    return segment_gae(rewards, values, batch.loss_mask, batch.cu_seqlens, batch.cu_segments, gamma=cfg.gamma,
                       lam=cfg.lam, cross_segment=cfg.cross_segment, lam_critic=cfg.lam_critic,
                       adaptive_alpha=cfg.adaptive_alpha, adaptive_length=cfg.adaptive_length)


def _optim_step(params, opt, max_norm, group):
    params = [p for p in params if p.grad is not None]
    all_reduce_grads(params, group)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf")) if params else torch.zeros(())
    opt.step()
    return float(norm)


class _Mean:
    """Token-weighted mean of per-micro-batch metrics."""

    def __init__(self):
        self.sums, self.weights = {}, {}

    def add(self, metrics: dict, weight: float):
        for k, v in metrics.items():
            v = float(v)
            if math.isfinite(v):
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def result(self, prefix=""):
        return {prefix + k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


def train_step(state: State, batches: list, *, update_actor: bool = True, diagnose: bool = True,
               gap: bool = False) -> dict:
    """One PPO step over this rank's micro-batches (PackedBatch each, whole rollouts). Returns metrics."""
    cfg, actor, critic, group = state.cfg, state.actor, state.critic, state.group
    idx = [action_index(b.loss_mask, b.cu_attn) for b in batches]
    sel_v = [selected_offsets(b, i, b.loss_mask) for b, i in zip(batches, idx)]
    den_v = denominator(batches, [b.loss_mask for b in batches], "token-mean", group)
    out = {}
    from ..ops import ppo_policy_loss, value_head, value_loss

    # ---- critic: update 1 also yields the old values, hence advantages and returns
    adv, ret, old_v = [None] * len(batches), [None] * len(batches), [None] * len(batches)
    critic.train()
    for k in range(max(cfg.critic_updates_per_step, 1)):
        state.opt_critic.zero_grad(set_to_none=True)
        acc = _Mean()
        for i, b in enumerate(batches):
            v = value_head(critic_hidden(critic, b, idx[i]), critic.weight, critic.bias)  # [N]
            if k == 0:
                old_v[i] = v.detach()
                values = torch.zeros(b.loss_mask.numel()).index_put_((idx[i],), old_v[i])
                adv[i], ret[i] = advantages(b, values, cfg)
            cu, m = sel_v[i]
            loss, met = value_loss(v, old_v[i], ret[i][idx[i]], m, clip=cfg.value_clip, cu_seqlens=cu,
                                   cu_segments=b.cu_segments, reduction="token-mean", denominator=den_v)
            loss.backward()
            acc.add({"value_loss": loss.detach() * den_v / max(idx[i].numel(), 1), **met}, idx[i].numel())
        if cfg.critic_updates_per_step > 0:
            out["critic_grad_norm"] = _optim_step(critic.parameters(), state.opt_critic, cfg.max_grad_norm, group)
        if k == 0:
            out.update(acc.result("critic/"))
    # ---- actor
    if update_actor:
        actor.train()
        out.update(_actor_update(state, batches, idx, adv))
    # ---- diagnostics on the whole local batch
    if diagnose:
        d = _Mean()
        for i, b in enumerate(batches):
            values = torch.zeros(b.loss_mask.numel()).index_put_((idx[i],), old_v[i])
            stats = diagnostics.batch_diagnostics(b, adv[i], values, ret[i], cfg)
            if gap:
                stats.update(diagnostics.advantage_gap(b, values, cfg))
            lists = {k: v for k, v in stats.items() if isinstance(v, list)}
            d.add({k: v for k, v in stats.items() if not isinstance(v, list) and v is not None}, idx[i].numel())
            if i == 0:
                out.update(lists)  # histograms and deciles of the first micro-batch
        out.update(d.result())
    return out


def _actor_update(state, batches, idx, adv) -> dict:
    from ..ops import ppo_policy_loss

    cfg, actor, group = state.cfg, state.actor, state.group
    pmask = [policy_mask(b, cfg) for b in batches]
    sel_p = [selected_offsets(b, i, m) for b, i, m in zip(batches, idx, pmask)]
    den_p = denominator(batches, pmask, cfg.loss_reduction, group)
    state.opt_actor.zero_grad(set_to_none=True)
    acc = _Mean()
    for i, b in enumerate(batches):
        logp, ent = actor_logprobs(actor, b, idx[i], temperature=cfg.temperature, return_entropy=True)
        cu, m = sel_p[i]
        rollout_lp = b.rollout_logprobs[idx[i]].float()
        # one optimiser step per batch: the old policy is the current one (ratio 1 in value, not in gradient)
        loss, met = ppo_policy_loss(logp, logp.detach(), adv[i][idx[i]], m, cu_seqlens=cu, cu_segments=b.cu_segments,
                                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                                    rollout_logprobs=rollout_lp if cfg.tis_cap else None, tis_cap=cfg.tis_cap,
                                    reduction=cfg.loss_reduction, denominator=den_p)
        loss.backward()
        n = int(m.sum())
        with torch.no_grad():
            lr = logp.detach()[m] - rollout_lp[m]  # trainer vs sampler log-prob mismatch
            mis = {"rollout_kl": (torch.expm1(lr) - lr).mean() if n else torch.tensor(float("nan")),
                   "rollout_logp_absdiff_max": lr.abs().max() if n else torch.tensor(float("nan")),
                   "entropy": ent.detach()[m].mean() if n else torch.tensor(float("nan"))}
        acc.add({"policy_loss": loss.detach(), **met, **mis}, n)
    out = acc.result("actor/")
    out["actor/grad_norm"] = _optim_step(actor.parameters(), state.opt_actor, cfg.max_grad_norm, group)
    out["actor/tokens"] = den_p if cfg.loss_reduction == "token-mean" else None
    return out
