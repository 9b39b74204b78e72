"""Naive PyTorch oracles for `ppo_policy_loss`, `value_loss` and `value_head` (docs/ops.md), and the
padded-batch formulations of common PPO trainers they are checked against.

Float64, per-token math written out, reductions looped over segments and rollouts: slow and obviously
right. Gradients come from autograd through these functions. Every backend is tested against them and
benchmarked against them.
"""
from __future__ import annotations

import torch


def _bounds(cu):
    cu = [int(x) for x in cu.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def token_weights(loss_mask, cu_seqlens=None, cu_segments=None, reduction="token-mean", denominator=None):
    """float64 [T] weight of each token's loss (0 on non-trainable tokens), by looping over units.

    "token-mean": 1/D, D = trainable tokens; "segment-mean": 1/(n_s * D), D = segments with a trainable
    token; "rollout-mean": 1/(n_r * D), D = rollouts with a trainable token; "sum": 1. `denominator`
    replaces D; D = 0 gives weight 0.
    """
    m = loss_mask.detach().cpu()
    T = m.numel()
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    S = cu_seqlens.numel() - 1
    if cu_segments is None:
        cu_segments = torch.arange(S + 1)
    w = torch.zeros(T, dtype=torch.float64)
    if reduction == "sum":
        w[m] = 1.0
        return w
    if reduction == "token-mean":
        units = [(0, T)]
    elif reduction == "segment-mean":
        units = _bounds(cu_seqlens)
    else:
        segs = _bounds(cu_seqlens)
        units = [(segs[s0][0] if s0 < s1 else 0, segs[s1 - 1][1] if s0 < s1 else 0)
                 for s0, s1 in _bounds(cu_segments)]
    counts = [int(m[a:b].sum()) for a, b in units]
    if reduction == "token-mean":
        d = counts[0]
    else:
        d = sum(1 for n in counts if n > 0)
    if denominator is not None:
        d = float(denominator)
    for (a, b), n in zip(units, counts):
        if n > 0 and d > 0:  # masked_fill_ keeps float64 (a where of two Python floats would be float32)
            w[a:b].masked_fill_(m[a:b], 1.0 / d if reduction == "token-mean" else 1.0 / (n * d))
    return w


def _masked(t, m, grad=False):
    """float64 CPU copy of `t` [T] with 0 at the non-trainable positions (None stays None). Applied to the
    inputs, before any arithmetic: an inf/NaN there then cannot reach the loss or, through 0 * NaN in a
    backward, the gradient. `grad`: keep the autograd graph (logprobs, values)."""
    if t is None:
        return None
    t = t.cpu().double() if grad else t.detach().cpu().double()
    return torch.where(m, t, 0.0)


def _nan_grad_where_nan(loss_tok, x):
    """`loss_tok` with a NaN gradient into `x` at the tokens whose loss is NaN (the forward unchanged).

    docs/ops.md, "Non-finite input": a NaN loss term propagates into its token's gradient. Autograd alone does
    not always do that: a `torch.where` whose NaN branch is constant in `x` (the value clip's v_clip for a
    NaN old value) passes a 0 gradient, not NaN*0."""
    bad = loss_tok.detach().isnan()
    xb = torch.where(bad, x, 0.0)  # 0 where the loss is a number: no inf - inf below
    return loss_tok + (xb - xb.detach()) * torch.where(bad, float("nan"), 0.0)


def ppo_token_losses(logprobs, old_logprobs, advantages, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
                     rollout_logprobs=None, tis_cap=None):
    """Per-token clipped-PPO losses, float64 [T] on CPU (differentiable in logprobs), with the per-token
    (ratio, clipped, dual-clipped) flags the metrics need."""
    lp = logprobs.cpu().double()
    old = old_logprobs.detach().cpu().double()
    adv = advantages.detach().cpu().double()
    ratio = torch.exp(lp - old)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    # max(l1, l2), min(., l3) written as selects: at a tie the gradient is the unclipped branch's (as in the
    # kernels), not the half-and-half of torch.maximum; a NaN l1 stays NaN
    clipped = l2 > l1
    loss_tok = torch.where(clipped, l2, l1)
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        l3 = -adv * dual_clip
        dual = (adv < 0) & (loss_tok > l3)
        loss_tok = torch.where(dual, l3, loss_tok)
    if rollout_logprobs is not None:
        w_is = torch.exp(old - rollout_logprobs.detach().cpu().double())
        if tis_cap is not None:
            w_is = torch.clamp(w_is, max=tis_cap)
        loss_tok = loss_tok * w_is
    return loss_tok, ratio, clipped, dual


def ppo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, *, cu_seqlens=None, cu_segments=None,
                    clip_low=0.2, clip_high=0.2, dual_clip=None, rollout_logprobs=None, tis_cap=None,
                    reduction="token-mean", denominator=None):
    """Oracle for `compactionrl_fast.ppo_policy_loss`: float64 (loss, metrics) on CPU; differentiable in
    `logprobs` (cast to float64 inside, so the gradient reaches the caller's tensor)."""
    m = loss_mask.cpu()
    lp = _masked(logprobs, m, grad=True)
    loss_tok, ratio, clipped, dual = ppo_token_losses(
        lp, _masked(old_logprobs, m), _masked(advantages, m), clip_low=clip_low,
        clip_high=clip_high, dual_clip=dual_clip, rollout_logprobs=_masked(rollout_logprobs, m), tis_cap=tis_cap)
    loss_tok = _nan_grad_where_nan(loss_tok, lp)
    w = token_weights(m, cu_seqlens, cu_segments, reduction, denominator)
    loss = torch.where(m, loss_tok * w, 0.0).sum()
    n = int(m.sum())
    zero = torch.zeros((), dtype=torch.float64)
    r = ratio.detach()[m]
    log_r = logprobs.detach().cpu().double()[m] - old_logprobs.detach().cpu().double()[m]
    metrics = {
        "clip_fraction": clipped[m].double().mean() if n else zero,
        "dual_clip_fraction": dual[m].double().mean() if n else zero,
        "approx_kl": ((r - 1.0) - log_r).mean() if n else zero,
        "ratio_max": r.max() if n else zero,
        "log_ratio": log_r.mean() if n else zero,
    }
    return loss, metrics


