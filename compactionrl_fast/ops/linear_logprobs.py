"""`linear_logprobs`: log-probs and entropy of the LM head's softmax without [T, V] logits (docs/ops.md).

The tokens are processed in chunks of C rows: the logits `hidden_c @ W.T + b` of a chunk go into one
[C, V] buffer (a BLAS / cuBLAS matmul), then the per-row softmax work on z = logits / temperature runs
on it: in PyTorch ("torch-tuned", the CPU default) or in the Triton kernels of kernels/linear_logprobs.py
("triton", the CUDA default). Backward recomputes each chunk's logits, turns them into dL/dz in place
and runs the two gradient matmuls: 4 matmuls in all where the naive composition runs 3, in exchange
for O(C * V) memory. `linear_logprobs_loss` is the fused variant: the caller's (token-separable) loss
is applied inside the forward chunk loop, so the gradients come from the logits still in the buffer
(3 matmuls). "torch" is the float64 reference (`compactionrl_fast.reference.linear_logprobs`: the full
[T, V] logits, one chunk, plain autograd), for tests.

`linear_logprobs` is two custom ops, `compactionrl_fast::linear_logprobs_fwd` (the forward chunk loop)
and `compactionrl_fast::linear_logprobs_bwd` (the backward one), with fake impls and a registered
autograd formula, so torch.compile traces it without a graph break. `linear_logprobs_loss` takes a
Python callable, which a custom op schema cannot carry: it stays a torch.autograd.Function. The chunk
loops themselves are in compactionrl_fast/ops/_linear_logprobs_loop.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference.linear_logprobs import linear_logprobs as reference_linear_logprobs
from ._dispatch import resolve_backend
from ._linear_logprobs_loop import fused_forward, linear_logprobs_bwd, linear_logprobs_fwd
from ._register import register_op
from ._registry import OpSpec, declare, wave
from ._validate import check_float, check_tensor, value_checks

HIDDEN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Logits elements per chunk buffer when chunk_size is None. CPU: 64 MB of fp32 (512 rows at V = 32768:
# fewer rows make the matmuls too thin for BLAS). CUDA: 512 MB of bf16 (~1760 rows at V = 151936: large
# enough for cuBLAS, small next to the [V, H] fp32 weight-gradient accumulator).
CHUNK_ELEMS = {"cpu": 1 << 24, "cuda": 1 << 28}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def default_chunk_size(T: int, V: int, device: torch.device) -> int:
    """Rows per chunk: the CHUNK_ELEMS budget over V, a multiple of 16 when it can be, at most T."""
    c = max(1, CHUNK_ELEMS.get(device.type, CHUNK_ELEMS["cpu"]) // max(V, 1))
    if c >= 16:
        c -= c % 16
    return max(1, min(c, T))


# ---------------------------------------------------------------- custom ops: fake impls and autograd
# Optional outputs are [0] tensors when absent (a custom op returns tensors only).


def _empty0(t):
    return t.new_empty(0, dtype=torch.float32)


def _fwd_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, inv_t: float, C: int,
            want_entropy: bool, use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(lse, logp, entropy or [0], rowmax or [0], logsum or [0]), each [T] fp32 (see `linear_logprobs_fwd`)."""
    out = linear_logprobs_fwd(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton)
    return tuple(_empty0(hidden) if t is None else t for t in out)


def _fwd_fake(hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton):
    T = hidden.shape[0]
    row = lambda on: hidden.new_empty(T if on else 0, dtype=torch.float32)  # noqa: E731
    return row(True), row(True), row(want_entropy), row(not use_triton), row(not use_triton)


