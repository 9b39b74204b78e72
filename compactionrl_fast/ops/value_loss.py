"""`value_loss`: the masked (clipped) value loss over packed tokens, forward and backward fused
(docs/ops.md).

Backends: "triton" (kernels/value_loss.py, custom op `compactionrl_fast::value_loss_triton`), "cuda" and
"cpp" (csrc/, op `compactionrl_fast::value_loss`), "torch" (the float64 reference). As for the policy
loss, the kernels write the weighted per-token gradient in the forward pass and the backward scales it;
fake implementations and autograd formulas are registered with torch.library.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference import losses as ref
from ._dispatch import custom_op, resolve_backend
from ._reduction import REDUCTIONS, segment_weights
from ._register import loss_autograd, register_op
from ._registry import LARGE, SMALL, OpSpec, declare, packed, wave
from ._validate import (FLOAT_DTYPES, check_choice, check_denominator, check_float, check_layout, check_tensor,
                        loss_dtype)

METRICS = ("clip_fraction", "value_mean", "explained_variance")


# ---------------------------------------------------------------- custom ops: fake impls and autograd
# (values, old_values, returns, loss_mask, cu_seqlens?, seg_scale [S] float64, clip (< 0: off), need_grad)
#   -> (loss [] float32, metrics [3] float32, grad [T] or [0] in the inputs' type)
# The float inputs share one type: float32, or float64 (the cpp op only; ops/_dispatch.py refuses it elsewhere).


def _fake(values, old_values, returns, loss_mask, cu_seqlens, seg_scale, clip, need_grad):
    T, f32 = values.shape[0], torch.float32
    return (values.new_empty((), dtype=f32), values.new_empty(len(METRICS), dtype=f32),
            values.new_empty(T if need_grad else 0))


def _triton_op(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, cu_seqlens: Optional[Tensor],
               seg_scale: Tensor, clip: float, need_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    from ..kernels.value_loss import value_loss_fwd

    return value_loss_fwd(values, old_values, returns, loss_mask, cu_seqlens, seg_scale, clip, need_grad)


register_op("value_loss_triton", _fake, _triton_op, **loss_autograd("value_loss_triton", 8))
register_op("value_loss", _fake, **loss_autograd("value_loss", 8))  # the C++ op (csrc/), where built


# ---------------------------------------------------------------- public function


def value_loss(values, old_values, returns, loss_mask, *, clip=None, cu_seqlens=None, cu_segments=None,
               reduction="token-mean", denominator=None, backend="auto"):
    """Masked value loss over packed tokens, with its metrics from the same pass.

    Per trainable token: 0.5 * (v - R)^2, or with `clip` eps: 0.5 * max((v - R)^2, (v_clip - R)^2),
    v_clip = old + clamp(v - old, -eps, eps). The loss is sum_t w_t * l_t with the weights of `reduction`
    (see compactionrl_fast/ops/_reduction.py); `denominator` as in `ppo_policy_loss`.

    Args:
        values: [T] float, requires grad (the only input that receives a gradient).
        old_values, returns: [T] float (old_values is read only with `clip`). A float64 input is computed in
            float64 by "cpp" and "torch" and refused by "triton" and "cuda" (docs/ops.md).
        loss_mask: [T] bool. cu_seqlens [S+1], cu_segments [R+1]: as in `ppo_policy_loss`.
        clip: None or eps >= 0. reduction, denominator, backend: as in `ppo_policy_loss`.

    Returns:
        (loss: float32 [], metrics: dict of float32 [] tensors "clip_fraction", "value_mean",
        "explained_variance" (1 - Var(R - v) / Var(R) over trainable tokens; 0 if Var(R) = 0)). A NaN
        on a trainable token (values, returns, or old_values with `clip`) makes the loss NaN on every
        backend, and that token's gradient NaN; inf/NaN on non-trainable tokens change nothing (docs/ops.md,
        "Non-finite input").

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> v = torch.tensor([1.0, 5.0, 2.0], requires_grad=True)
        >>> loss, m = crf.value_loss(v, v.detach(), torch.tensor([0.0, 0.0, 0.0]), torch.tensor([True, False, True]))
        >>> loss.backward(); loss.item(), v.grad.tolist()
        (1.25, [0.5, 0.0, 1.0])
    """
    check_tensor("loss_mask", loss_mask, dtypes=(torch.bool,), ndim=1)
    device, T = loss_mask.device, loss_mask.numel()
    for name, t in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=1, device=device, numel=T)
    if clip is not None:
        clip = check_float("clip", clip, 0.0, float("inf"))
    check_choice("reduction", reduction, REDUCTIONS)
    denominator = check_denominator(denominator, reduction)
    cu_segments = check_layout(loss_mask, cu_seqlens, cu_segments)
    dt = loss_dtype(values, old_values, returns)
    b = resolve_backend(backend, device, op="value_loss", dtype=dt)

    if b == "torch":
        loss, m = ref.value_loss(values, old_values, returns, loss_mask, clip=clip, cu_seqlens=cu_seqlens,
                                 cu_segments=cu_segments, reduction=reduction, denominator=denominator)
        return loss.to(device, torch.float32), {k: v.to(device, torch.float32) for k, v in m.items()}

    seg_scale = segment_weights(loss_mask, cu_seqlens, cu_segments, reduction, denominator, backend=b)
    need_grad = torch.is_grad_enabled() and values.requires_grad
    cast = lambda t: t.detach().to(dt).contiguous()  # noqa: E731
    op = custom_op("value_loss", b)
    loss, metrics, _ = op(values.to(dt).contiguous(), cast(old_values), cast(returns), loss_mask.contiguous(),
                          None if cu_seqlens is None else cu_seqlens.contiguous(), seg_scale,
                          -1.0 if clip is None else clip, need_grad)
    return loss, dict(zip(METRICS, metrics.detach().unbind(0)))


# ---------------------------------------------------------------- the op's entry in the registry (ops/_registry.py)


def _cases(device):
    def case(layout, reduction, clip):
        b = packed(device, *layout)
        T = b["loss_mask"].numel()
        old = wave(T, 1.3, device)
        return dict(values=old + 0.3 * wave(T, 0.7, device), old_values=old, returns=wave(T, 1.9, device),
                    loss_mask=b["loss_mask"], cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"],
                    reduction=reduction, clip=clip)
    return {"small": case(SMALL, "token-mean", 0.2), "large": case(LARGE, "segment-mean", None),
            "rollout-mean": case(SMALL, "rollout-mean", 0.1)}


SPEC = declare(OpSpec(
    "value_loss", cuda=("triton", "cuda", "torch"), cpu=("cpp", "triton", "torch"),
    ops={"triton": "value_loss_triton", "cuda": "value_loss", "cpp": "value_loss"},
    fn=value_loss, reference=ref.value_loss, cases=_cases, grads=("values",),
    kernels=("value_loss", "segments"), bench="bench_losses", speed=("value_loss",)))
