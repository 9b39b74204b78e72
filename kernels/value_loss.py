"""Triton kernels of `value_loss` (docs/ops.md): one fused pass writes the per-token gradient (times
its reduction weight) and per-block partials of the loss and the metrics; the program that finishes last
combines the partials in a fixed order in float64 and writes the loss and the metrics (no float atomics,
bitwise deterministic, one launch; see `last_program` in kernels/ppo_loss.py).

The explained variance is combined from per-block (count, sum, sum of squared deviations from the block
mean) (Chan et al.), so a large mean of the returns does not cancel the variance away. The partials are float64.
Non-finite input (docs/ops.md): a block whose float32 loss, sums or squared deviations are not finite (NaN or
inf input, returns ~1e20 whose squares pass float32) is done again (`value_block_f64`, a block-uniform branch):
its sums and squared deviations in float64, its tokens with a float32 loss that is not finite in float64, as
csrc/cpu/value_loss.cpp `value_chunk_f64` does.
The launcher runs on its tensors' device and has no autograd; compactionrl_fast/ops/value_loss.py registers it as
a custom op.
"""
import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard, empty, split64

from .ppo_loss import FINISH_BLOCKS, MAXNREG, f64, finite, last_program, load_col, search_steps, segment_scale

N_PARTS = 8  # loss, tokens, clipped, sum_v, sum_r, m2_r, sum_e, m2_e  (e = returns - values)
NUM_WARPS = 8  # 4 tokens per thread at BT = 1024 (at 4 warps, triton 3.6/3.7's ptxas spills on sm_80)


@triton.jit
def value_finish(part, n_blocks, loss_out, metrics_out, FB: tl.constexpr):
    """Combines the [n_blocks, 8] partials (float64, FB blocks at a time in block order) and writes the loss
    float32 [] and the metrics float32 [3]: clip fraction and value mean over the trainable tokens n (0 when
    n == 0), explained variance 1 - Var(e)/Var(R) (0 when Var(R) <= 0, NaN stays NaN), each variance
    combined from the blocks' (count, sum, squared deviations) as Chan et al.: (sum m2_b + sum n_b
    (mean_b - mean)^2) / n."""
    o_r = tl.arange(0, FB)
    s_loss = tl.zeros([1], tl.float64)
    s_n, s_clip, s_v, s_r, m2_r, s_e, m2_e = s_loss, s_loss, s_loss, s_loss, s_loss, s_loss, s_loss
    for i in range(tl.cdiv(n_blocks, FB)):
        o_b = i * FB + o_r
        m_b = o_b < n_blocks
        s_loss += tl.sum(load_col(part, o_b, m_b, 0), 0)
        s_n += tl.sum(load_col(part, o_b, m_b, 1), 0)
        s_clip += tl.sum(load_col(part, o_b, m_b, 2), 0)
        s_v += tl.sum(load_col(part, o_b, m_b, 3), 0)
        s_r += tl.sum(load_col(part, o_b, m_b, 4), 0)
        m2_r += tl.sum(load_col(part, o_b, m_b, 5), 0)
        s_e += tl.sum(load_col(part, o_b, m_b, 6), 0)
        m2_e += tl.sum(load_col(part, o_b, m_b, 7), 0)
    n_1 = tl.maximum(s_n, 1.0)
    mean_r, mean_e = s_r / n_1, s_e / n_1
    for i in range(tl.cdiv(n_blocks, FB)):  # the spread of the block means around the mean
        o_b = i * FB + o_r
        m_b = o_b < n_blocks
        n_b = load_col(part, o_b, m_b, 1)
        d_r = load_col(part, o_b, m_b, 4) / tl.maximum(n_b, 1.0) - mean_r
        d_e = load_col(part, o_b, m_b, 6) / tl.maximum(n_b, 1.0) - mean_e
        m2_r += tl.sum(tl.where(m_b, n_b * d_r * d_r, 0.0), 0)
        m2_e += tl.sum(tl.where(m_b, n_b * d_e * d_e, 0.0), 0)
    var_r, var_e = m2_r / n_1, m2_e / n_1
    ev = tl.where(var_r <= 0, 0.0, 1.0 - var_e / tl.where(var_r <= 0, 1.0, var_r))  # a NaN var_r gives NaN
    inv = tl.where(s_n > 0, 1.0 / tl.where(s_n > 0, s_n, 1.0), 0.0)
    o1 = tl.arange(0, 1)
    tl.store(loss_out + o1, s_loss.to(tl.float32))
    tl.store(metrics_out + o1, (s_clip * inv).to(tl.float32))
    tl.store(metrics_out + 1 + o1, (s_v * inv).to(tl.float32))
    tl.store(metrics_out + 2 + o1, ev.to(tl.float32))


