"""Triton kernels for per-segment metadata over packed tokens: trainable-token counts.

Offsets are clamped to [0, T] and a segment that ends before it starts counts 0, so bad `cu_seqlens`
(unchecked on CUDA by default) give wrong counts, never a bad access.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from . import modes
from ._launch import device_guard

BLOCK = 1024  # mask bytes per loop step on GPU
INTERPRET_BLOCK = 1 << 16  # the interpreter pays per operation, not per element
WEIGHTS_BLOCK = 256  # segments per step of the one-program weights kernel (1024: stack use on sm_90)


@triton.jit
def _segment_counts_kernel(mask_ptr, cu_ptr, counts_ptr, T, BLOCK: tl.constexpr):
    """counts[s] = trainable tokens in [cu[s], cu[s+1]), one program per segment."""
    s = tl.program_id(0).to(tl.int64)
    lo = tl.minimum(tl.maximum(tl.load(cu_ptr + s).to(tl.int64), 0), T)
    hi = tl.minimum(tl.maximum(tl.load(cu_ptr + s + 1).to(tl.int64), lo), T)
    o_b = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int64)
    for i_b in range(tl.cdiv(hi - lo, BLOCK)):
        o_t = lo + i_b * BLOCK + o_b
        acc += tl.load(mask_ptr + o_t, mask=o_t < hi, other=0).to(tl.int64)
    tl.store(counts_ptr + s, tl.sum(acc, 0))


def segment_counts(loss_mask, cu_seqlens):
    """Trainable tokens per segment. loss_mask: [T] bool; cu_seqlens: [S+1] int32/int64 -> int64 [S]."""
    T, S = loss_mask.numel(), cu_seqlens.numel() - 1
    counts = torch.empty(S, dtype=torch.int64, device=loss_mask.device)
    if S > 0:
        block = BLOCK if loss_mask.device.type == "cuda" else INTERPRET_BLOCK
        with device_guard(loss_mask):
            _segment_counts_kernel[(S,)](loss_mask.view(torch.uint8), cu_seqlens, counts, T, BLOCK=block)
    return counts


@triton.jit
def _segment_weights_kernel(counts_ptr, cs_ptr, den_ptr, prefix_ptr, out_ptr, S, R, LOG_R, den_hi, den_lo,
                            REDUCTION: tl.constexpr, HAS_CS: tl.constexpr, DEN: tl.constexpr, BLOCK: tl.constexpr):
    """The loss reductions' weight of each segment, float64 [S], one program (the port of
    csrc/cpu/segment_weights.cpp), REDUCTION a code of kernels/modes.py: token-mean 1/D, segment-mean
    1/(n_s D), rollout-mean 1/(n_r D), sum 1. DEN: 0 D counted here, 1 the float den_hi + den_lo, 2 the
    one-element tensor at den_ptr."""
    o_b = tl.arange(0, BLOCK)
    d = tl.zeros([1], tl.float64)
    ROLLOUTS: tl.constexpr = REDUCTION == modes.REDUCTION_ROLLOUT_MEAN and HAS_CS
    if ROLLOUTS:  # inclusive prefix sums of the counts, for each rollout's total
        carry = tl.zeros([1], tl.float64)
        for i in range(tl.cdiv(S, BLOCK)):
            o = i * BLOCK + o_b
            c = tl.load(counts_ptr + o, mask=o < S, other=0).to(tl.float64)
            p = tl.cumsum(c, 0) + carry
            tl.store(prefix_ptr + o, p, mask=o < S)
            carry = tl.max(tl.where(o < S, p, 0.0), 0) + tl.zeros([1], tl.float64)
        tl.debug_barrier()
        for i in range(tl.cdiv(R, BLOCK)):
            o = i * BLOCK + o_b
            lo, hi = tl.load(cs_ptr + o, mask=o < R, other=0), tl.load(cs_ptr + o + 1, mask=o < R, other=0)
            n_r = tl.load(prefix_ptr + hi - 1, mask=(o < R) & (hi > 0), other=0.0) - tl.load(
                prefix_ptr + lo - 1, mask=(o < R) & (lo > 0), other=0.0)
            d += tl.sum(tl.where((o < R) & (n_r > 0), 1.0, 0.0), 0)
    elif REDUCTION != modes.REDUCTION_SUM:
        for i in range(tl.cdiv(S, BLOCK)):
            o = i * BLOCK + o_b
            c = tl.load(counts_ptr + o, mask=o < S, other=0).to(tl.float64)
            if REDUCTION == modes.REDUCTION_TOKEN_MEAN:
                d += tl.sum(c, 0)
            else:
                d += tl.sum(tl.where(c > 0, 1.0, 0.0), 0)
    if DEN == 1:
        d = tl.zeros([1], tl.float64) + den_hi + den_lo
    elif DEN == 2:
        d = tl.load(den_ptr + tl.arange(0, 1)).to(tl.float64)
    if DEN == 0:
        inv_d = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
    else:  # a given denominator: 0 -> 0, negative or NaN -> NaN
        inv_d = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), tl.where(d == 0, 0.0, float("nan")))
    for i in range(tl.cdiv(S, BLOCK)):
        o = i * BLOCK + o_b
        if REDUCTION == modes.REDUCTION_SUM:
            w = tl.zeros([BLOCK], tl.float64) + 1.0
        elif REDUCTION == modes.REDUCTION_TOKEN_MEAN:
            w = tl.zeros([BLOCK], tl.float64) + inv_d
        else:
            if ROLLOUTS:  # the rollout of each segment: the largest r with cs[r] <= s, by bisection
                r, r_hi = tl.zeros([BLOCK], tl.int64), tl.zeros([BLOCK], tl.int64) + R - 1
                for _ in range(LOG_R):
                    mid = (r + r_hi + 1) // 2
                    le = tl.load(cs_ptr + mid, mask=(o < S) & (r < r_hi), other=0).to(tl.int64) <= o
                    r, r_hi = tl.where(le & (r < r_hi), mid, r), tl.where(le | (r >= r_hi), r_hi, mid - 1)
                lo, hi = tl.load(cs_ptr + r, mask=o < S, other=0), tl.load(cs_ptr + r + 1, mask=o < S, other=0)
                n = tl.load(prefix_ptr + hi - 1, mask=(o < S) & (hi > 0), other=0.0) - tl.load(
                    prefix_ptr + lo - 1, mask=(o < S) & (lo > 0), other=0.0)
            else:
                n = tl.load(counts_ptr + o, mask=o < S, other=0).to(tl.float64)
            w = tl.where(n > 0, 1.0 / tl.where(n > 0, n, 1.0), 0.0) * inv_d
        tl.store(out_ptr + o, w, mask=o < S)


def segment_weights(counts, cu_segments, reduction, den=None):
    """Per-segment weights float64 [S] from counts int64 [S] (see `_segment_weights_kernel`); cu_segments:
    [R+1] or None; reduction: a code of modes.REDUCTION; den: None, a float or a one-element tensor."""
    S = counts.numel()
    out = torch.empty(S, dtype=torch.float64, device=counts.device)
    if S == 0:
        return out
    R = 0 if cu_segments is None else cu_segments.numel() - 1
    rollouts = reduction == modes.REDUCTION_ROLLOUT_MEAN and cu_segments is not None
    prefix = torch.empty(S if rollouts else 1, dtype=torch.float64, device=counts.device)
    kind = 0 if den is None else (2 if isinstance(den, torch.Tensor) else 1)
    hi = float(np.float32(den)) if kind == 1 else 0.0
    lo = float(np.float32(den - hi)) if kind == 1 else 0.0
    block = WEIGHTS_BLOCK if counts.device.type == "cuda" else triton.next_power_of_2(max(S, R, 16))
    with device_guard(counts):
        _segment_weights_kernel[(1,)](counts, cu_segments if rollouts else counts, den if kind == 2 else out, prefix,
                                      out, S, R, max(1, R.bit_length()), hi, lo, REDUCTION=reduction,
                                      HAS_CS=cu_segments is not None, DEN=kind, BLOCK=block)
    return out


# What tests/test_aot.py compiles: the counts with both index dtypes; the weights in each reduction and
# denominator kind.
AOT = [("_segment_counts_kernel", {"mask_ptr": "*u8", "cu_ptr": f"*{idx}", "counts_ptr": "*i64", "T": "i64"},
        {"BLOCK": BLOCK}) for idx in ("i32", "i64")]
AOT += [("_segment_weights_kernel",
         dict(counts_ptr="*i64", cs_ptr="*i64", den_ptr="*fp64", prefix_ptr="*fp64", out_ptr="*fp64", S="i64",
              R="i64", LOG_R="i32", den_hi="fp32", den_lo="fp32"),
         {"REDUCTION": red, "HAS_CS": cs, "DEN": den, "BLOCK": WEIGHTS_BLOCK})
        for red, cs, den in [(modes.REDUCTION_TOKEN_MEAN, False, 0), (modes.REDUCTION_SEGMENT_MEAN, False, 1),
                             (modes.REDUCTION_ROLLOUT_MEAN, True, 2), (modes.REDUCTION_ROLLOUT_MEAN, True, 0),
                             (modes.REDUCTION_SUM, False, 0)]]
