"""How the loss ops reduce per-token losses: one weight per segment, shared by every backend.

Every reduction is a weighted sum of per-token losses over trainable tokens, loss = sum_t w_t * l_t,
with w_t constant inside a GAE segment, so one kernel pass serves them all:

    "token-mean"    w = 1 / D,            D = trainable tokens (of the batch)
    "segment-mean"  w = 1 / (n_s * D),    n_s = trainable tokens of the token's segment,
                                          D = segments with a trainable token
    "rollout-mean"  w = 1 / (n_r * D),    n_r = trainable tokens of the token's rollout,
                                          D = rollouts with a trainable token
    "sum"           w = 1

`denominator` replaces the local D. With D the global count over all micro-batches and data-parallel
ranks (`global_denominator`, `global_token_count`), summing the micro-batch losses and gradients gives
exactly the full-batch loss and gradient, provided no segment ("segment-mean") or rollout
("rollout-mean") is split across micro-batches. A zero D (nothing trainable anywhere) gives weight 0.

Everything here is tensor arithmetic on [S] or [R] (no host sync), so it traces under torch.compile.
A negative or NaN tensor denominator is an error where its value can be read without a sync (CPU,
`check_denominator` in ops/_validate.py), and makes the loss NaN elsewhere (never a silent 0). The global
counts are in ops/denominator.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import modes
from ..kernels.modes import REDUCTION_SUM, REDUCTION_TOKEN_MEAN
from ._dispatch import custom_op, resolve_backend
from ._register import register_op
from ._registry import OpSpec, declare

REDUCTIONS = tuple(modes.REDUCTION)  # ("token-mean", "segment-mean", "rollout-mean", "sum")


# ---------------------------------------------------------------- ops: (loss_mask [T], cu_seqlens [S+1]) -> int64 [S]


def _segment_counts_fake(loss_mask, cu_seqlens):
    return cu_seqlens.new_empty(cu_seqlens.shape[0] - 1, dtype=torch.int64)


def _segment_counts_triton(loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    from ..kernels.segments import segment_counts as launch

    return launch(loss_mask, cu_seqlens)


register_op("segment_counts", _segment_counts_fake)  # the C++ op (csrc/), where built
register_op("segment_counts_triton", _segment_counts_fake, _segment_counts_triton)


def segment_counts(loss_mask, cu_seqlens):
    """Trainable tokens of each segment: int64 [S]. C++ on CPU, a Triton kernel on CUDA (no [T]
    temporary either way), torch elsewhere."""
    op = custom_op("segment_counts", resolve_backend("auto", loss_mask.device, op="segment_counts"))
    if op is not None:
        return op(loss_mask, cu_seqlens)
    csum = torch.nn.functional.pad(torch.cumsum(loss_mask, 0), (1, 0))
    return csum[cu_seqlens.long().clamp(0, loss_mask.numel())].diff()


def unit_counts(loss_mask, cu_seqlens, cu_segments, reduction):
    """(n [S]: trainable tokens of each segment's averaging unit, D: units with a trainable token).

    The unit is the whole batch ("token-mean", and D counts tokens), the segment or the rollout.
    Without cu_seqlens the batch is one segment; without cu_segments each segment is its own rollout.
    """
    if cu_seqlens is None:
        n = torch.count_nonzero(loss_mask).reshape(1)  # mask.sum() would make an int64 [T] copy
        return n, (n if reduction == "token-mean" else (n > 0).long()).sum()
    n = segment_counts(loss_mask, cu_seqlens)
    if reduction == "token-mean":
        return n, n.sum()
    if reduction == "rollout-mean" and cu_segments is not None:
        S, R = n.numel(), cu_segments.numel() - 1
        roll = torch.repeat_interleave(torch.arange(R, device=n.device), cu_segments.diff().long().clamp(min=0),
                                       output_size=S)
        n_r = torch.zeros(R, dtype=n.dtype, device=n.device).index_add_(0, roll, n)
        return n_r.index_select(0, roll), (n_r > 0).sum()
    return n, (n > 0).sum()


def _inverse(x):
    """1/x for counts x >= 0, with 1/0 = 0, in float64."""
    return x.double().reciprocal().nan_to_num_(posinf=0.0)


def _inverse_denominator(d):
    """1/d for a user's denominator: 0 for d = 0, NaN for d < 0 or NaN (the loss shows it), float64."""
    if isinstance(d, float):
        return 0.0 if d == 0.0 else 1.0 / d
    d = d.double()
    return torch.where(d > 0, d.reciprocal(), torch.where(d == 0, 0.0, float("nan")))


# ---------------------------------------------------------------- ops: (loss_mask [T], cu_seqlens [S+1]?,
# cu_segments [R+1]?, reduction code, den (< 0: none), den_t []?) -> float64 [S] ([1] without cu_seqlens)

def _segment_weights_fake(loss_mask, cu_seqlens, cu_segments, reduction, den, den_t):
    S = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return loss_mask.new_empty(S, dtype=torch.float64)


def _segment_weights_triton(loss_mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                            cu_segments: Optional[torch.Tensor], reduction: int, den: float,
                            den_t: Optional[torch.Tensor]) -> torch.Tensor:
    from ..kernels.segments import segment_counts as launch_counts
    from ..kernels.segments import segment_weights as launch

    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    given = den_t is not None or den >= 0
    if reduction == REDUCTION_SUM or (reduction == REDUCTION_TOKEN_MEAN and given):  # no counts needed: one launch
        counts = torch.empty(S, dtype=torch.int64, device=loss_mask.device)
    elif cu_seqlens is None:
        counts = torch.count_nonzero(loss_mask).reshape(1)
    else:
        counts = launch_counts(loss_mask, cu_seqlens)
    return launch(counts, cu_segments, reduction, den_t if den_t is not None else (den if given else None))


register_op("segment_weights", _segment_weights_fake)  # the C++ op (csrc/), where built
register_op("segment_weights_triton", _segment_weights_fake, _segment_weights_triton)


# ---------------------------------------------------------------- the weights, by backend


def segment_weights(loss_mask, cu_seqlens, cu_segments, reduction, denominator=None, backend="auto"):
    """Reduction weight of each segment's tokens: float64 [S] ([1] when cu_seqlens is None).

    `backend`: the loss op's. One op call: the Triton kernels for "triton" and on CUDA (counts, then one
    program for D and the weights), C++ for "cpp"; the torch formulation below where neither is there
    (TABLE["segment_weights"]). A negative or NaN tensor denominator gives NaN weights."""
    op = custom_op("segment_weights", resolve_backend(backend, loss_mask.device, op="segment_weights"))
    if op is not None:
        den = -1.0 if denominator is None or isinstance(denominator, torch.Tensor) else float(denominator)
        den_t = denominator if isinstance(denominator, torch.Tensor) else None
        return op(loss_mask, cu_seqlens, cu_segments, modes.REDUCTION[reduction], den, den_t)
    return segment_weights_torch(loss_mask, cu_seqlens, cu_segments, reduction, denominator)


def segment_weights_torch(loss_mask, cu_seqlens, cu_segments, reduction, denominator=None):
    """`segment_weights` in torch ops on [S] (the formulation the kernels port; no host sync)."""
    device = loss_mask.device
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if reduction == "sum":
        return torch.ones(S, dtype=torch.float64, device=device)
    if reduction == "token-mean" and denominator is not None:  # no counts needed
        inv = _inverse_denominator(denominator)
        if isinstance(inv, float):
            return torch.full((S,), inv, dtype=torch.float64, device=device)
        return inv.reshape(1).repeat(S)
    n, d = unit_counts(loss_mask, cu_seqlens, cu_segments, reduction)
    inv_d = _inverse(d) if denominator is None else _inverse_denominator(denominator)
    if reduction == "token-mean":
        return inv_d.reshape(1).repeat(S)
    return _inverse(n) * inv_d


# ---------------------------------------------------------------- internal rows of the registry (ops/_registry.py):
# the loss ops' reduction weights; "torch" here is the exact formulation on [S] above, which the kernels port

declare(OpSpec("segment_counts", cuda=("triton", "torch"), cpu=("cpp", "torch"),
               ops={"triton": "segment_counts_triton", "cpp": "segment_counts"}, kernels=("segments",)))
declare(OpSpec("segment_weights", cuda=("triton", "cuda", "torch"), cpu=("cpp", "torch", "triton"),
               ops={"triton": "segment_weights_triton", "cuda": "segment_weights_triton", "cpp": "segment_weights"},
               kernels=("segments",)))
