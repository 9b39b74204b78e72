"""Naive PyTorch oracle for `segment_gae` and `place_final_rewards` (docs/ops.md).

Python loops over rollouts, segments and tokens in float64: slow and obviously right. Every backend is
tested against these functions and benchmarked against them.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def _bounds(cu):
    cu = [int(x) for x in cu.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def adaptive_lambda(length: int, alpha: float) -> float:
    """lam = 1 - 1/(alpha * l), l >= 1, clamped to [0, 1]."""
    return min(1.0, max(0.0, 1.0 - 1.0 / (alpha * max(int(length), 1))))


def power(base: float, n: int) -> float:
    """base ** n for base in [0, 1] and huge n, without overflow; 0 ** 0 = 1."""
    if n == 0:
        return 1.0
    if base <= 0.0:
        return 0.0
    return math.exp(n * math.log(base))


def segment_lambdas(lam, loss_mask, cu_seqlens, cu_segments, alpha=1.5, length="rollout"):
    """Per-segment lambda [S] (python floats) for a float, a per-segment tensor or "adaptive"."""
    m = loss_mask.cpu()
    segs = _bounds(cu_seqlens.cpu())
    n = [int(m[a:b].sum()) for a, b in segs]
    if isinstance(lam, torch.Tensor):
        return [float(x) for x in lam.double().cpu().tolist()]
    if lam != "adaptive":
        return [float(lam)] * len(segs)
    out = [0.0] * len(segs)
    for s0, s1 in _bounds(cu_segments.cpu()):
        total = sum(n[s0:s1])
        for s in range(s0, s1):
            out[s] = adaptive_lambda(total if length == "rollout" else n[s], alpha)
    return out


def _recurrence(r, v, gamma, lams, f=float):
    """Reverse GAE over a list of trainable steps; lams[k] is the lambda of step k's segment.

    delta_k = r_k + gamma*V_{k+1} - V_k, A_k = delta_k + gamma*lam_k*A_{k+1}, V_{n+1} = A_{n+1} = 0.
    f: the number type of the arithmetic (float, or numpy.float32 for the loop trainers run).
    """
    a = [f(0.0)] * len(r)
    a_next, v_next, g = f(0.0), f(0.0), f(gamma)
    for k in range(len(r) - 1, -1, -1):
        a_next = f(r[k]) + g * v_next - f(v[k]) + f(gamma * lams[k]) * a_next
        v_next = f(v[k])
        a[k] = a_next
    return a


def segment_gae(rewards, values, loss_mask, cu_seqlens, cu_segments=None, *, gamma=1.0, lam="adaptive",
                cross_segment="paper", lam_critic=1.0, adaptive_alpha=1.5, adaptive_length="rollout",
                dtype=torch.float64):
    """Oracle for `compactionrl_fast.segment_gae`. Returns float64 (advantages [T], returns [T]) on CPU.

    dtype: the arithmetic, float64 (the oracle) or float32: the sequential loop trainers run, each operation
    rounded to float32 (tests/ops/test_gae_accuracy.py's rule bounds a backend's error by twice its error).
    """
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    f = float if dtype == torch.float64 else np.float32
    T = loss_mask.numel()
    S = cu_seqlens.numel() - 1
    if cu_segments is None:
        cu_segments = torch.arange(S + 1)
    r_all = rewards.detach().double().cpu()
    v_all = values.detach().double().cpu()
    m = loss_mask.cpu()
    lams = segment_lambdas(lam, m, cu_seqlens, cu_segments, adaptive_alpha, adaptive_length)
    segs = _bounds(cu_seqlens.cpu())
    adv = torch.zeros(T, dtype=torch.float64)
    ret = torch.zeros(T, dtype=torch.float64)
    # trainable positions of every segment
    pos = [[p for p in range(a, b) if bool(m[p])] for a, b in segs]
    for s0, s1 in _bounds(cu_segments.cpu()):
        if cross_segment == "stitched":
            groups = [[p for s in range(s0, s1) for p in pos[s]]]
            glams = [[lams[s] for s in range(s0, s1) for _ in pos[s]]]
            factors = [1.0]
        else:
            groups = [pos[s] for s in range(s0, s1)]
            glams = [[lams[s]] * len(pos[s]) for s in range(s0, s1)]
            later = [sum(len(pos[t]) for t in range(s + 1, s1)) for s in range(s0, s1)]
            factors = [power(gamma * lams[s], later[i]) if cross_segment == "paper" else 1.0
                       for i, s in enumerate(range(s0, s1))]
        for g, gl, fac in zip(groups, glams, factors):
            r = [float(r_all[p]) for p in g]
            v = [float(v_all[p]) for p in g]
            a = _recurrence(r, v, gamma, gl, f)
            ac = a if lam_critic is None else _recurrence(r, v, gamma, [float(lam_critic)] * len(g), f)
            for k, p in enumerate(g):
                adv[p] = float(f(fac) * a[k])
                ret[p] = float(ac[k] + f(v[k]))
    return adv, ret


def segment_params(loss_mask, cu_seqlens, cu_segments=None, *, gamma=1.0, lam="adaptive", cross_segment="paper",
                   lam_critic=1.0, adaptive_alpha=1.5, adaptive_length="rollout"):
    """The per-segment numbers the scan kernels read, stated directly: float64 [4, S] rows gamma*lam_s,
    gamma*lam_critic_s (the advantages' when lam_critic is None), the advantage scale ((gamma*lam_s)^N_later
    for "paper", else 1) and reset_s (0 only for "stitched" when a later segment of the rollout has tokens)."""
    S = cu_seqlens.numel() - 1
    if cu_segments is None:
        cu_segments = torch.arange(S + 1)
    m = loss_mask.cpu()
    lams = segment_lambdas(lam, m, cu_seqlens, cu_segments, adaptive_alpha, adaptive_length)
    segs = _bounds(cu_seqlens.cpu())
    out = torch.zeros(4, S, dtype=torch.float64)
    for s0, s1 in _bounds(cu_segments.cpu()):
        for s in range(s0, s1):
            later = sum(int(m[a:b].sum()) for a, b in segs[s + 1:s1])
            gl = gamma * lams[s]
            out[0, s] = gl
            out[1, s] = gl if lam_critic is None else gamma * float(lam_critic)
            out[2, s] = power(gl, later) if cross_segment == "paper" else 1.0
            tokens_after = any(b > a for a, b in segs[s + 1:s1])
            out[3, s] = 0.0 if cross_segment == "stitched" and tokens_after else 1.0
    return out


def place_final_rewards(rollout_rewards, loss_mask, cu_seqlens, cu_segments=None, mode="paper"):
    """Oracle for `compactionrl_fast.place_final_rewards`: float64 rewards [T] on CPU."""
    S = cu_seqlens.numel() - 1
    if cu_segments is None:
        cu_segments = torch.arange(S + 1)
    m = loss_mask.cpu()
    out = torch.zeros(m.numel(), dtype=torch.float64)
    rr = rollout_rewards.detach().double().cpu()
    segs = _bounds(cu_seqlens.cpu())
    for r, (s0, s1) in enumerate(_bounds(cu_segments.cpu())):
        lasts = []
        for s in range(s0, s1):
            p = [q for q in range(*segs[s]) if bool(m[q])]
            if p:
                lasts.append(p[-1])
        if mode == "stitched":
            lasts = lasts[-1:]
        for q in lasts:
            out[q] = rr[r]
    return out


def masked_gae(rewards, values, mask, gamma, lam):
    """The padded-batch GAE common PPO trainers use ([B, L] tensors; observation tokens skipped).

    A per-time-step loop from the last position, where masked positions carry the running values
    through unchanged. Used as an independent oracle and as a benchmark baseline.
    """
    B, L = rewards.shape
    adv = torch.zeros_like(values)
    a_next = torch.zeros(B, dtype=values.dtype, device=values.device)
    v_next = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in range(L - 1, -1, -1):
        mt = mask[:, t].to(values.dtype)
        delta = rewards[:, t] + gamma * v_next - values[:, t]
        a = delta + gamma * lam * a_next
        a_next = mt * a + (1 - mt) * a_next
        v_next = mt * values[:, t] + (1 - mt) * v_next
        adv[:, t] = a * mt
    return adv, (adv + values) * mask