def value_token_losses(values, old_values, returns, *, clip=None):
    """Per-token value losses, float64 [T] on CPU (differentiable in values), and the clipped flags.

    With `clip`: 0.5 * max((v-R)^2, (v_clip-R)^2), v_clip = old + clamp(v - old, -clip, clip), where
    v_clip is v itself inside the clip range (so rounding of old + (v - old) cannot fake a clip).
    """
    v = values.cpu().double()
    ret = returns.detach().cpu().double()
    q1 = (v - ret) ** 2
    if clip is None:
        return 0.5 * q1, torch.zeros(q1.shape, dtype=torch.bool)
    old = old_values.detach().cpu().double()
    d = v - old
    v_clip = torch.where(d.abs() <= clip, v, old + torch.clamp(d, -clip, clip))
    q2 = (v_clip - ret) ** 2
    # max(q1, q2) as a select: at a tie the gradient is the unclipped branch's (as in the kernels); a NaN of
    # either side stays NaN
    clipped = q2 > q1
    return 0.5 * torch.where(clipped | q2.isnan(), q2, q1), clipped


def value_loss(values, old_values, returns, loss_mask, *, clip=None, cu_seqlens=None, cu_segments=None,
               reduction="token-mean", denominator=None):
    """Oracle for `compactionrl_fast.value_loss`: float64 (loss, metrics) on CPU, differentiable in `values`."""
    m = loss_mask.cpu()
    v = _masked(values, m, grad=True)
    loss_tok, clipped = value_token_losses(v, _masked(old_values, m), _masked(returns, m), clip=clip)
    loss_tok = _nan_grad_where_nan(loss_tok, v)
    w = token_weights(m, cu_seqlens, cu_segments, reduction, denominator)
    loss = torch.where(m, loss_tok * w, 0.0).sum()
    zero = torch.zeros((), dtype=torch.float64)
    if int(m.sum()) == 0:
        return loss, {"clip_fraction": zero, "value_mean": zero, "explained_variance": zero}
    vm, rm = values.detach().cpu().double()[m], returns.detach().cpu().double()[m]
    var_r = rm.var(unbiased=False)
    ev = zero if var_r <= 0 else 1.0 - (rm - vm).var(unbiased=False) / var_r  # a NaN var_r gives NaN
    metrics = {"clip_fraction": clipped[m].double().mean(), "value_mean": vm.mean(), "explained_variance": ev}
    return loss, metrics


def value_head(hidden, weight, bias=None):
    """Oracle for `compactionrl_fast.value_head`: float64 [T] = hidden @ weight + bias, differentiable."""
    out = hidden.double() @ weight.double()
    return out if bias is None else out + bias.double().reshape(())


# ---------------------------------------------------------------- common trainers' formulations
# Padded [B, L] batches, as PPO trainers (verl, OpenRLHF, TRL) write them; one sequence per row.


def padded_ppo_token_losses(logprobs, old_logprobs, advantages, clip_low=0.2, clip_high=0.2):
    """[B, L] clipped surrogate per token: max(-A * ratio, -A * clamp(ratio, 1-eps_low, 1+eps_high))."""
    ratio = torch.exp(logprobs - old_logprobs)
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))


def padded_token_mean(loss_mat, mask):
    """The "token-mean" aggregation: sum(loss * mask) / sum(mask) over the whole batch."""
    return (loss_mat * mask).sum() / mask.sum()


def padded_seq_mean_token_mean(loss_mat, mask):
    """The per-sequence mean ("seq-mean-token-mean"): mean over rows of each row's masked token mean."""
    return ((loss_mat * mask).sum(-1) / mask.sum(-1)).mean()