@triton.jit
def value_terms(b_v, b_r, old, o_t, m_t, eps, USE_CLIP: tl.constexpr):
    """float32 loss, d loss / d v and clipped flag of tokens o_t [n] (m_t: in range) with values b_v and returns
    b_r; the float64 ones rounded where the loss is finite."""
    b_e1 = b_v - b_r
    b_q1 = b_e1 * b_e1
    if USE_CLIP:
        b_old = tl.load(old + o_t, mask=m_t, other=0.0).to(tl.float32)
        b_d = b_v - b_old
        # v_clip - R: e1 itself inside the clip range (old + (v - old) may round away from v and fake
        # a clip), else (old - R) +- eps, rounded once relative to the result (csrc/common/ppo_math.h)
        b_out = (b_old - b_r) + tl.where(b_d < 0.0, -eps, eps)
        # a NaN d (NaN old value) takes b_out, NaN too; the max keeps a NaN of either side
        b_e2 = tl.where((b_d >= -eps) & (b_d <= eps), b_e1, b_out)
        b_q2 = b_e2 * b_e2
        b_clip = b_q2 > b_q1
        return 0.5 * tl.where(b_clip | (b_q2 != b_q2), b_q2, b_q1), tl.where(b_clip, 0.0, b_e1), b_clip
    else:
        return 0.5 * b_q1, b_e1, b_q1 < 0.0  # clipped: all false


@triton.jit
def value_block_f64(v, old, ret, mask, cu, scale, grad, i_b, T, S, n_iter, eps, eps_e, USE_CLIP: tl.constexpr,
                    PER_SEG: tl.constexpr, NEED_GRAD: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr):
    """Block i_b's loss again, SUB tokens at a time (few float64 values live), after its float32 loss sum was not
    finite: a trainable token whose float32 loss is not finite is done in float64 with the reference's
    arithmetic (csrc/cpu/value_loss.cpp `value_chunk_f64`): its loss and the gradient autograd forms, term by
    term (a branch not taken passes 0 on, which times an infinite factor is NaN), NaN where the loss is NaN;
    the other tokens keep their float32 terms. Writes the gradient; returns the block's float64 loss sum and
    clipped count, and the sums and squared deviations of the values, returns and e = R - v in float64 (a
    second pass around the block's means)."""
    # the float32 pass's gradient stores (other threads, other layout) land before this pass's stores at the
    # same tokens: the branch is block-uniform, so every thread reaches the barrier
    tl.debug_barrier()
    a_loss = tl.zeros([SUB], tl.float64)
    a_v, a_r = a_loss, a_loss
    a_clip = tl.zeros([SUB], tl.float32)
    a_n = a_clip
    for j in range(0, BT, SUB):
        o_t = i_b * BT + j + tl.arange(0, SUB)
        m_t = o_t < T
        # [SUB]
        b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG)
        b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
        b_v = tl.load(v + o_t, mask=m_t, other=0.0)
        b_r = tl.load(ret + o_t, mask=m_t, other=0.0)
        b_l, b_g, b_clip = value_terms(b_v.to(tl.float32), b_r.to(tl.float32), old, o_t, m_t, eps, USE_CLIP)
        b_bad = b_m & ~finite(b_l)
        b_v = b_v.to(tl.float64)
        b_r = b_r.to(tl.float64)
        b_e1 = b_v - b_r
        b_q1 = b_e1 * b_e1
        b_gq = b_w * 0.5
        if USE_CLIP:
            eps64 = f64(eps, eps_e)
            b_old = tl.load(old + o_t, mask=m_t, other=0.0).to(tl.float64)
            b_d = b_v - b_old
            b_in = tl.abs(b_d) <= eps64
            b_vc = b_old + tl.where(b_d < -eps64, -eps64, tl.where(b_d > eps64, eps64, b_d))  # a NaN d stays NaN
            b_e2 = tl.where(b_in, b_v, b_vc) - b_r
            b_q2 = b_e2 * b_e2
            b_clip64 = b_q2 > b_q1
            b_take2 = b_clip64 | (b_q2 != b_q2)
            b_l64 = 0.5 * tl.where(b_take2, b_q2, b_q1)
            b_g64 = tl.where(b_take2, 0.0, b_gq) * (2.0 * b_e1)
            b_g64 += tl.where(b_in, tl.where(b_take2, b_gq, 0.0) * (2.0 * b_e2), 0.0)
        else:
            b_clip64 = b_clip
            b_l64 = 0.5 * b_q1
            b_g64 = b_gq * (2.0 * b_e1)
        if NEED_GRAD:
            b_gw = tl.where(b_l64 != b_l64, b_l64, b_g64).to(tl.float32)
            tl.store(grad + o_t, tl.where(b_bad, b_gw, tl.where(b_m, b_g * b_w.to(tl.float32), 0.0)), mask=m_t)
        a_loss += tl.where(b_bad, b_l64, tl.where(b_m, b_l, 0.0).to(tl.float64)) * b_w
        a_clip += (b_m & tl.where(b_bad, b_clip64, b_clip)).to(tl.float32)
        a_n += b_m.to(tl.float32)
        a_v += tl.where(b_m, b_v, 0.0)
        a_r += tl.where(b_m, b_r, 0.0)
    sum_v, sum_r = tl.sum(a_v, 0), tl.sum(a_r, 0)
    inv_n = recip64(tl.maximum(tl.sum(a_n, 0), 1.0))
    mean_r, mean_e = sum_r * inv_n, (sum_r - sum_v) * inv_n
    a_r2 = tl.zeros([SUB], tl.float64)
    a_e2 = a_r2
    for j in range(0, BT, SUB):
        o_t = i_b * BT + j + tl.arange(0, SUB)
        m_t = o_t < T
        b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
        b_r = tl.load(ret + o_t, mask=m_t, other=0.0).to(tl.float64)
        b_dr = tl.where(b_m, b_r - mean_r, 0.0)
        b_de = tl.where(b_m, (b_r - tl.load(v + o_t, mask=m_t, other=0.0).to(tl.float64)) - mean_e, 0.0)
        a_r2 += b_dr * b_dr
        a_e2 += b_de * b_de
    return tl.sum(a_loss, 0), tl.sum(a_clip, 0), sum_v, sum_r, tl.sum(a_r2, 0), sum_r - sum_v, tl.sum(a_e2, 0)


