"""Peer trainers' GAE and PPO losses on padded [B, L] batches, for benchmarks/bench_adapters.py.

Where a peer is importable (verl and torchrl in `make test-integrations`' build/peers; run the benchmark
with PYTHONPATH=build/peers), its own function runs. The others are restated here in our own words from
the named source file, same math and same tensor passes (the formulation is what is timed):

  OpenRLHF 0.11  openrlhf/trainer/ppo_utils/experience_maker.py  get_advantages_and_returns (masked inputs,
                 per-step loop); openrlhf/models/loss.py PolicyLoss / ValueLoss (masked_mean over tokens)
  TRL 1.12       trl/trainer/ppo_trainer.py  the GAE loop and the clipped losses inside PPOTrainer.train
  slime          slime/utils/ppo_utils.py (THUDM/slime, 2026)  chunked_gae (chunks of 128: an in-chunk
                 [C, C] matmul, then a loop over chunks) and compute_policy_loss (torch.compile(dynamic=True))

None of them knows compacted rollouts: every row is its own episode (on compacted batches they compute
a different, per-row GAE; they are timed on the same tensors all the same).

Each GAE returns (advantages, returns) [B, L]; each loss returns a scalar tensor to call backward on.
"""
from __future__ import annotations

import torch


# ---------------------------------------------------------------- GAE


def per_step_gae(rewards, values, gamma, lam):
    """The per-step backward loop over the columns of padded [B, L] rewards and values that TRL, OpenRLHF and
    slime's `vanilla_gae` share (also the restatements in tests/integrations/peers.py): from the last step,
    delta_t = r_t + gamma*V_{t+1} - V_t (V_L = 0), A_t = delta_t + gamma*lam*A_{t+1}. Every row is one episode,
    every position a step. Returns (advantages, returns = advantages + values) [B, L] in the inputs' dtype."""
    B, L = rewards.shape
    last = torch.zeros(B, dtype=rewards.dtype)
    out = []
    for t in range(L - 1, -1, -1):
        nxt = values[:, t + 1] if t + 1 < L else 0.0
        last = rewards[:, t] + gamma * nxt - values[:, t] + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def openrlhf_gae(rewards, values, mask, gamma, lam):
    """OpenRLHF: rewards and values zeroed off the action mask, then the per-step loop."""
    m = mask.to(values.dtype)
    return per_step_gae(rewards * m, values * m, gamma, lam)


def trl_gae(rewards, values, mask, gamma, lam):
    """TRL: the per-step loop on the raw [B, L] tensors (padding was filled with 0 before), then whitening
    of the advantages over the non-padding tokens (TRL's masked_whiten)."""
    adv, ret = per_step_gae(rewards, values, gamma, lam)
    m = mask.to(adv.dtype)
    mean = (adv * m).sum() / m.sum()
    var = ((adv - mean) ** 2 * m).sum() / (m.sum() - 1)
    return (adv - mean) * torch.rsqrt(var + 1e-8), ret


def slime_chunked_gae(rewards, values, mask, gamma, lam, chunk=128):
    """slime's chunked_gae: deltas reversed in time, each chunk of C steps scanned by one [C, C] matmul with
    M[i, j] = (gamma*lam)^(j-i) (j >= i), then a loop over chunks carries the state across them."""
    B, L = rewards.shape
    w = gamma * lam
    nxt = torch.cat([values[:, 1:], values.new_zeros(B, 1)], dim=1)
    d = torch.flip(rewards + gamma * nxt - values, dims=[1])
    pad = (-L) % chunk
    d = torch.nn.functional.pad(d, (0, pad))
    n = d.shape[1] // chunk
    k = torch.arange(chunk)
    diff = k[None, :] - k[:, None]
    M = torch.where(diff >= 0, torch.tensor(w, dtype=d.dtype) ** diff.clamp(min=0).to(d.dtype), 0.0)
    powers = torch.tensor(w, dtype=d.dtype) ** torch.arange(1, chunk + 1, dtype=d.dtype)
    local = (d.reshape(B * n, chunk) @ M).reshape(B, n, chunk)
    out = d.new_zeros(B, n * chunk)
    state = d.new_zeros(B)
    for c in range(n):
        length = chunk if c < n - 1 or pad == 0 else chunk - pad
        g = local[:, c, :length] + state[:, None] * powers[:length]
        out[:, c * chunk:c * chunk + length] = g
        state = g[:, -1]
    adv = torch.flip(out[:, :L], dims=[1])
    return adv, adv + values


