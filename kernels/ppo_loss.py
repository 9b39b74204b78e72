"""Triton kernels of `ppo_policy_loss` (docs/ops.md): one fused pass writes the per-token gradient
(times its reduction weight) and per-block partial sums of the loss and the metrics; the program that
finishes last (an integer ticket counts the finished programs) then adds every block's partials in a
fixed order in float64 and writes the loss and the metrics. No float atomics: results are bitwise
deterministic, and the call is one launch.

The launcher runs on its tensors' device and has no autograd; compactionrl_fast/ops/ppo_loss.py registers it as
a custom op.
"""
import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard, empty

N_PARTS = 8  # loss, tokens, clipped, dual, kl, ratio_max, log ratio, (1 unused: keeps rows 32-byte aligned)
N_METRICS = 5  # clip_fraction, dual_clip_fraction, approx_kl, ratio_max, log_ratio
FINISH_BLOCKS = 256  # partial rows the last program adds per step


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


@triton.jit
def weight_scale(x, w):
    """x * w for tokens' reduction weights w: 0 where w = 0 even if x overflowed float32 (a denominator of 0;
    the float64 reference gives 0 there), NaN kept."""
    return tl.where(w == 0.0, tl.where(x == x, 0.0, x), x * w)


@triton.jit
def last_program(ticket):
    """True in the one program that finishes last: its partials and every other program's are stored.

    The barrier orders all of this program's stores before the ticket; the atomic (acq_rel, gpu scope)
    publishes them and, in the last program, makes the other programs' partials visible."""
    tl.debug_barrier()
    return tl.atomic_add(ticket, 1) == tl.num_programs(0) - 1


@triton.jit
def load_col(part, o_b, m_b, k):
    """Column k of the [n_blocks, 8] partials' rows o_b as float64, 0 past the last row. .cg: read at L2,
    where the other programs' stores are visible."""
    return tl.load(part + o_b.to(tl.int64) * 8 + k, mask=m_b, other=0.0, cache_modifier=".cg").to(tl.float64)


@triton.jit
def ppo_finish(part, n_blocks, loss_out, metrics_out, FB: tl.constexpr):
    """Adds the [n_blocks, 8] partials (float64, FB blocks at a time in block order) and writes the loss
    float32 [] and the metrics float32 [5] (clip_fraction, dual_clip_fraction, approx_kl, ratio_max,
    log_ratio): the float64 sums divided by the trainable tokens n (0 when n == 0), ratio_max =
    max(0, block maxima) with a NaN block maximum kept."""
    o_r = tl.arange(0, FB)
    s_loss = tl.zeros([1], tl.float64)
    s_n, s_clip, s_dual, s_kl, s_lr, r_max = s_loss, s_loss, s_loss, s_loss, s_loss, s_loss
    has_nan = tl.zeros([1], tl.int32)
    for i in range(tl.cdiv(n_blocks, FB)):
        o_b = i * FB + o_r
        m_b = o_b < n_blocks
        s_loss += tl.sum(load_col(part, o_b, m_b, 0), 0)
        s_n += tl.sum(load_col(part, o_b, m_b, 1), 0)
        s_clip += tl.sum(load_col(part, o_b, m_b, 2), 0)
        s_dual += tl.sum(load_col(part, o_b, m_b, 3), 0)
        s_kl += tl.sum(load_col(part, o_b, m_b, 4), 0)
        s_lr += tl.sum(load_col(part, o_b, m_b, 6), 0)
        b_r = load_col(part, o_b, m_b, 5)
        has_nan = tl.maximum(has_nan, tl.max((b_r != b_r).to(tl.int32), 0))  # tl.max may drop a NaN
        r_max = tl.maximum(r_max, tl.max(b_r, 0))
    inv = tl.where(s_n > 0, 1.0 / tl.where(s_n > 0, s_n, 1.0), 0.0)
    o1 = tl.arange(0, 1)
    tl.store(loss_out + o1, s_loss.to(tl.float32))
    tl.store(metrics_out + o1, (s_clip * inv).to(tl.float32))
    tl.store(metrics_out + 1 + o1, (s_dual * inv).to(tl.float32))
    tl.store(metrics_out + 2 + o1, (s_kl * inv).to(tl.float32))
    tl.store(metrics_out + 3 + o1, tl.where(has_nan > 0, float("nan"), r_max).to(tl.float32))
    tl.store(metrics_out + 4 + o1, (s_lr * inv).to(tl.float32))


