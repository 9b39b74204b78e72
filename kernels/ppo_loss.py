"""Triton kernels of `ppo_policy_loss` (docs/ops.md): one fused pass writes the per-token gradient
(times its reduction weight) and per-block partial sums of the loss and the metrics; a second tiny pass
adds the partials in block order, so results are bitwise deterministic (no float atomics).

Launchers here have no autograd; compactionrl_fast/ops/ppo_loss.py wraps them in a custom op.
"""
import torch
import triton
import triton.language as tl

from compactionrl_fast.ops._alloc import empty

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)

N_PARTS = 8  # loss, tokens, clipped, dual, kl, ratio_max, log ratio, (1 unused: keeps rows 32-byte aligned)


@triton.jit
def kl_term(x, ratio):
    """(ratio - 1) - x with ratio = e^x, accurate near x = 0 (Taylor series for |x| < 0.5)."""
    s = 1.0 / 40320.0
    s = s * x + 1.0 / 5040.0
    s = s * x + 1.0 / 720.0
    s = s * x + 1.0 / 120.0
    s = s * x + 1.0 / 24.0
    s = s * x + 1.0 / 6.0
    s = s * x + 0.5
    return tl.where(tl.abs(x) < 0.5, s * x * x, (ratio - 1.0) - x)


@triton.jit
def segment_scale(o_t, cu, scale, S, n_iter, PER_SEG: tl.constexpr):
    """Reduction weight of tokens `o_t`: scale[s] of their segment s (the last s with cu[s] <= t, found
    by a branch-free binary search over cu[0..S-1]), or scale[0] without segments."""
    if PER_SEG:
        lo = tl.zeros_like(o_t)
        hi = lo + S
        for _ in range(n_iter):
            mid = (lo + hi) // 2
            ge = tl.load(cu + mid).to(tl.int64) <= o_t
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid)
        return tl.load(scale + lo).to(tl.float32)
    else:
        return tl.load(scale).to(tl.float32)