def verl_gae():
    """verl's own compute_gae_advantage_return (verl/trainer/ppo/core_algos.py), or None if not importable."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        return None

    def run(rewards, values, mask, gamma, lam):
        return core_algos.compute_gae_advantage_return(rewards, values, mask, torch.tensor(gamma),
                                                       torch.tensor(lam))
    return run


def torchrl_gae():
    """torchrl's vec_generalized_advantage_estimate (torchrl/objectives/value/functional.py), each row one
    trajectory ending at its last token; None if torchrl is not importable."""
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate as vec_gae
    except ImportError:
        return None

    def run(rewards, values, mask, gamma, lam):
        B, L = rewards.shape
        done = torch.zeros(B, L, 1, dtype=torch.bool)
        done[:, -1] = True
        nxt = torch.cat([values[:, 1:], values.new_zeros(B, 1)], dim=1)
        return vec_gae(gamma, lam, values[..., None], nxt[..., None], rewards[..., None], done, done)
    return run


def gae_rows():
    """(name, fn(rewards, values, mask, gamma, lam)) of every GAE peer available here."""
    verl, torchrl = verl_gae(), torchrl_gae()
    return ([("verl 0.9.1 (installed)", verl)] if verl else []) + [
        ("OpenRLHF (restated)", openrlhf_gae), ("TRL (restated)", trl_gae),
        ("slime chunked (restated)", slime_chunked_gae)] + ([("torchrl 0.14.1 (installed)", torchrl)] if torchrl else [])


# ---------------------------------------------------------------- policy loss


def _masked_mean(x, m):
    return (x * m).sum() / m.sum()


def openrlhf_policy_loss(logp, old, adv, mask, clip=0.2, dual=3.0):
    """OpenRLHF PolicyLoss: -min(ratio*A, clip(ratio)*A), dual clip for A < 0, token mean over the mask."""
    ratio = (logp - old).exp()
    loss = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    loss = torch.where(adv < 0, torch.min(loss, -dual * adv), loss)
    return _masked_mean(loss, mask.to(loss.dtype))


def trl_policy_loss(logp, old, adv, mask, clip=0.2, dual=None):
    """TRL: max of the two surrogate losses, masked mean; the logged statistics (clip fraction, approx KL)
    computed on the side without grad, as PPOTrainer does."""
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    loss = _masked_mean(torch.max(l1, l2), m)
    with torch.no_grad():
        _masked_mean((l2 > l1).float(), m)
        _masked_mean(0.5 * (logp - old) ** 2, m)
    return loss


_SLIME_COMPILED = []


def _slime_pg(ppo_kl, adv, clip, clip_high, dual):
    ratio = (-ppo_kl).exp()
    l1, l2 = -ratio * adv, -ratio.clamp(1 - clip, 1 + clip_high) * adv
    l = torch.maximum(l1, l2)
    clipfrac = torch.gt(l2, l1).float()
    l = torch.where(adv < 0, torch.min(-dual * adv, l), l)
    return l, clipfrac


def slime_policy_loss(logp, old, adv, mask, clip=0.2, dual=3.0):
    """slime: the per-token losses from a torch.compile(dynamic=True)d function of ppo_kl = old - logp, then
    a masked token mean."""
    if not _SLIME_COMPILED:
        _SLIME_COMPILED.append(torch.compile(_slime_pg, dynamic=True))
    l, _ = _SLIME_COMPILED[0](old - logp, adv, clip, clip, dual)
    return _masked_mean(l, mask.to(l.dtype))


def verl_policy_loss():
    """verl's compute_policy_loss_vanilla with agg_loss token-mean, or None if not importable."""
    try:
        from verl.trainer.ppo import core_algos
        from verl.workers.config import ActorConfig
    except ImportError:
        return None
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                      clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)

    def run(logp, old, adv, mask, clip=0.2, dual=3.0):
        return core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", cfg)[0]
    return run


def policy_loss_rows():
    real = verl_policy_loss()
    rows = [("verl 0.9.1 (installed)", real)] if real else []
    return rows + [("OpenRLHF (restated)", openrlhf_policy_loss), ("TRL (restated)", trl_policy_loss),
                   ("slime compiled (restated)", slime_policy_loss)]


# ---------------------------------------------------------------- value loss


def openrlhf_value_loss(v, old, ret, mask, clip=0.2):
    """OpenRLHF ValueLoss: 0.5 * masked mean of max((v_clip - R)^2, (v - R)^2)."""
    vc = old + (v - old).clamp(-clip, clip)
    loss = torch.max((vc - ret) ** 2, (v - ret) ** 2)
    return 0.5 * _masked_mean(loss, mask.to(loss.dtype))


def trl_value_loss(v, old, ret, mask, clip=0.2):
    """TRL: 0.5 * masked mean of the max of the two squared errors, and the clip fraction on the side."""
    m = mask.to(v.dtype)
    vc = torch.clamp(v, old - clip, old + clip)
    l1, l2 = (v - ret) ** 2, (vc - ret) ** 2
    loss = 0.5 * _masked_mean(torch.max(l1, l2), m)
    with torch.no_grad():
        _masked_mean((l2 > l1).float(), m)
    return loss


def verl_value_loss():
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        return None

    def run(v, old, ret, mask, clip=0.2):
        return core_algos.compute_value_loss(v, ret, old, mask, clip, "token-mean")[0]
    return run


def value_loss_rows():
    real = verl_value_loss()
    rows = [("verl 0.9.1 (installed)", real)] if real else []
    return rows + [("OpenRLHF (restated)", openrlhf_value_loss), ("TRL (restated)", trl_value_loss)]
