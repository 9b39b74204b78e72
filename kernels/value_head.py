"""Triton kernels of `value_head` (docs/ops.md): values[T] = hidden[T, H] @ weight[H] + bias with float32
accumulation for bf16/fp16/fp32 hidden, and its backward, which reads `hidden` once to produce both
d_hidden and d_weight. d_weight is reduced deterministically: a fixed grid of programs writes per-program
partial rows [P, H], which a second pass adds in program order (no float atomics).

The launchers run on their tensors' device and have no autograd; compactionrl_fast/ops/value_head.py registers
them as custom ops.
"""
import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard, empty

MAX_PROGRAMS = 256  # row-block programs of the backward; fixed, so the d_weight sum order is too


@triton.jit(do_not_specialize=["T"])
def value_head_fwd_kernel(h, w, b, out, T, H, stride_t, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
                          BH: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_acc = tl.zeros([BT], dtype=tl.float32)
    for i_h in range(0, tl.cdiv(H, BH)):
        o_h = i_h * BH + tl.arange(0, BH)
        m_h = o_h < H
        # [BT, BH]
        b_h = tl.load(h + o_t[:, None] * stride_t + o_h[None, :], mask=m_t[:, None] & m_h[None, :],
                      other=0.0).to(tl.float32)
        # [BH]
        b_w = tl.load(w + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_acc += tl.sum(b_h * b_w[None, :], 1)
    if HAS_BIAS:
        b_acc += tl.load(b).to(tl.float32)
    tl.store(out + o_t, b_acc, mask=m_t)


@triton.jit(do_not_specialize=["T"])
def value_head_bwd_kernel(h, w, g, dh, dw_part, T, H, stride_t, n_blocks, NEED_DH: tl.constexpr,
                          NEED_DW: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    # program (i_p, i_h): columns [i_h*BH, +BH) of row blocks i_p, i_p + n_prog, ...
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    n_prog = tl.num_programs(0)
    o_h = i_h.to(tl.int64) * BH + tl.arange(0, BH)
    m_h = o_h < H
    # [BH]
    b_w = tl.load(w + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BH], dtype=tl.float32)
    for i_b in range(i_p, n_blocks, n_prog):
        o_t = tl.arange(0, BT).to(tl.int64) + i_b * BT  # int64 offsets: T * H may exceed 2^31
        m_t = o_t < T
        m = m_t[:, None] & m_h[None, :]
        # [BT]
        b_g = tl.load(g + o_t, mask=m_t, other=0.0).to(tl.float32)
        if NEED_DH:
            # a zero-gradient row (a masked token) gets 0, not 0 * an inf/NaN weight
            b_dh = tl.where(b_g[:, None] != 0.0, b_g[:, None] * b_w[None, :], 0.0)
            tl.store(dh + o_t[:, None] * stride_t + o_h[None, :], b_dh.to(dh.dtype.element_ty), mask=m)
        if NEED_DW:
            # [BT, BH]
            b_h = tl.load(h + o_t[:, None] * stride_t + o_h[None, :], mask=m, other=0.0).to(tl.float32)
            # a zero-gradient row (a masked token) adds nothing, even if it holds inf/NaN
            b_dw += tl.sum(tl.where(b_g[:, None] != 0.0, b_h * b_g[:, None], 0.0), 0)
    if NEED_DW:
        tl.store(dw_part + i_p.to(tl.int64) * H + o_h, b_dw, mask=m_h)


def value_head_fwd(hidden, weight, bias, BT=32, BH=128):
    """hidden [T, H] contiguous, weight float32 [H], bias float32 [] or None -> float32 [T]."""
    T, H = hidden.shape
    out = empty(T, device=hidden.device)
    if T:
        with device_guard(hidden):
            value_head_fwd_kernel[(triton.cdiv(T, BT),)](hidden, weight, weight if bias is None else bias, out, T, H,
                                                         hidden.stride(0), HAS_BIAS=bias is not None, BT=BT, BH=BH)
    return out


def value_head_bwd(hidden, weight, grad, need_dh=True, need_dw=True, BT=32, BH=128):
    """(d_hidden [T, H] in hidden's dtype or None, d_weight float32 [H] or None) for grad float32 [T];
    hidden contiguous, weight float32 [H]."""
    T, H = hidden.shape
    n_blocks = triton.cdiv(T, BT)
    n_prog = max(1, min(n_blocks, MAX_PROGRAMS))
    dh = empty(T, H, dtype=hidden.dtype, device=hidden.device) if need_dh else None
    part = empty(n_prog, H, device=hidden.device) if need_dw else None
    if T and (need_dh or need_dw):
        with device_guard(hidden):
            value_head_bwd_kernel[(n_prog, triton.cdiv(H, BH))](
                hidden, weight, grad, hidden if dh is None else dh, grad if part is None else part, T, H,
                hidden.stride(0), n_blocks, NEED_DH=need_dh, NEED_DW=need_dw, BT=BT, BH=BH)
    dw = None
    if need_dw:
        dw = part.sum(0) if T else torch.zeros(H, device=hidden.device)
    return dh, dw


# What tests/test_aot.py compiles: the forward in bf16 and fp32, the backward in every hidden dtype.
AOT = [
    ("value_head_fwd_kernel",
     {"h": f"*{dt}", "w": "*fp32", "b": "*fp32", "out": "*fp32", "T": "i32", "H": "i32", "stride_t": "i64",
      "HAS_BIAS": "constexpr", "BT": "constexpr", "BH": "constexpr"},
     {"HAS_BIAS": True, "BT": 32, "BH": 128})
    for dt in ("bf16", "fp32")
] + [
    ("value_head_bwd_kernel",
     {"h": f"*{dt}", "w": "*fp32", "g": "*fp32", "dh": f"*{dt}", "dw_part": "*fp32", "T": "i32", "H": "i32",
      "stride_t": "i64", "n_blocks": "i32", "NEED_DH": "constexpr", "NEED_DW": "constexpr", "BT": "constexpr",
      "BH": "constexpr"},
     {"NEED_DH": True, "NEED_DW": True, "BT": 32, "BH": 128})
    for dt in ("bf16", "fp16", "fp32")
]
