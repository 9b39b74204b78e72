"""Distributed helpers of the trainer (no-ops in a single process)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_sum(x: float, group=None) -> float:
    if world()[1] == 1:
        return float(x)
    return _reduce_number(float(x), dist.ReduceOp.SUM, group)


def global_max(x: float, group=None) -> float:
    """Max of `x` over ranks (NaN counts as +inf)."""
    if world()[1] == 1:
        return float(x)
    return _reduce_number(math.inf if math.isnan(x) else float(x), dist.ReduceOp.MAX, group)


def _reduce_number(x: float, op, group) -> float:
    """All-reduce of one host number, through a tensor where the backend takes it (NCCL: the GPU)."""
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(t, op=op, group=group)
    return float(t)


def all_reduce_grads(params, group=None) -> None:
    """Sum gradients over ranks in one flat buffer (the losses already carry the global denominator)."""
    if world()[1] == 1:
        return
    params = list(params)
    for p in params:  # a parameter unused on one rank must still join the same flat buffer
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    o = 0
    for g in grads:
        g.copy_(flat[o:o + g.numel()].view_as(g))
        o += g.numel()
