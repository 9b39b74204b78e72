"""Triton kernels of `ppo_policy_loss` (docs/ops.md): one fused pass writes the per-token gradient
(times its reduction weight) and per-block partial sums of the loss and the metrics; the program that
finishes last (an integer ticket counts the finished programs) then adds every block's partials in a
fixed order in float64 and writes the loss and the metrics. No float atomics: results are bitwise
deterministic, and the call is one launch.

Non-finite input (docs/ops.md): the float32 terms are the float64 reference's, rounded, while every trainable
token's loss and KL term are finite. A block whose float32 loss or KL sum is not finite (NaN or inf input, a
ratio or product past float32) is done again (`ppo_block_f64`, a block-uniform branch: other blocks pay only
the test), its tokens with a term that is not finite in float64, as csrc/cpu/ppo_loss.cpp `ppo_chunk_f64`
does, so that a value past float32 but not float64 (an advantage of 3e38 times a ratio of 1.2) rounds only at
the end. The partials are float64 for the same reason.

The launcher runs on its tensors' device and has no autograd; compactionrl_fast/ops/ppo_loss.py registers it as
a custom op.
"""
import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard, empty, split64

N_PARTS = 8  # loss, tokens, clipped, dual, kl, ratio_max, log ratio, (1 unused: keeps rows 64-byte aligned)
N_METRICS = 5  # clip_fraction, dual_clip_fraction, approx_kl, ratio_max, log_ratio
FINISH_BLOCKS = 256  # partial rows the last program adds per step
BLOCK = 512  # tokens per program: 4 per thread at NUM_WARPS = 4
NUM_WARPS = 4
# ptxas's register limit per thread for the loss kernels (here and kernels/value_loss.py), passed explicitly:
# without one, triton 3.6's ptxas holds them to 64 registers on sm_90 and spills around the float64 branch;
# with it they take 62-80 registers and do not spill (tests/test_aot.py, triton 3.6 and 3.7)
MAXNREG = 128


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
    """Reduction weight (float64) of tokens `o_t`: scale[s] of their segment s (the last s with cu[s] <= t,
    found by a branch-free binary search over cu[0..S-1]), or scale[0] without segments."""
    if PER_SEG:
        lo = tl.zeros_like(o_t)
        hi = lo + S
        for _ in range(n_iter):
            mid = (lo + hi) // 2
            ge = tl.load(cu + mid).to(tl.int64) <= o_t
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid)
        return tl.load(scale + lo)
    else:
        return tl.load(scale)


@triton.jit
def finite(x):
    """Neither inf nor NaN."""
    return tl.abs(x) < float("inf")


@triton.jit
def f64(x, x_e):
    """The float64 parameter x + x_e of a float32 pair (kernels/_launch.py `split64`)."""
    return tl.zeros([1], tl.float64) + x + x_e


@triton.jit
def nan_max(b_x, b_m):
    """Max of b_x over b_m (0 if none), NaN if one is NaN (tl.max may drop a NaN on GPU)."""
    b_nan = tl.max((b_m & (b_x != b_x)).to(tl.int32), 0)
    return tl.where(b_nan > 0, float("nan"), tl.max(tl.where(b_m, b_x, 0.0), 0))


@triton.jit
def last_program(ticket):
    """True in the one program that finishes last: its partials and every other program's are stored.

    The barrier orders all of this program's stores before the ticket; the atomic (acq_rel, gpu scope)
    publishes them and, in the last program, makes the other programs' partials visible."""
    tl.debug_barrier()
    return tl.atomic_add(ticket, 1) == tl.num_programs(0) - 1


@triton.jit
def load_col(part, o_b, m_b, k):
    """Column k of the [n_blocks, 8] float64 partials' rows o_b, 0 past the last row. .cg: read at L2, where
    the other programs' stores are visible."""
    return tl.load(part + o_b.to(tl.int64) * 8 + k, mask=m_b, other=0.0, cache_modifier=".cg")


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


