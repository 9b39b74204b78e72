"""The peers' GAE and PPO losses, restated in float64 from reading their sources (not copied).

Used where the peer package is not installed (OpenRLHF needs flash-attn and DeepSpeed; TRL removed
its PPO trainer in 1.13; verl needs ray and tensordict); where it is, tests/integrations check these
restatements against the real functions, so the restatements are themselves tested. Padded [B, L]
tensors; masks are 0/1 with 1 on response tokens unless said otherwise.
"""
from __future__ import annotations

import torch

from benchmarks.peers import per_step_gae  # the per-step loop TRL and OpenRLHF share


def _d(x):
    return x.detach().double() if isinstance(x, torch.Tensor) else x


def _mmean(x, mask, eps=0.0):
    return (x * mask).sum() / (mask.sum() + eps)


def whiten(x, mask, eps_mean=0.0):
    """verl/utils/torch_functional.py masked_whiten (eps_mean=1e-8: its masked_mean adds 1e-8 to the
    count) and trl/experimental/ppo/ppo_trainer.py masked_whiten (eps_mean=0): unbiased variance,
    (x - mean) * rsqrt(var + 1e-8)."""
    m = mask.double()
    mean = _mmean(x, m, eps_mean)
    var = _mmean((x - mean) ** 2, m, eps_mean)
    n = m.sum()
    var = var * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


# ---------------------------------------------------------------- verl 0.9.1


def verl_gae(rewards, values, mask, gamma, lam):
    """verl/trainer/ppo/core_algos.py compute_gae_advantage_return: a loop from the last step; on a
    masked step the running value and advantage pass through unchanged (observation tokens skipped);
    returns = advantages + values (unwhitened); advantages then whitened over the mask."""
    r, v, m = _d(rewards), _d(values), _d(mask)
    B, L = r.shape
    next_v = torch.zeros(B, dtype=torch.float64)
    last = torch.zeros(B, dtype=torch.float64)
    adv = torch.zeros(B, L, dtype=torch.float64)
    for t in range(L - 1, -1, -1):
        cand = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * last
        next_v = torch.where(m[:, t] > 0, v[:, t], next_v)
        last = torch.where(m[:, t] > 0, cand, last)
        adv[:, t] = last
    returns = adv + v
    return whiten(adv, m, eps_mean=1e-8), returns


def verl_agg_loss(loss_mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    """verl/trainer/ppo/core_algos.py agg_loss."""
    m = _d(mask)
    if mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * m).sum() / n * dp_size
    if mode == "token-sum":
        return (loss_mat * m).sum() * dp_size
    rows = (m.sum(-1) > 0).double()
    if mode == "seq-mean-token-mean":
        per_row = (loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8)
    else:
        per_row = (loss_mat * m).sum(-1)
    n = rows.sum() if global_batch_size is None else global_batch_size
    out = (per_row * rows).sum() / n * dp_size
    if mode == "seq-mean-token-sum-norm":
        out = out / (loss_scale_factor if loss_scale_factor is not None else m.shape[-1])
    return out


def verl_policy_loss(old_logp, logp, adv, mask, mode, clip_low, clip_high, clip_c, weights=None, **agg):
    """verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla: clipped surrogate with the dual clip
    (always on) for negative advantages, log-ratio clamped to [-20, 20], optional per-token weights;
    returns (loss, clip fraction, dual-clip fraction). Differentiable in `logp`."""
    m = _d(mask)
    a = _d(adv)
    ratio = torch.exp(torch.clamp(logp.double() - _d(old_logp), -20.0, 20.0))
    l1 = -a * ratio
    l2 = -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    l12 = torch.maximum(l1, l2)
    l3 = -a * clip_c
    loss = torch.where(a < 0, torch.minimum(l3, l12), l12)
    if weights is not None:
        loss = loss * _d(weights)
    clipfrac = _mmean((l2 > l1).double(), m, 1e-8)
    lower = _mmean(((l12 > l3) & (a < 0)).double(), m, 1e-8)
    return verl_agg_loss(loss, m, mode, **agg), clipfrac, lower


# ---------------------------------------------------------------- OpenRLHF 0.11.2