@triton.jit(do_not_specialize=["T", "S", "n_iter"])
def ppo_loss_fwd_kernel(logp, old, adv, roll, mask, cu, scale, grad, part, ticket, loss_out, metrics_out, T, S,
                        n_iter, ratio_lo, ratio_hi, dual_c, tis_cap, HAS_TIS: tl.constexpr, PER_SEG: tl.constexpr,
                        NEED_GRAD: tl.constexpr, BT: tl.constexpr, FB: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = i_b * BT + tl.arange(0, BT)
    m_t = o_t < T
    # [BT]; the weight first: few values are live across its search loop (no spills)
    b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG)
    b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
    b_old = tl.load(old + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_x = tl.load(logp + o_t, mask=m_t, other=0.0).to(tl.float32) - b_old
    b_a = tl.load(adv + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_r = tl.exp(b_x)
    b_rc = tl.minimum(tl.maximum(b_r, ratio_lo), ratio_hi)
    # A = 0 with a ratio past float32 but not float64: the loss is 0, not 0 * inf = NaN; past float64 (a
    # log-ratio > ~709.78) the reference's ratio is inf too and -0 * inf is NaN (csrc/common/ppo_math.h)
    b_inf64 = b_x > 709.782712893384
    b_l1 = -b_a * tl.where((b_a == 0.0) & (b_r > 3.40282347e38) & ~b_inf64, 0.0, b_r)
    b_l2 = -b_a * b_rc
    b_clip = b_l2 > b_l1
    b_l = tl.where(b_clip, b_l2, b_l1)
    b_ld = -dual_c * b_a
    b_dual = (b_a < 0.0) & (b_l > b_ld) & (dual_c < 3.4e38)  # float32 max (~3.403e38): off, also for an inf l
    b_l = tl.where(b_dual, b_ld, b_l)
    # the reference's chain rule: a ratio past float64 times a zero factor (clipped, dual-clipped, A = 0) is NaN
    b_g0 = tl.where(b_inf64, float("nan"), 0.0)
    b_g = tl.where(b_clip | b_dual | (b_inf64 & (b_a == 0.0)), b_g0, b_l1)
    if HAS_TIS:
        b_roll = tl.load(roll + o_t, mask=m_t, other=0.0).to(tl.float32)
        b_is = tl.exp(b_old - b_roll)
        b_is = tl.where(b_is > tis_cap, tis_cap, b_is)  # a NaN weight stays NaN (tl.minimum may drop it)
        # 0 * a weight past float32 but not float64 is 0 (the float64 reference); past float64 it is NaN
        b_big = (b_is > 3.40282347e38) & (b_old - b_roll <= 709.782712893384)
        b_l = tl.where((b_l == 0.0) & b_big, b_l, b_l * b_is)
        # a clipped token's zero derivative stays 0 (NaN past float64) whatever the weight: the reference's
        # weight multiplies the upstream gradient, and the clamp passes none of it
        b_g = tl.where(b_clip | b_dual | ((b_g == 0.0) & b_big), b_g, b_g * b_is)
    b_g = tl.where(b_l != b_l, b_l, b_g)  # a NaN loss term gives a NaN gradient (docs/ops.md)
    if NEED_GRAD:
        tl.store(grad + o_t, tl.where(b_m, weight_scale(b_g, b_w), 0.0), mask=m_t)
    p_part = part + i_b * 8
    tl.store(p_part + 0, tl.sum(tl.where(b_m, weight_scale(b_l, b_w), 0.0), 0))
    tl.store(p_part + 1, tl.sum(b_m.to(tl.float32), 0))
    tl.store(p_part + 2, tl.sum((b_m & b_clip).to(tl.float32), 0))
    tl.store(p_part + 3, tl.sum((b_m & b_dual).to(tl.float32), 0))
    tl.store(p_part + 4, tl.sum(tl.where(b_m, kl_term(b_x, b_r), 0.0), 0))
    # tl.max may drop NaN on GPU: a NaN ratio of a trainable token is stored as NaN explicitly
    b_nan = tl.max((b_m & (b_r != b_r)).to(tl.int32), 0)
    tl.store(p_part + 5, tl.where(b_nan > 0, float("nan"), tl.max(tl.where(b_m, b_r, 0.0), 0)))
    tl.store(p_part + 6, tl.sum(tl.where(b_m, b_x, 0.0), 0))
    if last_program(ticket):
        ppo_finish(part, tl.num_programs(0), loss_out, metrics_out, FB)


def search_steps(S: int) -> int:
    """Binary-search iterations that narrow [0, S) to one segment."""
    return max(1, int(S).bit_length())


def ppo_loss_fwd(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, cu_seqlens, seg_scale,
                 clip_low, clip_high, dual_clip, tis_cap, need_grad, BT=1024):
    """Fused forward, one launch. Tensors: float32 [T] (rollout_logprobs optional), bool [T], cu_seqlens
    [S+1] or None, seg_scale float64 [S]. Returns (loss float32 [], metrics float32 [5] (clip_fraction,
    dual_clip_fraction, approx_kl, ratio_max, log_ratio), grad float32 [T] (or [0] without need_grad))."""
    T, device = logprobs.numel(), logprobs.device
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if S < 1 and T > 0:  # a shape check: the kernel would read seg_scale[0] of []
        raise ValueError(f"cu_seqlens must have at least 2 elements when T > 0, got {S + 1}")
    n_blocks = triton.cdiv(T, BT)
    grad = empty(T if need_grad else 0, device=device)
    if n_blocks == 0:  # no tokens: loss and metrics 0
        return torch.zeros((), device=device), torch.zeros(N_METRICS, device=device), grad
    loss, metrics = empty((), device=device), empty(N_METRICS, device=device)
    part = empty(n_blocks, N_PARTS, device=device)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    with device_guard(logprobs):
        ppo_loss_fwd_kernel[(n_blocks,)](
            logprobs, old_logprobs, advantages, logprobs if rollout_logprobs is None else rollout_logprobs,
            loss_mask, seg_scale if cu_seqlens is None else cu_seqlens, seg_scale, grad, part, ticket, loss, metrics,
            T, S, search_steps(S), 1.0 - clip_low, 1.0 + clip_high, dual_clip, tis_cap,
            HAS_TIS=rollout_logprobs is not None, PER_SEG=S > 1, NEED_GRAD=need_grad, BT=BT, FB=FINISH_BLOCKS)
    return loss, metrics, grad