@triton.jit
def ppo_terms(logp, old, adv, roll, o_t, m_t, ratio_lo, ratio_hi, dual_c, tis_cap, HAS_TIS: tl.constexpr):
    """float32 terms of tokens o_t [n] (m_t: in range): loss (times the TIS weight), d loss / d logp, KL term, log
    ratio, ratio, clipped, dual-clipped; the float64 ones rounded where the loss and the KL term are finite."""
    b_old = tl.load(old + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_x = tl.load(logp + o_t, mask=m_t, other=0.0).to(tl.float32) - b_old
    b_a = tl.load(adv + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_r = tl.exp(b_x)
    b_rc = tl.minimum(tl.maximum(b_r, ratio_lo), ratio_hi)
    b_l1 = -b_a * b_r
    b_l2 = -b_a * b_rc
    b_clip = b_l2 > b_l1
    b_l = tl.where(b_clip, b_l2, b_l1)
    b_ld = -dual_c * b_a
    b_dual = (b_a < 0.0) & (b_l > b_ld) & (dual_c < 3.4e38)  # float32 max (~3.403e38): off, also for an inf l
    b_l = tl.where(b_dual, b_ld, b_l)
    b_g = tl.where(b_clip | b_dual, 0.0, b_l1)
    if HAS_TIS:
        b_is = tl.exp(b_old - tl.load(roll + o_t, mask=m_t, other=0.0).to(tl.float32))
        b_is = tl.where(b_is > tis_cap, tis_cap, b_is)  # a NaN weight stays NaN (tl.minimum may drop it)
        b_l = b_l * b_is
        b_g = b_g * b_is
    return b_l, b_g, kl_term(b_x, b_r), b_x, b_r, b_clip, b_dual


@triton.jit
def ppo_block_f64(logp, old, adv, roll, mask, cu, scale, grad, i_b, T, S, n_iter, ratio_lo, ratio_lo_e, ratio_hi,
                  ratio_hi_e, dual_c, dual_c_e, tis_cap, tis_cap_e, HAS_TIS: tl.constexpr, PER_SEG: tl.constexpr,
                  NEED_GRAD: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr):
    """Block i_b again, SUB tokens at a time (few float64 values live), after its float32 loss or KL sum was not
    finite: a trainable token whose float32 loss or KL term is not finite is done in float64 with the
    reference's arithmetic (csrc/cpu/ppo_loss.cpp `ppo_chunk_f64`): its loss, metrics and the gradient autograd
    forms, term by term (a branch not taken passes 0 on, which times an infinite factor is NaN), NaN where the
    loss is NaN; the other tokens keep their float32 terms. Writes the gradient; returns the block's float64
    loss, KL and log-ratio sums, clipped and dual-clipped counts and ratio max (NaN kept)."""
    # the float32 pass's gradient stores (other threads, other layout) land before this pass's stores at the
    # same tokens: the branch is block-uniform, so every thread reaches the barrier
    tl.debug_barrier()
    lo, hi = f64(ratio_lo, ratio_lo_e), f64(ratio_hi, ratio_hi_e)
    a_loss = tl.zeros([SUB], tl.float64)
    a_kl, a_lr, a_rmax = a_loss, a_loss, a_loss
    a_clip = tl.zeros([SUB], tl.float32)
    a_dual = a_clip
    a_nan = tl.zeros([SUB], tl.int32)
    for j in range(0, BT, SUB):
        o_t = i_b * BT + j + tl.arange(0, SUB)
        m_t = o_t < T
        # [SUB]
        b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG)
        b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
        b_l, b_g, b_k, b_x, b_r, b_clip, b_dual = ppo_terms(logp, old, adv, roll, o_t, m_t, ratio_lo, ratio_hi,
                                                            dual_c, tis_cap, HAS_TIS)
        b_bad = b_m & ~(finite(b_l) & finite(b_k))
        b_old = tl.load(old + o_t, mask=m_t, other=0.0).to(tl.float64)
        b_x64 = tl.load(logp + o_t, mask=m_t, other=0.0).to(tl.float64) - b_old
        b_a = tl.load(adv + o_t, mask=m_t, other=0.0).to(tl.float64)
        b_r64 = tl.exp(b_x64)
        b_l1 = -b_a * b_r64
        b_l2 = -b_a * tl.where(b_r64 < lo, lo, tl.where(b_r64 > hi, hi, b_r64))
        b_clip64 = b_l2 > b_l1
        b_l64 = tl.where(b_clip64, b_l2, b_l1)
        b_ld = -f64(dual_c, dual_c_e) * b_a
        b_dual64 = (b_a < 0.0) & (b_l64 > b_ld) & (dual_c < 3.4e38)
        b_l64 = tl.where(b_dual64, b_ld, b_l64)
        b_gpre = b_w
        if HAS_TIS:
            cap = f64(tis_cap, tis_cap_e)
            b_is = tl.exp(b_old - tl.load(roll + o_t, mask=m_t, other=0.0).to(tl.float64))
            b_is = tl.where(b_is > cap, cap, b_is)  # NaN stays NaN
            b_l64 = b_l64 * b_is
            b_gpre = b_gpre * b_is
        b_gpre = tl.where(b_dual64, 0.0, b_gpre)
        b_gr = tl.where(b_clip64, 0.0, b_gpre) * -b_a
        b_gr += tl.where((b_r64 >= lo) & (b_r64 <= hi), tl.where(b_clip64, b_gpre, 0.0) * -b_a, 0.0)
        if NEED_GRAD:
            b_gw = tl.where(b_l64 != b_l64, b_l64, b_gr * b_r64).to(tl.float32)
            tl.store(grad + o_t, tl.where(b_bad, b_gw, tl.where(b_m, b_g * b_w.to(tl.float32), 0.0)), mask=m_t)
        a_loss += tl.where(b_bad, b_l64, tl.where(b_m, b_l, 0.0).to(tl.float64)) * b_w
        a_kl += tl.where(b_bad, (b_r64 - 1.0) - b_x64, tl.where(b_m, b_k, 0.0).to(tl.float64))
        a_lr += tl.where(b_bad, b_x64, tl.where(b_m, b_x, 0.0).to(tl.float64))
        a_clip += (b_m & tl.where(b_bad, b_clip64, b_clip)).to(tl.float32)
        a_dual += (b_m & tl.where(b_bad, b_dual64, b_dual)).to(tl.float32)
        b_r64 = tl.where(b_bad, b_r64, tl.where(b_m, b_r, 0.0).to(tl.float64))
        a_nan = tl.maximum(a_nan, (b_r64 != b_r64).to(tl.int32))
        a_rmax = tl.maximum(a_rmax, b_r64)
    r_max = tl.where(tl.max(a_nan, 0) > 0, float("nan"), tl.max(a_rmax, 0))
    return (tl.sum(a_loss, 0), tl.sum(a_kl, 0), tl.sum(a_lr, 0), tl.sum(a_clip, 0), tl.sum(a_dual, 0), r_max)


@triton.jit(do_not_specialize=["T", "S", "n_iter"])
def ppo_loss_fwd_kernel(logp, old, adv, roll, mask, cu, scale, grad, part, ticket, loss_out, metrics_out, T, S,
                        n_iter, ratio_lo, ratio_lo_e, ratio_hi, ratio_hi_e, dual_c, dual_c_e, tis_cap, tis_cap_e,
                        HAS_TIS: tl.constexpr, PER_SEG: tl.constexpr, NEED_GRAD: tl.constexpr, BT: tl.constexpr,
                        FB: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = i_b * BT + tl.arange(0, BT)
    m_t = o_t < T
    # [BT]; the weight first: few values are live across its search loop (no spills)
    b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG).to(tl.float32)
    b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
    b_l, b_g, b_k, b_x, b_r, b_clip, b_dual = ppo_terms(logp, old, adv, roll, o_t, m_t, ratio_lo, ratio_hi, dual_c,
                                                        tis_cap, HAS_TIS)
    # the float32 pass complete before the branch (only scalars stay live across it: no spills with triton
    # 3.6's ptxas); the float64 branch writes the block's gradient again
    if NEED_GRAD:
        tl.store(grad + o_t, tl.where(b_m, b_g * b_w, 0.0), mask=m_t)
    n = tl.sum(b_m.to(tl.float32), 0)
    s_loss = tl.sum(tl.where(b_m, b_l * b_w, 0.0), 0).to(tl.float64)
    s_kl = tl.sum(tl.where(b_m, b_k, 0.0), 0).to(tl.float64)
    s_lr = tl.sum(tl.where(b_m, b_x, 0.0), 0).to(tl.float64)
    s_clip = tl.sum((b_m & b_clip).to(tl.float32), 0)
    s_dual = tl.sum((b_m & b_dual).to(tl.float32), 0)
    r_max = nan_max(b_r, b_m).to(tl.float64)
    if (~finite(s_loss)) | (~finite(s_kl)):  # a term past float32 or NaN (or a sum past float32)
        s_loss, s_kl, s_lr, s_clip, s_dual, r_max = ppo_block_f64(
            logp, old, adv, roll, mask, cu, scale, grad, i_b, T, S, n_iter, ratio_lo, ratio_lo_e, ratio_hi,
            ratio_hi_e, dual_c, dual_c_e, tis_cap, tis_cap_e, HAS_TIS, PER_SEG, NEED_GRAD, BT,
            BT // 4)  # one token per thread at BT = 512 and 4 warps
    p_part = part + i_b * 8
    tl.store(p_part + 0, s_loss)
    tl.store(p_part + 1, n.to(tl.float64))
    tl.store(p_part + 2, s_clip.to(tl.float64))
    tl.store(p_part + 3, s_dual.to(tl.float64))
    tl.store(p_part + 4, s_kl)
    tl.store(p_part + 5, r_max)
    tl.store(p_part + 6, s_lr)
    if last_program(ticket):
        ppo_finish(part, tl.num_programs(0), loss_out, metrics_out, FB)


def search_steps(S: int) -> int:
    """Binary-search iterations that narrow [0, S) to one segment."""
    return max(1, int(S).bit_length())


def ppo_loss_fwd(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, cu_seqlens, seg_scale,
                 clip_low, clip_high, dual_clip, tis_cap, need_grad, BT=BLOCK):
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
    part = empty(n_blocks, N_PARTS, dtype=torch.float64, device=device)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    with device_guard(logprobs):
        ppo_loss_fwd_kernel[(n_blocks,)](
            logprobs, old_logprobs, advantages, logprobs if rollout_logprobs is None else rollout_logprobs,
            loss_mask, seg_scale if cu_seqlens is None else cu_seqlens, seg_scale, grad, part, ticket, loss, metrics,
            T, S, search_steps(S), *split64(1.0 - clip_low), *split64(1.0 + clip_high), *split64(dual_clip),
            *split64(tis_cap),
            HAS_TIS=rollout_logprobs is not None, PER_SEG=S > 1, NEED_GRAD=need_grad, BT=BT, FB=FINISH_BLOCKS,
            num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return loss, metrics, grad


# What tests/test_aot.py compiles: every feature-flag combination that matters, both index dtypes.
def _aot_sig(idx):
    return {"logp": "*fp32", "old": "*fp32", "adv": "*fp32", "roll": "*fp32", "mask": "*i1", "cu": f"*{idx}",
            "scale": "*fp64", "grad": "*fp32", "part": "*fp64", "ticket": "*i32", "loss_out": "*fp32",
            "metrics_out": "*fp32", "T": "i32", "S": "i32", "n_iter": "i32",
            **{f"{k}{e}": "fp32" for k in ("ratio_lo", "ratio_hi", "dual_c", "tis_cap") for e in ("", "_e")},
            "HAS_TIS": "constexpr", "PER_SEG": "constexpr", "NEED_GRAD": "constexpr", "BT": "constexpr",
            "FB": "constexpr"}


AOT = [("ppo_loss_fwd_kernel", _aot_sig(idx), {"HAS_TIS": tis, "PER_SEG": per_seg, "NEED_GRAD": True, "BT": BLOCK,
                                               "FB": FINISH_BLOCKS},
        {"num_warps": NUM_WARPS, "maxnreg": MAXNREG})
       for idx, tis, per_seg in [("i32", False, False), ("i32", True, True), ("i64", False, True)]]