@triton.jit(do_not_specialize=["T", "S", "n_iter"])
def ppo_loss_fwd_kernel(logp, old, adv, roll, mask, cu, scale, grad, part, T, S, n_iter, ratio_lo, ratio_hi,
                        dual_c, tis_cap, HAS_TIS: tl.constexpr, PER_SEG: tl.constexpr, NEED_GRAD: tl.constexpr,
                        BT: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = i_b * BT + tl.arange(0, BT)
    m_t = o_t < T
    # [BT]
    b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
    b_old = tl.load(old + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_x = tl.load(logp + o_t, mask=m_t, other=0.0).to(tl.float32) - b_old
    b_a = tl.load(adv + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_r = tl.exp(b_x)
    b_rc = tl.minimum(tl.maximum(b_r, ratio_lo), ratio_hi)
    # A = 0 with a ratio past float32: the loss is 0, not 0 * inf = NaN (csrc/common/ppo_math.h)
    b_l1 = -b_a * tl.where((b_a == 0.0) & (b_r > 3.40282347e38), 0.0, b_r)
    b_l2 = -b_a * b_rc
    b_clip = b_l2 > b_l1
    b_l = tl.where(b_clip, b_l2, b_l1)
    b_ld = -dual_c * b_a
    b_dual = (b_a < 0.0) & (b_l > b_ld) & (dual_c < 3.4e38)  # float32 max (~3.403e38): off, also for an inf l
    b_l = tl.where(b_dual, b_ld, b_l)
    b_g = tl.where(b_clip | b_dual, 0.0, b_l1)
    if HAS_TIS:
        b_roll = tl.load(roll + o_t, mask=m_t, other=0.0).to(tl.float32)
        b_is = tl.exp(b_old - b_roll)
        b_is = tl.where(b_is > tis_cap, tis_cap, b_is)  # a NaN weight stays NaN (tl.minimum may drop it)
        b_big = b_is > 3.40282347e38  # 0 * an overflowed weight is 0 (the float64 reference)
        b_l = tl.where((b_l == 0.0) & b_big, b_l, b_l * b_is)
        b_g = tl.where((b_g == 0.0) & b_big, b_g, b_g * b_is)
    b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG)
    if NEED_GRAD:
        tl.store(grad + o_t, tl.where(b_m, b_g * b_w, 0.0), mask=m_t)
    p_part = part + i_b * 8
    tl.store(p_part + 0, tl.sum(tl.where(b_m, b_l * b_w, 0.0), 0))
    tl.store(p_part + 1, tl.sum(b_m.to(tl.float32), 0))
    tl.store(p_part + 2, tl.sum((b_m & b_clip).to(tl.float32), 0))
    tl.store(p_part + 3, tl.sum((b_m & b_dual).to(tl.float32), 0))
    tl.store(p_part + 4, tl.sum(tl.where(b_m, kl_term(b_x, b_r), 0.0), 0))
    # tl.max may drop NaN on GPU: a NaN ratio of a trainable token is stored as NaN explicitly
    b_nan = tl.max((b_m & (b_r != b_r)).to(tl.int32), 0)
    tl.store(p_part + 5, tl.where(b_nan > 0, float("nan"), tl.max(tl.where(b_m, b_r, 0.0), 0)))
    tl.store(p_part + 6, tl.sum(tl.where(b_m, b_x, 0.0), 0))


def search_steps(S: int) -> int:
    """Binary-search iterations that narrow [0, S) to one segment."""
    return max(1, int(S).bit_length())


def ppo_loss_fwd(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, cu_seqlens, seg_scale,
                 clip_low, clip_high, dual_clip, tis_cap, need_grad, BT=1024):
    """Fused forward. Tensors: float32 [T] (rollout_logprobs optional), bool [T], cu_seqlens [S+1] or None,
    seg_scale float64 [S]. Returns (loss float32 [], metrics float32 [5] (clip_fraction,
    dual_clip_fraction, approx_kl, ratio_max, log_ratio), grad float32 [T] (or [0] without need_grad))."""
    T, device = logprobs.numel(), logprobs.device
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if S < 1 and T > 0:  # a shape check: the kernel would read seg_scale[0] of []
        raise ValueError(f"cu_seqlens must have at least 2 elements when T > 0, got {S + 1}")
    n_blocks = triton.cdiv(T, BT)
    grad = empty(T if need_grad else 0, device=device)
    part = empty(n_blocks, N_PARTS, device=device)
    if n_blocks:
        ppo_loss_fwd_kernel[(n_blocks,)](
            logprobs, old_logprobs, advantages, logprobs if rollout_logprobs is None else rollout_logprobs,
            loss_mask, seg_scale if cu_seqlens is None else cu_seqlens, seg_scale, grad, part, T, S,
            search_steps(S), 1.0 - clip_low, 1.0 + clip_high, dual_clip, tis_cap,
            HAS_TIS=rollout_logprobs is not None, PER_SEG=S > 1, NEED_GRAD=need_grad, BT=BT)
    return (*reduce_partials(part), grad)


def reduce_partials(part):
    """The second pass: add the [n_blocks, 8] partials in block order (float64), make the metrics."""
    tot = part[:, :7].double().sum(0)
    ratio_max = torch.cat([part.new_zeros(1), part[:, 5]]).max()
    n = tot[1]
    inv = torch.where(n > 0, 1.0 / torch.where(n > 0, n, 1.0), 0.0)
    metrics = torch.stack([tot[2] * inv, tot[3] * inv, tot[4] * inv, ratio_max.double(), tot[6] * inv]).float()
    return tot[0].float(), metrics


# What tests/test_aot.py compiles for sm_80/sm_90: every feature-flag combination that matters, both
# index dtypes.
def _aot_sig(idx):
    return {"logp": "*fp32", "old": "*fp32", "adv": "*fp32", "roll": "*fp32", "mask": "*i1", "cu": f"*{idx}",
            "scale": "*fp64", "grad": "*fp32", "part": "*fp32", "T": "i32", "S": "i32", "n_iter": "i32",
            "ratio_lo": "fp32", "ratio_hi": "fp32", "dual_c": "fp32", "tis_cap": "fp32",
            "HAS_TIS": "constexpr", "PER_SEG": "constexpr", "NEED_GRAD": "constexpr", "BT": "constexpr"}


AOT_SPECS = [
    ("ppo_loss_fwd_kernel", _aot_sig(idx), {"HAS_TIS": tis, "PER_SEG": per_seg, "NEED_GRAD": True, "BT": 1024})
    for idx, tis, per_seg in [("i32", False, False), ("i32", True, True), ("i64", False, True)]
]
