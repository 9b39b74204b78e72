"""A micro-batch's layout, derived once per step on the host and read by every consumer of the step.

Everything the step needs that depends on the packed layout alone (never on what the models compute) is
derived here from the host copy of a micro-batch, before it moves to the training device: the trainable
positions, the loss layouts of the critic and the actor, the placed final rewards, the padded forward's
index tables, and the diagnostics' per-segment numbers. The critic, the actor, the losses and the
diagnostics read this one object, so the step itself reads no device data on the host until its metrics.
The global denominators of the losses (`Denominators`) are summed over micro-batches and ranks once per
step.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from types import SimpleNamespace
from typing import Any

import torch

from ..kernels.modes import CROSS_REWARDS
from ..rollout.records import EXEC, SEGMENT_KINDS
from . import diagnostics, dist
from .model import action_index, forward_tables


def reward_mode(cfg) -> str:
    """Where `place_final_rewards` puts the final reward for cfg.cross_segment (kernels/modes.py says)."""
    return CROSS_REWARDS[cfg.cross_segment]


def policy_mask(batch, cfg, seg=None):
    """Tokens in the policy loss [T] bool: all trainable tokens, or (ablation) exec tokens only.
    seg: the segment of each token [T] (`diagnostics.segment_ids`), None: derived here."""
    if cfg.train_summary_tokens:
        return batch.loss_mask
    seg = diagnostics.segment_ids(batch)[0] if seg is None else seg
    return batch.loss_mask & (batch.segment_kind.long()[seg] == SEGMENT_KINDS[EXEC])


def selected_offsets(batch, idx, mask, seg):
    """cu_seqlens [S+1] over the selected positions `idx` (the layout the losses see), and the mask there.
    seg: the segment of each token [T] (`diagnostics.segment_ids`)."""
    S = batch.cu_seqlens.numel() - 1
    counts = torch.zeros(S, dtype=torch.long, device=idx.device).index_add_(0, seg[idx], torch.ones_like(idx))
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]), mask[idx]


def placed_rewards(batch, cfg):
    """Token rewards [T] float32 for cfg: the packed ones when packing placed them the same way."""
    mode = reward_mode(cfg)
    if getattr(batch, "reward_mode", None) == mode:
        return batch.rewards
    from ..ops import place_final_rewards

    return place_final_rewards(batch.rollout_rewards.float(), batch.loss_mask, batch.cu_seqlens, batch.cu_segments,
                               mode=mode)


@dataclass
class MicroBatch:
    """One micro-batch and its layout. N trainable tokens of T; the losses read [N] inputs.

    batch: the PackedBatch; idx: [N] positions of the trainable tokens; rewards: [T] float32 final rewards
    placed in reward_mode; loss_cu: [S+1] segment offsets over idx; value_mask: [N] bool (all True);
    policy_mask: [N] bool (the policy loss's tokens) and policy_pos: [n] its True positions;
    rollout_logprobs: [N] float32;
    tables: the padded forward's buckets (`model.forward_tables`); diag: the diagnostics' layout part
    (`diagnostics.layout_part`); host: the host copies the global denominators are summed from; n_tokens: N;
    n_policy: the policy loss's tokens.
    """
    batch: Any
    idx: torch.Tensor
    rewards: torch.Tensor
    reward_mode: str
    loss_cu: torch.Tensor
    value_mask: torch.Tensor
    policy_mask: torch.Tensor
    policy_pos: torch.Tensor
    rollout_logprobs: torch.Tensor
    tables: list
    diag: dict
    host: SimpleNamespace
    n_tokens: int
    n_policy: int

    @classmethod
    def build(cls, batch, cfg) -> "MicroBatch":
        """The layout of `batch` on its own device (no host read when that is the CPU)."""
        idx = action_index(batch.loss_mask, batch.cu_attn)
        ids = diagnostics.segment_ids(batch)
        pmask = policy_mask(batch, cfg, ids[0])
        cu, value_mask = selected_offsets(batch, idx, batch.loss_mask, ids[0])
        pm = pmask[idx]
        pos = pm.nonzero()[:, 0]
        host = SimpleNamespace(loss_mask=batch.loss_mask, policy_mask=pmask, cu_seqlens=batch.cu_seqlens,
                               cu_segments=batch.cu_segments)
        return cls(batch=batch, idx=idx, rewards=placed_rewards(batch, cfg), reward_mode=reward_mode(cfg),
                   loss_cu=cu, value_mask=value_mask, policy_mask=pm, policy_pos=pos,
                   rollout_logprobs=batch.rollout_logprobs[idx].float(),
                   tables=forward_tables(batch.cu_attn, positions=idx - 1),
                   diag=diagnostics.layout_part(batch, cfg, idx, ids), host=host, n_tokens=idx.numel(),
                   n_policy=pos.numel())

    def map(self, fn) -> "MicroBatch":
        """A copy with `fn` applied to every tensor the step reads (the host copies stay)."""
        def move(x):
            if isinstance(x, torch.Tensor):
                return fn(x)
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple (model.Bucket)
                return type(x)(*(move(y) for y in x))
            if isinstance(x, (list, tuple)):
                return type(x)(move(y) for y in x)
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x

        b = copy.copy(self.batch)
        for k, v in vars(b).items():
            setattr(b, k, move(v))
        kw = {f.name: move(getattr(self, f.name)) for f in fields(self) if f.name != "batch"}
        return replace(self, batch=b, **kw)

    def to(self, device) -> "MicroBatch":
        return self.map(lambda t: t.to(device))


def concat_layout(layouts, masks):
    """One (mask [T], cu_seqlens [S+1], cu_segments [R+1]) over micro-batch layouts, `masks` replacing loss_mask."""
    dev = layouts[0].loss_mask.device if layouts else "cpu"
    cu_seq, cu_seg = [torch.zeros(1, dtype=torch.long, device=dev)], [torch.zeros(1, dtype=torch.long, device=dev)]
    t = s = 0
    for b in layouts:
        cu_seq.append(b.cu_seqlens[1:].long() + t)
        cu_seg.append(b.cu_segments[1:].long() + s)
        t, s = t + b.loss_mask.numel(), s + b.cu_seqlens.numel() - 1
    return torch.cat([m.reshape(-1) for m in masks]), torch.cat(cu_seq), torch.cat(cu_seg)


def denominator(layouts, masks, reduction: str, group=None, device=None):
    """Global count (all micro-batches, all ranks) of the reduction's units: tokens, or segments or
    rollouts with a masked token; None for "sum". At least 1, so an all-masked batch gives loss 0.

    A Python int, except over NCCL ranks: a tensor on `device` (the all-reduce runs there; no host read)."""
    from ..ops import global_denominator

    if reduction == "sum":
        return None
    mask, cu_seq, cu_seg = concat_layout(layouts, masks)
    nccl = dist.world()[1] > 1 and torch.distributed.get_backend(group) == "nccl"
    if nccl:
        mask, cu_seq, cu_seg = mask.to(device), cu_seq.to(device), cu_seg.to(device)
    n = global_denominator(reduction, mask, cu_seqlens=cu_seq, cu_segments=cu_seg, group=group, as_tensor=nccl)
    return n.clamp(min=1) if nccl else max(n, 1)


@dataclass
class Denominators:
    """The losses' global denominators of one step: the critic's over all micro-batches, the actor's per
    mini-batch (`policy[k]` for minibatches[k])."""
    value: Any
    policy: list

    @classmethod
    def build(cls, mbs: list, minibatches: list, cfg, group=None, device=None) -> "Denominators":
        hosts = [m.host for m in mbs]
        value = denominator(hosts, [h.loss_mask for h in hosts], "token-mean", group, device)
        policy = []
        for mb in minibatches:
            sub = [hosts[j] for j in mb]
            policy.append(denominator(sub, [h.policy_mask for h in sub], cfg.loss_reduction, group, device))
        return cls(value, policy)


def as_micro_batches(batches: list, cfg) -> list:
    """MicroBatch for each of `batches` (PackedBatch or MicroBatch), built where the batch is."""
    return [b if isinstance(b, MicroBatch) else MicroBatch.build(b, cfg) for b in batches]


def layout_on(batch, cfg, device="cpu") -> MicroBatch:
    """The layout of a host batch, built on the host and moved to `device` (CPU tensors stay as they are)."""
    return MicroBatch.build(batch, cfg).to(device)