def _bwd_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, lse: Tensor, ent: Tensor,
            g_lp: Optional[Tensor], g_ent: Optional[Tensor], rowmax: Tensor, logsum: Tensor, inv_t: float, C: int,
            need_hidden: bool, need_weight: bool, need_bias: bool,
            use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(d hidden [T, H], d W [V, H], d b [V]) in the inputs' dtypes, [0] where not needed (see
    `linear_logprobs_bwd`). rowmax, logsum: [0] on the Triton path."""
    out = linear_logprobs_bwd(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, inv_t, C,
                              (need_hidden, need_weight, need_bias), use_triton, None if use_triton else rowmax,
                              None if use_triton else logsum)
    return tuple(hidden.new_empty(0) if g is None else g for g in out)


def _bwd_fake(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, rowmax, logsum, inv_t, C, need_hidden,
              need_weight, need_bias, use_triton):
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            weight.new_empty((weight.shape[0],) if need_bias else (0,)))


def _fwd_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, inv_t, C, want_entropy, use_triton = inputs
    lse, _, ent, rowmax, logsum = output
    ctx.save_for_backward(hidden, weight, bias, targets, lse, ent, rowmax, logsum)
    ctx.cfg = (inv_t, C, use_triton)
    ctx.set_materialize_grads(False)  # no zero [T] gradients for unused outputs


def _fwd_backward(ctx, g_lse, g_lp, g_ent, g_rowmax, g_logsum):
    """Recomputes the logits chunk by chunk (the backward op); only logp and the entropy carry gradients."""
    hidden, weight, bias, targets, lse, ent, rowmax, logsum = ctx.saved_tensors
    needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
    if (g_lp is None and g_ent is None) or not any(needs):
        return (None,) * 8
    inv_t, C, use_triton = ctx.cfg
    dh, dw, db = torch.ops.compactionrl_fast.linear_logprobs_bwd(
        hidden, weight, bias, targets, lse, ent, g_lp, g_ent, rowmax, logsum, inv_t, C, *needs, use_triton)
    return (dh if needs[0] else None, dw if needs[1] else None, db if needs[2] else None) + (None,) * 5


register_op("linear_logprobs_bwd", _bwd_fake, _bwd_op)
register_op("linear_logprobs_fwd", _fwd_fake, _fwd_op, backward=_fwd_backward, setup_context=_fwd_setup_context)


def _check_token_sum(token_loss, device, with_entropy):
    """The loss is the sum of the chunks' shares, which is the loss of all tokens only for a sum over tokens;
    such a loss is 0 on no tokens. One call on an empty chunk refuses the others (a constant, a mean, an
    offset) with a ValueError rather than a loss that depends on the chunk count."""
    empty = torch.zeros(0, device=device)
    with torch.no_grad():
        v = token_loss(empty, empty if with_entropy else None, slice(0, 0))
    if not isinstance(v, torch.Tensor) or v.numel() != 1:
        return  # _chunk_upstream raises the TypeError
    if float(v) != 0.0:
        raise ValueError(f"token_loss must be a sum over tokens (it is called once per chunk and the shares are "
                         f"added), but on an empty chunk it returned {float(v)}, not 0; a constant, a mean or an "
                         f"offset depends on the number of chunks: write it as a sum over the chunk's tokens, or "
                         f"pass chunk_size >= T (one chunk)")


class LinearLogprobsLossFunction(torch.autograd.Function):
    """The fused variant: the caller's loss is applied chunk by chunk inside the forward loop, so each
    chunk's gradients come from logits still in the buffer (3 matmuls, no recompute). Backward only
    scales the stored gradients by the upstream scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_loss, inv_t, C, want_entropy, use_triton):
        total, logp, ent, ctx.grads = fused_forward(hidden, weight, bias, targets, token_loss, inv_t, C, want_entropy,
                                                    use_triton, tuple(ctx.needs_input_grad[:3]))
        ctx.mark_non_differentiable(logp, *([ent] if want_entropy else []))
        return (total, logp, ent) if want_entropy else (total, logp)

    @staticmethod
    def backward(ctx, g_loss, *unused):
        if ctx.grads is None:
            raise RuntimeError(
                "linear_logprobs_loss: backward ran a second time through the same loss (retain_graph=True): "
                "its gradients are formed in the forward pass and handed out by the first backward only; "
                "call linear_logprobs_loss again for another backward")
        grads, ctx.grads = ctx.grads, None  # handed out (and scaled in place) once
        # the common loss.backward() passes 1: skip the scaling then (a free check on CPU; on CUDA it
        # would be a host sync, so the gradients are always scaled there)
        one = g_loss.device.type == "cpu" and not torch.compiler.is_compiling() and g_loss.item() == 1.0
        dh, dw, db = (g if g is None or one else g.mul_(g_loss.to(g.dtype)) for g in grads)
        return dh, dw, db, None, None, None, None, None, None


# ---------------------------------------------------------------- public function


