"""`segment_gae` and `place_final_rewards`: GAE over packed, compacted rollouts (SPEC section 4).

Backends: "triton" (kernels/gae.py), "cuda" and "cpp" (csrc/, op `compactionrl_fast::segment_gae`),
"torch" (the reference). Advantages are targets, not functions of parameters: no autograd here.
"""
from __future__ import annotations

import torch

from ..reference import gae as ref
from . import _dispatch
from ._validate import FLOAT_DTYPES, check_choice, check_float, check_offsets, check_tensor

CROSS_MODES = {"none": 0, "paper": 1, "stitched": 2}
LAM_CONST, LAM_ADAPTIVE_SEGMENT, LAM_ADAPTIVE_ROLLOUT, LAM_TENSOR = 0, 1, 2, 3


def _check_packed(rewards, values, loss_mask, cu_seqlens, cu_segments):
    """Validate the packed layout; return (cu_seqlens, cu_segments) of one index dtype, S and R."""
    check_tensor("loss_mask", loss_mask, dtypes=(torch.bool,), ndim=1)
    device, T = loss_mask.device, loss_mask.numel()
    for name, t in (("rewards", rewards), ("values", values)):
        if t is not None:
            check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=1, device=device, numel=T)
    S = check_offsets("cu_seqlens", cu_seqlens, total=T, device=device)
    if cu_segments is None:
        cu_segments = torch.arange(S + 1, dtype=cu_seqlens.dtype, device=device)
    R = check_offsets("cu_segments", cu_segments, total=S, device=device, total_name="S (number of segments)")
    return cu_seqlens, cu_segments.to(cu_seqlens.dtype), S, R


def segment_gae(rewards, values, loss_mask, cu_seqlens, cu_segments=None, *, gamma=1.0, lam="adaptive",
                cross_segment="paper", lam_critic=1.0, adaptive_alpha=1.5, adaptive_length="rollout",
                backend="auto"):
    """GAE inside each segment of packed, compacted rollouts, with the cross-segment correction.

    Args:
        rewards: [T] float; only trainable positions are read.
        values: [T] float critic values; only trainable positions are read.
        loss_mask: [T] bool, True on policy-generated (trainable) tokens.
        cu_seqlens: [S+1] int32/int64 token offsets of the S segments.
        cu_segments: [R+1] int32/int64 segment offsets of the R rollouts (chronological segments);
            None makes every segment its own rollout.
        gamma: discount in [0, 1].
        lam: float in [0, 1], "adaptive" (lam = 1 - 1/(adaptive_alpha * l)), or a float tensor [S].
        cross_segment: "paper" (scale by (gamma*lam)^N_later), "none", or "stitched" (one recurrence
            across the rollout's segments).
        lam_critic: lambda of the returns' recurrence; None uses the advantages' lambda.
        adaptive_length: "rollout" or "segment": which trainable-token count l is.
        backend: "auto" | "triton" | "cuda" | "cpp" | "torch".

    Returns:
        (advantages [T] float32, returns [T] float32), zero at non-trainable positions.

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> mask = torch.tensor([False, True, True, False, True])
        >>> rew = torch.tensor([0., 0., 1., 0., 1.])
        >>> adv, ret = crf.segment_gae(rew, torch.zeros(5), mask, torch.tensor([0, 3, 5]),
        ...                            torch.tensor([0, 2]), lam=1.0)
        >>> adv.tolist()
        [0.0, 1.0, 1.0, 0.0, 1.0]
    """
    cu_seqlens, cu_segments, S, R = _check_packed(rewards, values, loss_mask, cu_seqlens, cu_segments)
    device = loss_mask.device
    gamma = check_float("gamma", gamma, 0.0, 1.0)
    check_choice("cross_segment", cross_segment, tuple(CROSS_MODES))
    check_choice("adaptive_length", adaptive_length, ("rollout", "segment"))
    alpha = check_float("adaptive_alpha", adaptive_alpha, 0.0, float("inf"))
    if alpha <= 0.0:
        raise ValueError(f"adaptive_alpha must be > 0, got {alpha}")
    lam_seg, lam_val = None, 0.0
    if isinstance(lam, torch.Tensor):
        check_tensor("lam", lam, dtypes=FLOAT_DTYPES, ndim=1, device=device, numel=S)
        if S and bool(((lam < 0) | (lam > 1) | lam.isnan()).any()):
            raise ValueError("lam (per-segment tensor) must hold values in [0, 1]")
        lam_mode, lam_seg = LAM_TENSOR, lam.float().contiguous()
    elif isinstance(lam, str):
        if lam != "adaptive":
            raise ValueError(f"lam must be a float, a per-segment tensor or 'adaptive', got {lam!r}")
        lam_mode = LAM_ADAPTIVE_ROLLOUT if adaptive_length == "rollout" else LAM_ADAPTIVE_SEGMENT
    else:
        lam_mode, lam_val = LAM_CONST, check_float("lam", lam, 0.0, 1.0)
    lam_c = -1.0 if lam_critic is None else check_float("lam_critic", lam_critic, 0.0, 1.0)

    b = _dispatch.resolve(backend, device)
    rewards, values = rewards.detach().float().contiguous(), values.detach().float().contiguous()
    if b == "torch":
        adv, ret = ref.segment_gae(rewards, values, loss_mask, cu_seqlens, cu_segments, gamma=gamma,
                                   lam=lam_seg if lam_seg is not None else (lam if lam_mode != LAM_CONST else lam_val),
                                   cross_segment=cross_segment, lam_critic=lam_critic,
                                   adaptive_alpha=alpha, adaptive_length=adaptive_length)
        return adv.float().to(device), ret.float().to(device)
    args = (rewards, values, loss_mask.contiguous(), cu_seqlens.contiguous(), cu_segments.contiguous(),
            lam_seg, gamma, lam_val, lam_mode, alpha, CROSS_MODES[cross_segment], lam_c)
    if b == "triton":
        from ..kernels.gae import segment_gae_fwd
        return segment_gae_fwd(*args)
    return torch.ops.compactionrl_fast.segment_gae(*args)


