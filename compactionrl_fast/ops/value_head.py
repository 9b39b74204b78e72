"""`value_head` and `value_head_loss`: the critic's scalar head over packed hidden states, and the head
followed by the value loss (docs/ops.md).

Backends: "triton" (kernels/value_head.py), "cpp" (csrc/cpu/value_head.cpp: row dot products, the
backward in one pass over `hidden`), "torch-tuned" (matmuls, in row chunks for bf16/fp16 so that no float32
copy of `hidden` exists) and "torch" (the float64 reference, `compactionrl_fast.reference.value_head`, by
autograd). Each backend but "torch" is a pair of custom ops (value_head_fwd[_triton|_torch] and
value_head_bwd[...]), the forward's autograd formula calling the backward. All accumulate in float32 and
return float32 values; triton and cpp reduce d_weight in a fixed order (bitwise at any thread count),
torch-tuned's matmuls in MKL's (which depends on the CPU and the threads). The backward reads `hidden` once (for
d_weight; d_hidden needs only the gradient and the weight), so the head plus loss reads `hidden` once
forward and once backward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import resolve_backend
from ..reference import losses as ref
from ._register import register_op
from ._registry import OpSpec, declare, wave
from ._validate import check_tensor
from .value_loss import value_loss

HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_ELEMS = 1 << 22  # rows per chunk * H for the torch path's float32 upcast (16 MiB)


def _rows(H):
    """Rows per chunk of the torch path at width H."""
    return max(1, CHUNK_ELEMS // max(H, 1))


def _torch_fwd(hidden, w32, b32):
    if hidden.dtype == torch.float32:
        out = torch.mv(hidden, w32)
    else:
        T, H = hidden.shape
        out = torch.empty(T, dtype=torch.float32, device=hidden.device)
        c = _rows(H)
        for i in range(0, T, c):
            torch.mv(hidden[i:i + c].float(), w32, out=out[i:i + c])
    return out if b32 is None else out + b32


def _masked_rows(h, g):
    """h [c, H] float32 with the rows of zero gradient g [c] set to 0: a masked token's row adds nothing
    to d_weight even if it holds inf/NaN (the C++ and Triton kernels skip those rows)."""
    return torch.where((g != 0)[:, None], h, 0.0)


def _zero_rows_of_zero_grad(dh, g, w32):
    """d_hidden = outer(g, w) with its rows of zero gradient set to exactly 0 (in place): 0 times an inf/NaN
    weight is NaN, and a masked token's gradient is 0 (the C++ and Triton kernels write 0 there). On CPU only
    when w is not finite (an O(H) check, no sync); on CUDA always (a check would be a host sync)."""
    if w32.device.type != "cpu" or not bool(torch.isfinite(w32).all()):
        dh.masked_fill_((g == 0)[:, None], 0.0)
    return dh


def _torch_bwd(hidden, w32, g, need_dh, need_dw):
    """d_hidden (hidden's dtype) and d_weight (float32, chunks added in a fixed order; inside a chunk MKL's).

    Rows whose gradient is 0 get d_hidden 0 and add nothing to d_weight. float32 on CPU: one gemv, redone with
    those rows zeroed only when it is not finite (an O(H) check, no sync on CPU); elsewhere the chunks are
    masked as they are upcast.
    """
    T, H = hidden.shape
    if hidden.dtype == torch.float32 and (hidden.device.type == "cpu" or not need_dw):
        dh = _zero_rows_of_zero_grad(torch.outer(g, w32), g, w32) if need_dh else None
        dw = torch.mv(hidden.t(), g) if need_dw else None
        if need_dw and not torch.compiler.is_compiling() and not bool(torch.isfinite(dw).all()):
            dw = torch.zeros(H, dtype=torch.float32, device=hidden.device)
            c = _rows(H)
            for i in range(0, T, c):
                dw += torch.mv(_masked_rows(hidden[i:i + c], g[i:i + c]).t(), g[i:i + c])
        return dh, dw
    c = _rows(H)
    dh = torch.empty_like(hidden) if need_dh else None
    dw = torch.zeros(H, dtype=torch.float32, device=hidden.device) if need_dw else None
    for i in range(0, T, c):
        if need_dh:
            dh[i:i + c] = _zero_rows_of_zero_grad(torch.outer(g[i:i + c], w32), g[i:i + c], w32)
        if need_dw:
            h32, g_c = hidden[i:i + c].float(), g[i:i + c]
            # the upcast is a fresh copy unless hidden is float32: mask it in place then
            h32 = h32.masked_fill_((g_c == 0)[:, None], 0.0) if hidden.dtype != torch.float32 else _masked_rows(h32, g_c)
            dw += torch.mv(h32.t(), g_c)
    return dh, dw


# ---------------------------------------------------------------- custom ops, one pair per backend
# fwd: (hidden [T, H], weight float32 [H], bias float32 [] or None) -> float32 [T]
# bwd: (hidden, weight, grad float32 [T], need_dh, need_dw) -> (d_hidden [T, H] or [0], d_weight float32 [H] or [0])
# The C++ pair comes from csrc/; the Triton pair wraps kernels/value_head.py; the torch pair is above.


def _fwd_fake(hidden, weight, bias):
    return weight.new_empty(hidden.shape[0], dtype=torch.float32)


def _bwd_fake(hidden, weight, grad, need_dh, need_dw):
    return (hidden.new_empty(hidden.shape if need_dh else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,), dtype=torch.float32))


def _fwd_torch(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return _torch_fwd(hidden, weight, bias)


def _bwd_outputs(hidden, weight, dh, dw):
    """A bwd op's outputs: a gradient not asked for is an empty tensor ([0]; the op schema has no None)."""
    return (hidden.new_empty(0) if dh is None else dh), (weight.new_empty(0) if dw is None else dw)


