"""Triton kernels for per-segment metadata over packed tokens: trainable-token counts.

Offsets are clamped to [0, T] and a segment that ends before it starts counts 0, so bad `cu_seqlens`
(unchecked on CUDA, see compactionrl_fast/ops/_validate.py) give wrong counts, never a bad access.
"""
import contextlib

import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)

BLOCK = 1024  # mask bytes per loop step on GPU
INTERPRET_BLOCK = 1 << 16  # the interpreter pays per operation, not per element


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


def sanitize_offsets(cu, total):
    """int64 offsets that are always safe to index with: clamped to [0, total], first 0, last `total`,
    non-decreasing. Valid offsets come back unchanged; bad ones give a wrong layout, never a bad access.
    cu: [N+1] int32/int64 -> int64 [N+1]."""
    c = cu.long().clamp(0, total)
    if c.numel():
        c[0], c[-1] = 0, total
    return torch.cummax(c, 0).values


def device_guard(t):
    """Launch on `t`'s device, not the current one (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def segment_counts(loss_mask, cu_seqlens):
    """Trainable tokens per segment. loss_mask: [T] bool; cu_seqlens: [S+1] int32/int64 -> int64 [S]."""
    T, S = loss_mask.numel(), cu_seqlens.numel() - 1
    counts = torch.empty(S, dtype=torch.int64, device=loss_mask.device)
    if S > 0:
        block = BLOCK if loss_mask.device.type == "cuda" else INTERPRET_BLOCK
        with device_guard(loss_mask):
            _segment_counts_kernel[(S,)](loss_mask.view(torch.uint8), cu_seqlens, counts, T, BLOCK=block)
    return counts


def _sig(idx):
    return {"mask_ptr": "*u8", "cu_ptr": f"*{idx}", "counts_ptr": "*i64", "T": "i64"}


# compiled ahead of time for sm_80/sm_90 by tests/test_aot.py
AOT_SPECS = [("_segment_counts_kernel", _sig(idx), {"BLOCK": BLOCK}) for idx in ("i32", "i64")]