def place_final_rewards(rollout_rewards, loss_mask, cu_seqlens, cu_segments=None, mode="paper"):
    """Token rewards [T] float32 from one final reward per rollout.

    "paper": the reward goes on the last trainable token of every segment of the rollout (each segment
    carries the final reward). "stitched": only on the rollout's last trainable token. A rollout with no
    trainable token places nothing.

    Args:
        rollout_rewards: [R] float.
        loss_mask: [T] bool; cu_seqlens: [S+1]; cu_segments: [R+1] or None (one segment per rollout).
    """
    cu_seqlens, cu_segments, S, R = _check_packed(None, None, loss_mask, cu_seqlens, cu_segments)
    check_choice("mode", mode, ("paper", "stitched"))
    check_tensor("rollout_rewards", rollout_rewards, dtypes=FLOAT_DTYPES, ndim=1, device=loss_mask.device,
                 numel=R)
    T, device = loss_mask.numel(), loss_mask.device
    out = torch.zeros(T, dtype=torch.float32, device=device)
    if T == 0 or S == 0:
        return out
    # last trainable position of each segment: max over positions, -1 where none
    pos = torch.where(loss_mask, torch.arange(T, device=device), -1)
    seg_of_tok = torch.repeat_interleave(torch.arange(S, device=device), cu_seqlens.diff().long(), output_size=T)
    last = torch.full((S,), -1, dtype=torch.long, device=device).scatter_reduce(0, seg_of_tok, pos, "amax")
    roll_of_seg = torch.repeat_interleave(torch.arange(R, device=device), cu_segments.diff().long(), output_size=S)
    if mode == "stitched":  # keep only the rollout's last segment that has a trainable token
        last_r = torch.full((R,), -1, dtype=torch.long, device=device).scatter_reduce(0, roll_of_seg, last, "amax")
        last, roll_of_seg = last_r, torch.arange(R, device=device)
    keep = last >= 0
    out[last[keep]] = rollout_rewards.detach().float()[roll_of_seg[keep]]
    return out