def _bwd_torch(hidden: Tensor, weight: Tensor, grad: Tensor, need_dh: bool, need_dw: bool) -> tuple[Tensor, Tensor]:
    return _bwd_outputs(hidden, weight, *_torch_bwd(hidden, weight, grad, need_dh, need_dw))


def _fwd_triton(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    from ..kernels.value_head import value_head_fwd

    return value_head_fwd(hidden, weight, bias)


def _bwd_triton(hidden: Tensor, weight: Tensor, grad: Tensor, need_dh: bool, need_dw: bool) -> tuple[Tensor, Tensor]:
    from ..kernels.value_head import value_head_bwd

    return _bwd_outputs(hidden, weight, *value_head_bwd(hidden, weight, grad, need_dh, need_dw))


def _setup_context(ctx, inputs, output):
    hidden, weight, _ = inputs
    ctx.save_for_backward(hidden, weight)


def _backward_of(bwd_name):
    """The autograd formula of a fwd op: its backend's bwd op (d hidden, d weight), and d bias = sum(grad).
    The caller's float32 copies of weight and bias carry the gradients back to their dtypes and shapes."""

    def backward(ctx, grad):
        hidden, w32 = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad
        g = grad.float().contiguous()
        dh, dw = getattr(torch.ops.compactionrl_fast, bwd_name)(hidden, w32, g, need_dh, need_dw)
        return (dh if need_dh else None), (dw if need_dw else None), (g.sum() if need_db else None)

    return backward


for _fwd, _bwd, _fwd_impl, _bwd_impl in (("value_head_fwd", "value_head_bwd", None, None),  # C++, where built
                                         ("value_head_fwd_triton", "value_head_bwd_triton", _fwd_triton, _bwd_triton),
                                         ("value_head_fwd_torch", "value_head_bwd_torch", _fwd_torch, _bwd_torch)):
    register_op(_bwd, _bwd_fake, _bwd_impl)
    register_op(_fwd, _fwd_fake, _fwd_impl, backward=_backward_of(_bwd), setup_context=_setup_context)


# ---------------------------------------------------------------- public functions


def _check_head(hidden, weight, bias):
    check_tensor("hidden", hidden, dtypes=HIDDEN_DTYPES, ndim=2)
    H, device = hidden.shape[1], hidden.device
    check_tensor("weight", weight, dtypes=HIDDEN_DTYPES + (torch.float64,), device=device)
    if weight.dim() == 2 and weight.shape[0] == 1:  # an nn.Linear(H, 1) weight
        weight = weight.reshape(-1)
    check_tensor("weight", weight, ndim=1, numel=H)
    if bias is not None:
        check_tensor("bias", bias, dtypes=HIDDEN_DTYPES + (torch.float64,), device=device, numel=1)
    return weight


def value_head(hidden, weight, bias=None, *, backend="auto"):
    """Scalar value head over packed tokens: values = hidden @ weight + bias, accumulated in float32.

    Args:
        hidden: [T, H] bf16/fp16/fp32. weight: [H] (or an nn.Linear(H, 1) weight [1, H]).
        bias: one element or None. backend: "auto" | "triton" | "cpp" | "torch-tuned" | "torch" (the float64
        reference).

    Returns:
        values: [T] float32, differentiable in hidden, weight and bias (gradients in their dtypes).

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> crf.value_head(torch.ones(2, 3, dtype=torch.bfloat16), torch.tensor([1.0, 2.0, 3.0]),
        ...                torch.tensor(0.5)).tolist()
        [6.5, 6.5]
    """
    weight = _check_head(hidden, weight, bias)
    b = resolve_backend(backend, hidden.device, op="value_head", dtype=hidden.dtype)
    if b == "torch":
        return ref.value_head(hidden, weight, bias).float()
    b32 = None if bias is None else bias.float().reshape(())
    return _dispatch.custom_op("value_head", b)(hidden.contiguous(), weight.float().contiguous(), b32)


def value_head_loss(hidden, weight, bias, old_values, returns, loss_mask, **value_loss_kwargs):
    """`value_loss(value_head(hidden, weight, bias), old_values, returns, loss_mask, **value_loss_kwargs)`.

    `hidden` is read once forward and once backward (for d_weight); the [T] values and their gradient are
    the only intermediates. Gradients flow to hidden, weight and bias. `backend` (in the kwargs) picks the
    head's backend where it has it ("cuda": "auto" then), and the loss's where it has it ("torch-tuned": "auto").

    Returns:
        (loss float32 [], metrics dict as for `value_loss`).
    """
    backend = value_loss_kwargs.pop("backend", "auto")
    head = backend if _dispatch.has_backend("value_head", backend) else "auto"
    loss = backend if _dispatch.has_backend("value_loss", backend) else "auto"
    _check_head(hidden, weight, bias)
    if resolve_backend(head, hidden.device, op="value_head", dtype=hidden.dtype) == "torch":
        # the reference head is plain autograd: it reads no non-trainable row only if they are zeroed (docs/ops.md)
        check_tensor("loss_mask", loss_mask, dtypes=(torch.bool,), ndim=1, device=hidden.device, numel=hidden.shape[0])
        hidden = torch.where(loss_mask[:, None], hidden, 0.0)
    return value_loss(value_head(hidden, weight, bias, backend=head), old_values, returns, loss_mask, backend=loss,
                      **value_loss_kwargs)


# ---------------------------------------------------------------- the op's entry in the registry (ops/_registry.py)


def _cases(device):
    def case(T, H, bias):
        return dict(hidden=wave(T * H, 0.37, device).reshape(T, H), weight=wave(H, 1.3, device) / H ** 0.5,
                    bias=torch.full((), 0.25, device=device) if bias else None)
    return {"small": case(1, 64, True), "large": case(1000, 96, False), "no bias": case(33, 8, False)}


SPEC = declare(OpSpec(
    "value_head", cuda=("triton", "torch-tuned", "torch"), cpu=("cpp", "torch-tuned", "triton", "torch"),
    ops={"triton": "value_head_fwd_triton", "cpp": "value_head_fwd", "torch-tuned": "value_head_fwd_torch"},
    fn=value_head, reference=ref.value_head, cases=_cases, grads=("hidden", "weight", "bias"), tol=(1e-5, 1e-5),
    kernels=("value_head",), bench="bench_losses", speed=("value_head_loss",), also=("value_head_loss",)))