def _check_inputs(hidden, weight, targets, bias, temperature, chunk_size, return_entropy,
                  entropy_name="return_entropy"):
    check_tensor("hidden", hidden, dtypes=HIDDEN_DTYPES, ndim=2)
    dev = hidden.device
    check_tensor("weight", weight, dtypes=(hidden.dtype,), ndim=2, device=dev)
    T, H = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight must be [V, H] with H={H} (hidden's last dim), got shape {tuple(weight.shape)}")
    if V == 0:
        raise ValueError("weight must have at least one row (vocabulary size V >= 1)")
    check_tensor("targets", targets, dtypes=(torch.int64, torch.int32), ndim=1, device=dev, numel=T)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,), ndim=1, device=dev, numel=V)
    temperature = check_float("temperature", temperature, 0.0, float("inf"))
    if not 0.0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature}")
    if 1.0 / temperature > FLOAT32_MAX:
        raise ValueError(f"temperature={temperature} is too small: the logits are scaled by 1/temperature in "
                         f"float32, and 1/{temperature} overflows it (> {FLOAT32_MAX:.4g})")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not isinstance(return_entropy, bool):
        raise TypeError(f"{entropy_name} must be a bool, got {type(return_entropy).__name__}")
    if T and value_checks(targets):  # reads targets (a host sync on CUDA: only with COMPACTIONRL_FAST_CHECKS=1)
        lo, hi = (int(x) for x in torch.stack([targets.min(), targets.max()]).tolist())
        if lo < 0 or hi >= V:
            bad = int(torch.nonzero((targets < 0) | (targets >= V))[0])
            raise ValueError(f"targets must be in [0, V={V}), got targets[{bad}]={int(targets[bad])}")
    return temperature


def linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, chunk_size=None,
                    return_entropy=False, backend="auto"):
    """Log-probs of `targets` (and the entropy) under softmax((hidden @ weight.T + bias) / temperature).

    Never materialises the [T, V] logits: tokens are processed in chunks of `chunk_size` rows, and
    backward recomputes each chunk's logits. Gradients flow to hidden, weight and bias from both outputs.

    Args:
        hidden: [T, H] bf16/fp16/fp32 final hidden states.
        weight: [V, H] LM-head weight, hidden's dtype.
        targets: [T] int64 (or int32) token ids in [0, V). Checked where value checks run (CPU tensors,
            or COMPACTIONRL_FAST_CHECKS=1: a ValueError); unchecked (CUDA by default), an out-of-range
            target gives logp NaN and no one-hot term in its row's gradient, never an out-of-bounds read.
        bias: [V] or None, hidden's dtype.
        temperature: float > 0, the sampler's temperature (logits are divided by it).
        chunk_size: rows per chunk; None picks about 64 MB of fp32 logits on CPU, 512 MB on CUDA.
        return_entropy: also return the entropy -sum_v p log p of each token's distribution.
        backend: "auto" (CUDA: "triton"; CPU: "torch-tuned") | "triton" | "torch-tuned" | "torch" (the float64
            reference: [T, V] logits, chunk_size unused).

    Returns:
        logprobs [T] float32, or (logprobs [T] float32, entropy [T] float32).

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> h, W = torch.randn(5, 8), torch.randn(11, 8)
        >>> y = torch.tensor([0, 3, 10, 2, 2])
        >>> lp, ent = crf.linear_logprobs(h, W, y, temperature=0.7, return_entropy=True, chunk_size=2)
        >>> ref = torch.log_softmax(h @ W.T / 0.7, -1)
        >>> torch.allclose(lp, ref[torch.arange(5), y], atol=1e-5)
        True
        >>> torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
        True
    """
    temperature = _check_inputs(hidden, weight, targets, bias, temperature, chunk_size, return_entropy)
    b = resolve_backend(backend, hidden.device, op="linear_logprobs", dtype=hidden.dtype)
    if b == "torch":
        out = reference_linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                        return_entropy=return_entropy)
        return tuple(x.float() for x in out) if return_entropy else out.float()
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk_size if chunk_size is not None else default_chunk_size(T, V, hidden.device)
    C = max(1, min(C, T))
    _, logp, ent, _, _ = torch.ops.compactionrl_fast.linear_logprobs_fwd(
        hidden, weight, bias, targets.long().contiguous(), 1.0 / temperature, C, return_entropy, b == "triton")
    return (logp, ent) if return_entropy else logp


