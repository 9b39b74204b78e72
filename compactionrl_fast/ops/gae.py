"""`segment_gae`, `segment_params` (its per-segment numbers alone) and `place_final_rewards`: GAE over packed,
compacted rollouts (docs/ops.md).

Backends: "triton" (kernels/gae.py, custom ops `compactionrl_fast::segment_gae_triton` and
`segment_gae_params_triton`), "cuda" and "cpp" (csrc/, op `compactionrl_fast::segment_gae`;
`segment_gae_params` on "cpp"), "torch" (the reference). `place_final_rewards`: "triton" (kernels/place.py),
"cuda" and "cpp" (csrc/, op `compactionrl_fast::place_final_rewards`), "torch" (a composite). All are torch.library custom ops with fake impls, so torch.compile traces them without a graph break; advantages are targets, not
functions of parameters, so there is no autograd. No host sync on CUDA tensors: offsets are checked
where `value_checks` allows, and every kernel clamps them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.modes import CROSS_SEGMENT as CROSS_MODES
from ..kernels.modes import LAM_ADAPTIVE_ROLLOUT, LAM_ADAPTIVE_SEGMENT, LAM_CONST, LAM_TENSOR, REWARD_PLACEMENT
from ..reference import gae as ref
from ._dispatch import custom_op, resolve_backend
from ._register import register_op
from ._registry import LARGE, SMALL, OpSpec, declare, packed, wave
from ._validate import FLOAT_DTYPES, check_choice, check_float, check_layout, check_tensor, value_checks


def _check_packed(rewards, values, loss_mask, cu_seqlens, cu_segments):
    """Validate the packed layout; return (cu_seqlens, cu_segments) of one index dtype, S and R.
    `rewards`/`values` [T] are checked unless both are None (place_final_rewards)."""
    check_tensor("loss_mask", loss_mask, dtypes=(torch.bool,), ndim=1)
    device, T = loss_mask.device, loss_mask.numel()
    for name, t in () if rewards is None and values is None else (("rewards", rewards), ("values", values)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=1, device=device)
        if t.numel() != T:
            raise ValueError(f"{name} has {t.numel()} elements but loss_mask has {T}: rewards, values and "
                             "loss_mask must all be [T]")
    check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    if cu_segments is None:  # every segment its own rollout
        cu_segments = torch.arange(cu_seqlens.numel(), dtype=cu_seqlens.dtype, device=device)
    cu_segments = check_layout(loss_mask, cu_seqlens, cu_segments)
    S = cu_seqlens.numel() - 1
    return cu_seqlens.contiguous(), cu_segments.to(cu_seqlens.dtype).contiguous(), S, cu_segments.numel() - 1


# ---------------------------------------------------------------- custom ops
# (rewards [T] f32, values [T] f32, loss_mask [T] bool, cu_seqlens [S+1], cu_segments [R+1] (one index dtype),
#  lam_seg [S] f32?, gamma, lam, lam_mode, alpha, cross, lam_critic (< 0: None), seg_start [S] int64?)
#  -> (adv [T] f32, ret [T] f32)


def _gae_fake(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha, cross,
              lam_critic, seg_start=None):
    T = loss_mask.shape[0]
    return rewards.new_empty(T, dtype=torch.float32), rewards.new_empty(T, dtype=torch.float32)


def _gae_triton(rewards: Tensor, values: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, cu_segments: Tensor,
                lam_seg: Optional[Tensor], gamma: float, lam: float, lam_mode: int, alpha: float, cross: int,
                lam_critic: float, seg_start: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    from ..kernels.gae import segment_gae_fwd

    return segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode,
                           alpha, cross, lam_critic, seg_start)


register_op("segment_gae_triton", _gae_fake, _gae_triton)
register_op("segment_gae", _gae_fake)  # the C++ op (csrc/), where built


def _check_numbers(S, device, gamma, lam, cross_segment, lam_critic, adaptive_alpha, adaptive_length):
    """Validate segment_gae's numbers and modes; return what the kernels take: (gamma, lam_mode, lam (the
    float of LAM_CONST, else 0), lam_seg [S] float32 (LAM_TENSOR) or None, alpha, lam_critic (< 0: None))."""
    gamma = check_float("gamma", gamma, 0.0, 1.0)
    check_choice("cross_segment", cross_segment, tuple(CROSS_MODES))
    check_choice("adaptive_length", adaptive_length, ("rollout", "segment"))
    alpha = check_float("adaptive_alpha", adaptive_alpha, 0.0, float("inf"))
    if alpha <= 0.0:
        raise ValueError(f"adaptive_alpha must be > 0, got {alpha}")
    lam_seg, lam_val = None, 0.0
    if isinstance(lam, torch.Tensor):
        check_tensor("lam", lam, dtypes=FLOAT_DTYPES, ndim=1, device=device, numel=S)
        if S and value_checks(lam) and bool(((lam < 0) | (lam > 1) | lam.isnan()).any()):
            raise ValueError("lam (per-segment tensor) must hold values in [0, 1]")
        lam_mode, lam_seg = LAM_TENSOR, lam.detach().float().contiguous()
    elif isinstance(lam, str):
        if lam != "adaptive":
            raise ValueError(f"lam must be a float, a per-segment tensor or 'adaptive', got {lam!r}")
        lam_mode = LAM_ADAPTIVE_ROLLOUT if adaptive_length == "rollout" else LAM_ADAPTIVE_SEGMENT
    else:
        lam_mode, lam_val = LAM_CONST, check_float("lam", lam, 0.0, 1.0)
    lam_c = -1.0 if lam_critic is None else check_float("lam_critic", lam_critic, 0.0, 1.0)
    return gamma, lam_mode, lam_val, lam_seg, alpha, lam_c


def _check_starts(seg_start, cu_seqlens, T, device):
    """`seg_start` [S] int64: segment s holds [seg_start[s], + its length); the segments must tile [0, T)."""
    S = cu_seqlens.numel() - 1
    check_tensor("seg_start", seg_start, dtypes=(torch.int64,), ndim=1, device=device, numel=S)
    if not value_checks(seg_start) or S == 0:
        return seg_start.contiguous()
    lens = cu_seqlens.long().diff()
    if bool(((seg_start < 0) | (seg_start + lens > T)).any()):
        s = int(torch.nonzero((seg_start < 0) | (seg_start + lens > T))[0])
        raise ValueError(f"seg_start[{s}]={int(seg_start[s])} puts segment {s} ({int(lens[s])} tokens) outside [0, T={T})")
    keep = lens > 0
    st, ln = seg_start[keep], lens[keep]
    o = torch.argsort(st)
    st, ln = st[o], ln[o]
    end = st + ln
    if st.numel() and (int(st[0]) != 0 or int(end[-1]) != T or bool((st[1:] != end[:-1]).any())):
        raise ValueError("seg_start must place the segments so that they cover [0, T) without gaps or overlaps")
    return seg_start.contiguous()


def _placed_index(seg_start, cu_seqlens):
    """Physical position of every logical token: int64 [T] (segments placed at seg_start)."""
    lens = cu_seqlens.long().diff()
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=int(lens.sum()))
    return seg_start[seg] + torch.arange(seg.numel(), device=lens.device) - cu_seqlens.long()[seg]


def segment_gae(rewards, values, loss_mask, cu_seqlens, cu_segments=None, *, gamma=1.0, lam="adaptive",
                cross_segment="paper", lam_critic=1.0, adaptive_alpha=1.5, adaptive_length="rollout",
                seg_start=None, backend="auto"):
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
        seg_start: [S] int64 or None. Placed segments: segment s holds the tokens [seg_start[s],
            seg_start[s] + len_s) with len_s = cu_seqlens[s+1] - cu_seqlens[s], instead of [cu_seqlens[s],
            cu_seqlens[s+1]). The segments must tile [0, T). This reads a padded [B, L] batch flattened, with
            no copy, even when the rows of a rollout are not adjacent: cu_seqlens = L * arange(B+1) in
            chronological order per rollout, seg_start[s] = L * (row of segment s). Not on "cuda".
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
    gamma, lam_mode, lam_val, lam_seg, alpha, lam_c = _check_numbers(S, device, gamma, lam, cross_segment,
                                                                     lam_critic, adaptive_alpha, adaptive_length)

    if seg_start is not None:
        seg_start = _check_starts(seg_start, cu_seqlens, loss_mask.numel(), device)
    b = resolve_backend(backend, device, op="segment_gae", placed=seg_start is not None)
    rewards, values = rewards.detach().float().contiguous(), values.detach().float().contiguous()
    if b == "torch" and seg_start is not None:  # the reference on the gathered logical order
        idx = _placed_index(seg_start, cu_seqlens)
        adv_l, ret_l = segment_gae(rewards[idx], values[idx], loss_mask[idx], cu_seqlens, cu_segments, gamma=gamma,
                                   lam=lam, cross_segment=cross_segment, lam_critic=lam_critic,
                                   adaptive_alpha=alpha, adaptive_length=adaptive_length, backend="torch")
        adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
        return adv.index_copy_(0, idx, adv_l), ret.index_copy_(0, idx, ret_l)
    if b == "torch":
        adv, ret = ref.segment_gae(rewards, values, loss_mask, cu_seqlens, cu_segments, gamma=gamma,
                                   lam=lam_seg if lam_seg is not None else (lam if lam_mode != LAM_CONST else lam_val),
                                   cross_segment=cross_segment, lam_critic=lam_critic,
                                   adaptive_alpha=alpha, adaptive_length=adaptive_length)
        return adv.float().to(device), ret.float().to(device)
    op = custom_op("segment_gae", b)
    return op(rewards, values, loss_mask.contiguous(), cu_seqlens, cu_segments, lam_seg, gamma, lam_val, lam_mode,
              alpha, CROSS_MODES[cross_segment], lam_c, seg_start)


# (loss_mask [T] bool, cu_seqlens [S+1], cu_segments [R+1] (one index dtype), lam_seg [S] f32?, gamma, lam,
#  lam_mode, alpha, cross, lam_critic (< 0: None)) -> float64 [4, S]: segment_gae's per-segment numbers alone


def _params_fake(loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha, cross, lam_critic):
    return loss_mask.new_empty(4, cu_seqlens.shape[0] - 1, dtype=torch.float64)


def _params_triton(loss_mask: Tensor, cu_seqlens: Tensor, cu_segments: Tensor, lam_seg: Optional[Tensor],
                   gamma: float, lam: float, lam_mode: int, alpha: float, cross: int, lam_critic: float) -> Tensor:
    from ..kernels.gae import segment_gae_params

    return segment_gae_params(loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha, cross,
                              lam_critic)


register_op("segment_gae_params_triton", _params_fake, _params_triton)
register_op("segment_gae_params", _params_fake)  # the C++ op (csrc/cpu/gae.cpp), where built


def segment_params(loss_mask, cu_seqlens, cu_segments=None, *, gamma=1.0, lam="adaptive", cross_segment="paper",
                   lam_critic=1.0, adaptive_alpha=1.5, adaptive_length="rollout", backend="auto"):
    """The per-segment numbers `segment_gae` resolves from its modes, computed by the code its scans read them
    from (C++ `rollout_params`, the Triton params kernel, the reference): for reports such as the paper's
    factor, without restating the modes.

    Args: as `segment_gae` (no rewards or values; backend: "auto" | "triton" | "cpp" | "torch").

    Returns:
        float64 [4, S], rows: gamma*lam_s; gamma*lam_critic (gamma*lam_s when lam_critic is None); the
        advantage scale, (gamma*lam_s)^N_later for "paper" (N_later: trainable tokens in the later segments
        of the rollout), else 1; reset_s, 0 only for "stitched" when a later segment of the rollout has tokens.

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> mask = torch.tensor([True, True, True])
        >>> crf.segment_params(mask, torch.tensor([0, 2, 3]), torch.tensor([0, 2]), gamma=1.0, lam=0.5)[2].tolist()
        [0.5, 1.0]
    """
    cu_seqlens, cu_segments, S, R = _check_packed(None, None, loss_mask, cu_seqlens, cu_segments)
    device = loss_mask.device
    gamma, lam_mode, lam_val, lam_seg, alpha, lam_c = _check_numbers(S, device, gamma, lam, cross_segment,
                                                                     lam_critic, adaptive_alpha, adaptive_length)
    b = resolve_backend(backend, device, op="segment_params")
    if b == "torch":
        return ref.segment_params(loss_mask, cu_seqlens, cu_segments, gamma=gamma,
                                  lam=lam_seg if lam_seg is not None else (lam if lam_mode != LAM_CONST else lam_val),
                                  cross_segment=cross_segment, lam_critic=lam_critic, adaptive_alpha=alpha,
                                  adaptive_length=adaptive_length).to(device)
    op = custom_op("segment_params", b)
    return op(loss_mask.contiguous(), cu_seqlens, cu_segments, lam_seg, gamma, lam_val, lam_mode, alpha,
              CROSS_MODES[cross_segment], lam_c)


# (rollout_rewards [R] f32, loss_mask [T] bool, cu_seqlens [S+1], cu_segments [R+1] (one index dtype), stitched)
#  -> rewards [T] f32


def _place_fake(rollout_rewards, loss_mask, cu_seqlens, cu_segments, stitched):
    return rollout_rewards.new_empty(loss_mask.shape[0], dtype=torch.float32)


def _place_triton(rollout_rewards: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, cu_segments: Tensor,
                  stitched: bool) -> Tensor:
    from ..kernels.place import place_final_rewards_fwd

    return place_final_rewards_fwd(rollout_rewards, loss_mask, cu_seqlens, cu_segments, stitched)


def _place_final_rewards(rollout_rewards: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, cu_segments: Tensor,
                         stitched: bool) -> Tensor:
    """The torch-tuned backend: the last trainable position at or before every token (one cummax over [T]),
    read at each segment's (or rollout's) last token. Offsets are clamped, never trusted as indices: bad offsets
    misplace rewards, nothing more; no host read."""
    T, S, R = loss_mask.numel(), cu_seqlens.numel() - 1, cu_segments.numel() - 1
    device = loss_mask.device
    out = torch.zeros(T + 1, dtype=torch.float32, device=device)  # slot T takes the rewards placed nowhere
    if T == 0 or S == 0 or R == 0:
        return out[:T]
    # [T] the last trainable position <= t, -1 if none (int32 where it fits: half the bytes of int64)
    pos = torch.arange(T, dtype=torch.int32 if T < 2**31 else torch.long, device=device)
    upto = pos.masked_fill_(loss_mask.logical_not(), -1).cummax(0).values
    cu = cu_seqlens.long().clamp(0, T)
    if stitched:  # one range per rollout: its segments' tokens
        cs = cu_segments.long().clamp(0, S)
        begin, end, rew = cu[cs[:-1]], cu[cs[1:]], rollout_rewards
    else:
        # [S] the rollout of each segment: the rollout starts at or before it, counted (O(S + R), not per token)
        starts = torch.zeros(S + 1, dtype=torch.long, device=device).index_add_(
            0, cu_segments[1:R].long().clamp(0, S), torch.ones(R - 1, dtype=torch.long, device=device))
        roll_of_seg = starts.cumsum(0)[:S].clamp_(max=R - 1)
        begin, end, rew = cu[:-1], cu[1:], rollout_rewards[roll_of_seg]
    last = upto[(end - 1).clamp(min=0)].long()
    out.index_put_((torch.where((end > begin) & (last >= begin), last, T),), rew)
    return out[:T]


register_op("place_final_rewards_triton", _place_fake, _place_triton)
register_op("place_final_rewards_torch", _place_fake, _place_final_rewards)
register_op("place_final_rewards", _place_fake)  # the C++ op (csrc/cpu/place.cpp, csrc/cuda/place.cu), where built


def place_final_rewards(rollout_rewards, loss_mask, cu_seqlens, cu_segments=None, mode="paper", *, backend="auto"):
    """Token rewards [T] float32 from one final reward per rollout.

    "paper": the reward goes on the last trainable token of every segment of the rollout (each segment
    carries the final reward). "stitched": only on the rollout's last trainable token. A rollout with no
    trainable token places nothing.

    Args:
        rollout_rewards: [R] float.
        loss_mask: [T] bool; cu_seqlens: [S+1]; cu_segments: [R+1] or None (one segment per rollout).
        mode: "paper" or "stitched".
        backend: "auto" | "triton" | "cuda" | "cpp" | "torch-tuned" (a cummax over the tokens) | "torch" (the
            float64 reference, `compactionrl_fast.reference.place_final_rewards`: a Python loop, for tests).

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> mask = torch.tensor([False, True, True, False, True, False])
        >>> crf.place_final_rewards(torch.tensor([2.0]), mask, torch.tensor([0, 4, 6]), torch.tensor([0, 2])).tolist()
        [0.0, 0.0, 2.0, 0.0, 2.0, 0.0]
    """
    cu_seqlens, cu_segments, S, R = _check_packed(None, None, loss_mask, cu_seqlens, cu_segments)
    check_tensor("rollout_rewards", rollout_rewards, dtypes=FLOAT_DTYPES, ndim=1, device=loss_mask.device)
    check_choice("mode", mode, tuple(REWARD_PLACEMENT))
    if rollout_rewards.numel() != R:
        raise ValueError(f"rollout_rewards must have one reward per rollout (R={R}), got shape "
                         f"{tuple(rollout_rewards.shape)}")
    b = resolve_backend(backend, loss_mask.device, op="place_final_rewards")
    if b == "torch":
        return ref.place_final_rewards(rollout_rewards, loss_mask, cu_seqlens, cu_segments, mode).float().to(
            loss_mask.device)
    op = custom_op("place_final_rewards", b)
    return op(rollout_rewards.detach().float().contiguous(), loss_mask.contiguous(), cu_seqlens, cu_segments,
              mode == "stitched")


# ---------------------------------------------------------------- the ops' entries in the registry (ops/_registry.py)


def _gae_cases(device, rewards=True):
    def case(layout, index_dtype=torch.int64, **kw):
        b = packed(device, *layout, index_dtype=index_dtype)
        T, S = b["loss_mask"].numel(), b["cu_seqlens"].numel() - 1
        if kw.get("lam") == "tensor":
            kw["lam"] = 0.8 + 0.15 * wave(S, 0.9, device)
        if rewards:
            b.update(rewards=wave(T, 1.7, device), values=wave(T, 0.3, device))
        return dict(b, **kw)
    return {"small": case(SMALL), "large": case(LARGE, torch.int32, gamma=0.99, lam=0.95, cross_segment="stitched",
                                                 lam_critic=None),
            "adaptive segment": case(SMALL, gamma=0.97, adaptive_length="segment", cross_segment="none",
                                     lam_critic=0.9),
            "lam tensor": case(SMALL, torch.int32, lam="tensor")}


def _place_cases(device):
    def case(layout, index_dtype=torch.int64, mode="paper"):
        b = packed(device, *layout, index_dtype=index_dtype)
        return dict(rollout_rewards=3.0 + wave(b["cu_segments"].numel() - 1, 2.1, device), mode=mode, **b)
    return {"small": case(SMALL), "large": case(LARGE, torch.int32, "stitched"),
            "stitched": case(SMALL, mode="stitched")}


GAE_SPEC = declare(OpSpec(
    "segment_gae", cuda=("triton", "cuda", "torch"), cpu=("cpp", "triton", "torch"),
    ops={"triton": "segment_gae_triton", "cuda": "segment_gae", "cpp": "segment_gae"},
    fn=segment_gae, reference=ref.segment_gae, cases=_gae_cases, tol=(1e-5, 1e-5),
    kernels=("gae_params", "gae_chunk", "gae_lookback"), bench="bench_gae", speed=("segment_gae",)))
PARAMS_SPEC = declare(OpSpec(
    "segment_params", cuda=("triton", "torch"), cpu=("cpp", "triton", "torch"),
    ops={"triton": "segment_gae_params_triton", "cpp": "segment_gae_params"},
    fn=segment_params, reference=ref.segment_params, cases=lambda device: _gae_cases(device, rewards=False),
    tol=(1e-12, 1e-12), kernels=("gae_params",), bench="bench_gae", speed=("segment_params",)))
PLACE_SPEC = declare(OpSpec(
    "place_final_rewards", cuda=("triton", "cuda", "torch-tuned", "torch"),
    cpu=("cpp", "triton", "torch-tuned", "torch"),
    ops={"triton": "place_final_rewards_triton", "cuda": "place_final_rewards", "cpp": "place_final_rewards",
         "torch-tuned": "place_final_rewards_torch"},
    fn=place_final_rewards, reference=ref.place_final_rewards, cases=_place_cases, tol=(0, 0),
    kernels=("place",), bench="bench_place", speed=("place_final_rewards",)))