@triton.jit
def recip64(n):
    """1 / n in float64 for a float32 n >= 1, to ~1 ulp: the float32 reciprocal and two Newton steps. A float64
    division is a subroutine call in SASS, and two more of them put this kernel at the edge of spilling."""
    r = (1.0 / n).to(tl.float64)
    r = r + r * (1.0 - n * r)
    return r + r * (1.0 - n * r)


@triton.jit(do_not_specialize=["T", "S", "n_iter"])
def value_loss_fwd_kernel(v, old, ret, mask, cu, scale, grad, part, ticket, loss_out, metrics_out, T, S, n_iter, eps,
                          eps_e, USE_CLIP: tl.constexpr, PER_SEG: tl.constexpr, NEED_GRAD: tl.constexpr,
                          BT: tl.constexpr, FB: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = i_b * BT + tl.arange(0, BT)
    m_t = o_t < T
    # [BT]; the weight first: few values are live across its search loop (no spills)
    b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG).to(tl.float32)
    b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
    b_v = tl.load(v + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_r = tl.load(ret + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_l, b_g, b_clip = value_terms(b_v, b_r, old, o_t, m_t, eps, USE_CLIP)
    # the float32 pass complete before the branch (only scalars stay live across it); tl.where, not a multiply
    # by the mask: masked positions may hold inf/NaN
    if NEED_GRAD:
        tl.store(grad + o_t, tl.where(b_m, b_g * b_w, 0.0), mask=m_t)
    n = tl.sum(b_m.to(tl.float32), 0)
    s_loss = tl.sum(tl.where(b_m, b_l * b_w, 0.0), 0).to(tl.float64)
    s_clip = tl.sum((b_m & b_clip).to(tl.float32), 0)
    b_e = b_r - b_v
    sum_v = tl.sum(tl.where(b_m, b_v, 0.0), 0)
    sum_r = tl.sum(tl.where(b_m, b_r, 0.0), 0)
    sum_e = tl.sum(tl.where(b_m, b_e, 0.0), 0)
    b_dr = tl.where(b_m, b_r - sum_r / tl.maximum(n, 1.0), 0.0)
    b_de = tl.where(b_m, b_e - sum_e / tl.maximum(n, 1.0), 0.0)
    m2_r = tl.sum(b_dr * b_dr, 0)
    m2_e = tl.sum(b_de * b_de, 0)
    sum_v, sum_r, sum_e = sum_v.to(tl.float64), sum_r.to(tl.float64), sum_e.to(tl.float64)
    m2_r, m2_e = m2_r.to(tl.float64), m2_e.to(tl.float64)
    # a loss term, sum or square past float32 (returns ~1e20) or NaN: the block again, partly in float64
    if ~finite(s_loss + sum_v + sum_r + sum_e + m2_r + m2_e):
        s_loss, s_clip, sum_v, sum_r, m2_r, sum_e, m2_e = value_block_f64(
            v, old, ret, mask, cu, scale, grad, i_b, T, S, n_iter, eps, eps_e, USE_CLIP, PER_SEG, NEED_GRAD, BT,
            BT // 4)  # a token per thread at BT = 1024 and 8 warps
    p_part = part + i_b * 8
    tl.store(p_part + 0, s_loss)
    tl.store(p_part + 1, n.to(tl.float64))
    tl.store(p_part + 2, s_clip.to(tl.float64))
    tl.store(p_part + 3, sum_v)
    tl.store(p_part + 4, sum_r)
    tl.store(p_part + 5, m2_r)
    tl.store(p_part + 6, sum_e)
    tl.store(p_part + 7, m2_e)
    if last_program(ticket):
        value_finish(part, tl.num_programs(0), loss_out, metrics_out, FB)


def value_loss_fwd(values, old_values, returns, loss_mask, cu_seqlens, seg_scale, clip, need_grad, BT=1024):
    """Fused forward, one launch. Tensors: float32 [T], bool [T], cu_seqlens [S+1] or None, seg_scale float64
    [S]; clip < 0 switches the clip off. Returns (loss float32 [], metrics float32 [3] (clip_fraction,
    value_mean, explained_variance), grad float32 [T] (or [0] without need_grad))."""
    T, device = values.numel(), values.device
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if S < 1 and T > 0:  # a shape check: the kernel would read seg_scale[0] of []
        raise ValueError(f"cu_seqlens must have at least 2 elements when T > 0, got {S + 1}")
    n_blocks = triton.cdiv(T, BT)
    grad = empty(T if need_grad else 0, device=device)
    if n_blocks == 0:  # no tokens: loss and metrics 0
        return torch.zeros((), device=device), torch.zeros(3, device=device), grad
    loss, metrics = empty((), device=device), empty(3, device=device)
    part = empty(n_blocks, N_PARTS, dtype=torch.float64, device=device)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    with device_guard(values):
        value_loss_fwd_kernel[(n_blocks,)](
            values, old_values, returns, loss_mask, seg_scale if cu_seqlens is None else cu_seqlens, seg_scale,
            grad, part, ticket, loss, metrics, T, S, search_steps(S), *split64(max(clip, 0.0)), USE_CLIP=clip >= 0,
            PER_SEG=S > 1, NEED_GRAD=need_grad, BT=BT, FB=FINISH_BLOCKS, num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return loss, metrics, grad


# What tests/test_aot.py compiles: every feature-flag combination that matters, both index dtypes.
def _aot_sig(idx):
    return {"v": "*fp32", "old": "*fp32", "ret": "*fp32", "mask": "*i1", "cu": f"*{idx}", "scale": "*fp64",
            "grad": "*fp32", "part": "*fp64", "ticket": "*i32", "loss_out": "*fp32", "metrics_out": "*fp32",
            "T": "i32", "S": "i32", "n_iter": "i32", "eps": "fp32", "eps_e": "fp32", "USE_CLIP": "constexpr",
            "PER_SEG": "constexpr", "NEED_GRAD": "constexpr", "BT": "constexpr", "FB": "constexpr"}


AOT = [("value_loss_fwd_kernel", _aot_sig(idx),
        {"USE_CLIP": clip, "PER_SEG": per_seg, "NEED_GRAD": True, "BT": 1024, "FB": FINISH_BLOCKS},
        {"num_warps": NUM_WARPS, "maxnreg": MAXNREG})
       for idx, clip, per_seg in [("i32", True, False), ("i32", False, True), ("i64", True, True)]]