def linear_logprobs_loss(hidden, weight, targets, token_loss, *, bias=None, temperature=1.0, chunk_size=None,
                         with_entropy=False, backend="auto"):
    """The fused variant: a loss of the log-probs (and entropy) whose gradients are formed in the forward pass.

    `token_loss(logprobs_c, entropy_c, sl)` is called once per token chunk `sl` (a slice of token indices)
    with the chunk's log-probs [c] (and entropy [c], or None unless `with_entropy`) and returns that chunk's
    scalar share of the loss; the loss is the sum of the shares. The loss must therefore be a sum over
    tokens, such as a PPO loss with a known denominator; index your own per-token tensors (advantages,
    old log-probs, mask) with `sl`. With more than one chunk, where value checks run (CPU tensors, or
    COMPACTIONRL_FAST_CHECKS=1), `token_loss` is first called once on an empty chunk (`sl` = slice(0, 0)):
    a value other than 0 there (a constant, a mean, an offset: not a sum over
    tokens) is a ValueError. Its gradients with respect to hidden, weight and bias are formed
    while each chunk's logits are in the buffer: 3 matmuls where `linear_logprobs` + autograd runs 4.
    Tensors captured by `token_loss` receive no gradient. Backward scales the stored gradients by the
    upstream gradient of the loss; they are held from forward to backward ([T, H] + [V, H] + [V]).
    Unlike `linear_logprobs` this is a torch.autograd.Function, not a custom op (an op schema cannot
    carry the Python callable `token_loss`): torch.compile runs it outside the graph.

    Args: as `linear_logprobs`; `with_entropy` passes (and returns) the entropy.

    Returns:
        (loss, logprobs [T] float32, entropy [T] float32 or None when not with_entropy), loss a 0-dim float32
        tensor that is differentiable; logprobs and entropy are not (they are for metrics).

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> h, W = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
        >>> y, adv = torch.tensor([0, 3, 10, 2, 2, 5]), torch.randn(6)
        >>> loss, lp, _ = crf.linear_logprobs_loss(h, W, y, lambda lp, ent, sl: -(adv[sl] * lp).sum() / 6,
        ...                                        chunk_size=4)
        >>> loss.backward()
        >>> ref = -(adv * torch.log_softmax(h @ W.T, -1)[torch.arange(6), y]).sum() / 6
        >>> gh, = torch.autograd.grad(ref, h)
        >>> torch.allclose(h.grad, gh, atol=1e-5) and torch.allclose(loss, ref, atol=1e-5)
        True
    """
    temperature = _check_inputs(hidden, weight, targets, bias, temperature, chunk_size, with_entropy,
                                entropy_name="with_entropy")
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable (logprobs_c, entropy_c, sl) -> scalar, got "
                        f"{type(token_loss).__name__}")
    b = resolve_backend(backend, hidden.device, op="linear_logprobs", dtype=hidden.dtype)
    if b == "torch":  # the reference: one chunk of float64 logits, plain autograd
        out = reference_linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                        return_entropy=True)
        logp, ent = (x.float() for x in out)
        loss = token_loss(logp, ent if with_entropy else None, slice(0, hidden.shape[0]))
        return loss.float(), logp.detach(), (ent.detach() if with_entropy else None)
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk_size if chunk_size is not None else default_chunk_size(T, V, hidden.device)
    C = max(1, min(C, T))
    if T > C and value_checks(hidden):  # a host read of its value: CPU, or COMPACTIONRL_FAST_CHECKS=1
        _check_token_sum(token_loss, hidden.device, with_entropy)
    out = LinearLogprobsLossFunction.apply(hidden, weight, bias, targets.long().contiguous(), token_loss,
                                           1.0 / temperature, C, with_entropy, b == "triton")
    return out if with_entropy else (*out, None)


# ---------------------------------------------------------------- the op's entry in the registry (ops/_registry.py)


def _cases(device):
    def case(T, H, V, **kw):
        targets = torch.arange(T, device=device) * 7919 % V
        return dict(hidden=wave(T * H, 0.37, device).reshape(T, H), weight=wave(V * H, 0.71, device).reshape(V, H),
                    targets=targets, **kw)
    return {"small": case(1, 32, 97), "large": case(300, 64, 1000, chunk_size=64, temperature=0.7,
                                                     return_entropy=True),
            "bias": case(40, 16, 50, bias=wave(50, 0.5, device) * 0.1, return_entropy=True)}


SPEC = declare(OpSpec(
    "linear_logprobs", cuda=("triton", "torch-tuned", "torch"), cpu=("torch-tuned", "triton", "torch"),
    ops={"triton": "linear_logprobs_fwd", "torch-tuned": "linear_logprobs_fwd"},
    fn=linear_logprobs, reference=reference_linear_logprobs, cases=_cases, grads=("hidden", "weight", "bias"),
    tol=(1e-4, 1e-5), kernels=("linear_logprobs",), bench="bench_linear_logprobs", speed=("linear_logprobs",),
    also=("linear_logprobs_loss",)))