def openrlhf_gae(values, rewards, action_mask, gamma, lambd):
    """openrlhf/trainer/ppo_utils/experience_maker.py get_advantages_and_returns: values and rewards
    zeroed off the mask, then a plain loop that bootstraps from the next position (masked or not)."""
    m = _d(action_mask)
    return per_step_gae(_d(rewards) * m, _d(values) * m, gamma, lambd)


def openrlhf_aggregate(loss, mask, token_level_loss=True, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """openrlhf/models/loss.py aggregate_loss."""
    m = _d(mask)
    if token_level_loss:
        if batch_num_tokens is None:
            return (loss * m).sum() / m.sum()
        return (loss * m).sum() / batch_num_tokens * dp_size
    n = m.sum(-1)
    per_row = (loss * m).sum(-1) / (n + 1e-8)
    rows = (n > 0).double()
    if global_batch_size is None:
        return (per_row * rows).sum() / rows.sum()
    return (per_row * rows).sum() / global_batch_size * dp_size


def openrlhf_policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None, rollout_logp=None,
                         tis_cap=None, **agg):
    """openrlhf/models/loss.py PolicyLoss.forward (policy_loss_type="ppo"; correction off, or token-level
    clip-mode ratio gating with threshold (0, tis_cap)): (loss, clip_ratio, ppo_kl)."""
    m = _d(mask)
    a = _d(adv)
    log_ratio = logp.double() - _d(old_logp)
    ratio = torch.clamp(log_ratio, -20.0, 20.0).exp()
    s1 = ratio * a
    s2 = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * a
    obj = torch.minimum(s1, s2)
    if dual_clip is not None:
        obj = torch.where(a < 0, torch.maximum(obj, dual_clip * a), obj)
    loss = -obj
    if tis_cap is not None:
        loss = loss * torch.clamp((_d(old_logp) - _d(rollout_logp)).exp(), 0.0, tis_cap)
    out = openrlhf_aggregate(loss, m, **agg)
    return out, _mmean((s2 < s1).double(), m), _mmean(-log_ratio.detach(), m)


def openrlhf_value_loss(values, old_values, returns, mask, clip_eps=None, **agg):
    """openrlhf/models/loss.py ValueLoss.forward."""
    v, old, ret = values.double(), _d(old_values), _d(returns)
    if clip_eps is None:
        loss = (v - ret) ** 2
    else:
        vc = old + torch.clamp(v - old, -clip_eps, clip_eps)
        loss = torch.maximum((vc - ret) ** 2, (v - ret) ** 2)
    return 0.5 * openrlhf_aggregate(loss, mask, **agg)


# ---------------------------------------------------------------- TRL 1.12.0 (PPO removed in 1.13)


def trl_gae(rewards, values, padding_mask, padding_mask_p1, gamma, lam):
    """trl/experimental/ppo/ppo_trainer.py PPOTrainer.train, "compute advantages and returns": values
    zeroed on padding_mask_p1, a plain loop bootstrapping from the next position, returns = adv + values,
    advantages whitened over ~padding_mask and zeroed on padding_mask."""
    v = torch.where(padding_mask_p1, 0.0, _d(values))
    adv, returns = per_step_gae(_d(rewards), v, gamma, lam)
    adv = torch.where(padding_mask, 0.0, whiten(adv, ~padding_mask))
    return adv, returns


def trl_policy_loss(new_logp, logp, adv, padding_mask, cliprange):
    """Same file, the minibatch loop: (pg_loss, pg_clipfrac), token means over ~padding_mask."""
    m = (~padding_mask).double()
    a = _d(adv)
    ratio = torch.exp(new_logp.double() - _d(logp))
    l1 = -a * ratio
    l2 = -a * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    return _mmean(torch.maximum(l1, l2), m), _mmean((l2 > l1).double(), m)


def trl_value_loss(vpred, values, returns, padding_mask_p1, cliprange_value):
    """Same loop: (vf_loss, vf_clipfrac) = 0.5 * token mean of max((v-R)^2, (clamp(v, old-c, old+c)-R)^2)."""
    m = (~padding_mask_p1).double()
    v, old, ret = vpred.double(), _d(values), _d(returns)
    vc = torch.clamp(v, old - cliprange_value, old + cliprange_value)
    q1, q2 = (v - ret) ** 2, (vc - ret) ** 2
    return 0.5 * _mmean(torch.maximum(q1, q2), m), _mmean((q2 > q1).double(), m)
