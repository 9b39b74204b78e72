"""`ppo_policy_loss`: the masked clipped-PPO policy loss over packed tokens, forward and backward fused
(docs/ops.md).

Backends: "triton" (kernels/ppo_loss.py, wrapped as the custom op `compactionrl_fast::ppo_policy_loss_triton`),
"cuda" and "cpp" (csrc/, op `compactionrl_fast::ppo_policy_loss`), "torch" (the float64 reference).
The kernels write the per-token gradient (times its reduction weight) during the forward pass; the
backward is that saved [T] buffer times the incoming gradient. Both ops have fake implementations and
autograd formulas registered with torch.library, so torch.compile traces them without a graph break.
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

METRICS = ("clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_max", "log_ratio")
INF = float("inf")
NO_DUAL_CLIP = float(torch.finfo(torch.float32).max)  # -c*A stays finite or +-inf, never 0*inf = NaN


# ---------------------------------------------------------------- custom ops: fake impls and autograd
# Shared by the C++ op and the Triton op (same signature):
#   (logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs?, cu_seqlens?, seg_scale [S] float64,
#    clip_low, clip_high, dual_clip (float32 max: off), tis_cap (inf: no cap), need_grad)
#   -> (loss [] float32, metrics [5] float32 (METRICS order), grad [T] or [0] in the inputs' type)
# The float inputs share one type: float32, or float64 (the cpp op only; ops/_dispatch.py refuses it elsewhere).


def _fake(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, cu_seqlens, seg_scale, clip_low,
          clip_high, dual_clip, tis_cap, need_grad):
    T, f32 = logprobs.shape[0], torch.float32
    return (logprobs.new_empty((), dtype=f32), logprobs.new_empty(len(METRICS), dtype=f32),
            logprobs.new_empty(T if need_grad else 0))


def _triton_op(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
               rollout_logprobs: Optional[Tensor], cu_seqlens: Optional[Tensor], seg_scale: Tensor,
               clip_low: float, clip_high: float, dual_clip: float, tis_cap: float,
               need_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    from ..kernels.ppo_loss import ppo_loss_fwd

    return ppo_loss_fwd(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, cu_seqlens, seg_scale,
                        clip_low, clip_high, dual_clip, tis_cap, need_grad)


register_op("ppo_policy_loss_triton", _fake, _triton_op, **loss_autograd("ppo_policy_loss_triton", 12))
register_op("ppo_policy_loss", _fake, **loss_autograd("ppo_policy_loss", 12))  # the C++ op (csrc/), where built


# ---------------------------------------------------------------- public function


def ppo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, *, cu_seqlens=None, cu_segments=None,
                    clip_low=0.2, clip_high=0.2, dual_clip=None, rollout_logprobs=None, tis_cap=None,
                    reduction="token-mean", denominator=None, backend="auto"):
    """Masked clipped-PPO policy loss over packed tokens, with its metrics from the same pass.

    Per trainable token, with ratio = exp(logprobs - old_logprobs) and A = advantages:
    l = max(-ratio*A, -clip(ratio, 1-clip_low, 1+clip_high)*A); with `dual_clip` c > 1, l = min(l, -c*A)
    where A < 0; with `rollout_logprobs`, l is multiplied by the truncated importance weight
    min(exp(old_logprobs - rollout_logprobs), tis_cap). The loss is sum_t w_t * l_t with the weights of
    `reduction` (see compactionrl_fast/ops/_reduction.py).

    Args:
        logprobs: [T] float, requires grad; the only input that receives a gradient.
        old_logprobs, advantages: [T] float (the behaviour policy's log-probs and the advantages). A float64
            input is computed in float64 by "cpp" and "torch" and refused by "triton" and "cuda" (docs/ops.md).
        loss_mask: [T] bool, True on trainable tokens; other positions are never read into the loss.
        cu_seqlens: [S+1] int32/int64 segment offsets (needed by "segment-mean"/"rollout-mean"; None: one
            segment). cu_segments: [R+1] rollout offsets into the segments (None: a rollout per segment).
        clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high].
        dual_clip: None or c > 1. rollout_logprobs: [T] float or None. tis_cap: None (no cap) or > 0.
        reduction: "token-mean" | "segment-mean" | "rollout-mean" | "sum".
        denominator: replaces the mode's local count (tokens, segments, rollouts): pass the global count
            (`global_token_count`, `global_denominator`) so that micro-batches and ranks add up to the
            full batch. A number >= 0 or a one-element tensor.
        backend: "auto" | "triton" | "cuda" | "cpp" | "torch".

    Returns:
        (loss: float32 [], metrics: dict of float32 [] tensors "clip_fraction", "dual_clip_fraction",
        "approx_kl" (mean of (ratio-1) - log ratio), "ratio_max", "log_ratio" (mean of logprobs -
        old_logprobs; verl's ppo_kl is its negative), over this call's trainable tokens; 0
        when there is none). A ratio past float32 (log-ratio > ~88.7) shows as inf in ratio_max and
        approx_kl (the float64 reference's value cast to float32); its token's loss is still exact when
        a clip binds or A = 0. A NaN on a trainable token makes the loss (and ratio_max, approx_kl for a
        NaN log-prob) NaN on every backend; inf/NaN on non-trainable tokens change nothing. Non-finite input in
        general: the float64 reference's values and autograd gradient, rounded (docs/ops.md, "Non-finite
        input"); e.g. a trainable token's log-ratio past float64 (> ~709.8, +inf) gives its gradient NaN
        where its branch is clipped or A = 0.

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
        >>> loss, m = crf.ppo_policy_loss(logp, logp.detach(), torch.tensor([1.0, 9.0, -1.0]),
        ...                               torch.tensor([True, False, True]))
        >>> loss.backward(); round(loss.item(), 4), logp.grad.tolist()
        (0.0, [-0.5, 0.0, 0.5])
    """
    check_tensor("loss_mask", loss_mask, dtypes=(torch.bool,), ndim=1)
    device, T = loss_mask.device, loss_mask.numel()
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=1, device=device, numel=T)
    if rollout_logprobs is not None:
        check_tensor("rollout_logprobs", rollout_logprobs, dtypes=FLOAT_DTYPES, ndim=1, device=device, numel=T)
    clip_low = check_float("clip_low", clip_low, 0.0, 1.0)
    clip_high = check_float("clip_high", clip_high, 0.0, INF)
    if dual_clip is not None and check_float("dual_clip", dual_clip, 1.0, INF) <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap needs rollout_logprobs (the inference engine's log-probs)")
        if check_float("tis_cap", tis_cap, 0.0, INF) <= 0.0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    check_choice("reduction", reduction, REDUCTIONS)
    denominator = check_denominator(denominator, reduction)
    cu_segments = check_layout(loss_mask, cu_seqlens, cu_segments)
    dt = loss_dtype(logprobs, old_logprobs, advantages, rollout_logprobs)
    b = resolve_backend(backend, device, op="ppo_policy_loss", dtype=dt)

    if b == "torch":
        loss, m = ref.ppo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens=cu_seqlens,
                                      cu_segments=cu_segments, clip_low=clip_low, clip_high=clip_high,
                                      dual_clip=dual_clip, rollout_logprobs=rollout_logprobs, tis_cap=tis_cap,
                                      reduction=reduction, denominator=denominator)
        return loss.to(device, torch.float32), {k: v.to(device, torch.float32) for k, v in m.items()}

    seg_scale = segment_weights(loss_mask, cu_seqlens, cu_segments, reduction, denominator, backend=b)
    need_grad = torch.is_grad_enabled() and logprobs.requires_grad
    cast = lambda t: t.detach().to(dt).contiguous()  # noqa: E731
    op = custom_op("ppo_policy_loss", b)
    loss, metrics, _ = op(logprobs.to(dt).contiguous(), cast(old_logprobs), cast(advantages), loss_mask.contiguous(),
                          None if rollout_logprobs is None else cast(rollout_logprobs),
                          None if cu_seqlens is None else cu_seqlens.contiguous(), seg_scale, clip_low, clip_high,
                          NO_DUAL_CLIP if dual_clip is None else float(dual_clip), INF if tis_cap is None else float(tis_cap),
                          need_grad)
    return loss, dict(zip(METRICS, metrics.detach().unbind(0)))


# ---------------------------------------------------------------- the op's entry in the registry (ops/_registry.py)


def _cases(device):
    def case(layout, reduction, **kw):
        b = packed(device, *layout)
        T = b["loss_mask"].numel()
        old = wave(T, 1.1, device) * 0.5 - 1.0
        return dict(logprobs=old + 0.3 * wave(T, 0.7, device), old_logprobs=old, advantages=wave(T, 1.9, device),
                    loss_mask=b["loss_mask"], cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"],
                    reduction=reduction, **{k: v(old) if callable(v) else v for k, v in kw.items()})
    tis = dict(rollout_logprobs=lambda old: old + 0.2 * wave(old.numel(), 2.9, device), tis_cap=2.0)
    return {"small": case(SMALL, "token-mean"), "large": case(LARGE, "rollout-mean", **tis),
            "dual clip": case(SMALL, "segment-mean", clip_low=0.2, clip_high=0.28, dual_clip=3.0),
            "tensor denominator": case(SMALL, "token-mean", denominator=torch.full((), 40.0, device=device))}


SPEC = declare(OpSpec(
    "ppo_policy_loss", cuda=("triton", "cuda", "torch"), cpu=("cpp", "triton", "torch"),
    ops={"triton": "ppo_policy_loss_triton", "cuda": "ppo_policy_loss", "cpp": "ppo_policy_loss"},
    fn=ppo_policy_loss, reference=ref.ppo_policy_loss, cases=_cases, grads=("logprobs",),
    kernels=("ppo_loss", "segments"), bench="bench_losses", speed=("ppo_policy_loss",)))
