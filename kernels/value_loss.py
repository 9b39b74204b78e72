"""Triton kernels of `value_loss` (docs/ops.md): one fused pass writes the per-token gradient (times
its reduction weight) and per-block partials of the loss and the metrics; the program that finishes last
combines the partials in a fixed order in float64 and writes the loss and the metrics (no float atomics,
bitwise deterministic, one launch; see `last_program` in kernels/ppo_loss.py).

The explained variance is combined from per-block (count, sum, sum of squared deviations from the block
mean) (Chan et al.), so a large mean of the returns does not cancel the variance away.
The launcher runs on its tensors' device and has no autograd; compactionrl_fast/ops/value_loss.py registers it as
a custom op.
"""
import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard, empty

from .ppo_loss import FINISH_BLOCKS, last_program, load_col, search_steps, segment_scale, weight_scale

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


@triton.jit(do_not_specialize=["T", "S", "n_iter"])
def value_loss_fwd_kernel(v, old, ret, mask, cu, scale, grad, part, ticket, loss_out, metrics_out, T, S, n_iter, eps,
                          USE_CLIP: tl.constexpr, PER_SEG: tl.constexpr, NEED_GRAD: tl.constexpr, BT: tl.constexpr,
                          FB: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = i_b * BT + tl.arange(0, BT)
    m_t = o_t < T
    # [BT]
    b_m = tl.load(mask + o_t, mask=m_t, other=0) != 0
    b_v = tl.load(v + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_r = tl.load(ret + o_t, mask=m_t, other=0.0).to(tl.float32)
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
        b_l = 0.5 * tl.where(b_clip | (b_q2 != b_q2), b_q2, b_q1)
        # a NaN loss term gives a NaN gradient (docs/ops.md, "Non-finite input"), also for a NaN old value
        b_g = tl.where(b_q2 != b_q2, b_q2, tl.where(b_clip, 0.0, b_e1))
    else:
        b_clip = b_q1 < 0.0  # all false
        b_l = 0.5 * b_q1
        b_g = b_e1
    b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG)
    if NEED_GRAD:
        tl.store(grad + o_t, tl.where(b_m, weight_scale(b_g, b_w), 0.0), mask=m_t)
    # tl.where, not a multiply by the mask: masked positions may hold inf/NaN
    n = tl.sum(b_m.to(tl.float32), 0)
    b_e = b_r - b_v
    sum_r = tl.sum(tl.where(b_m, b_r, 0.0), 0)
    sum_e = tl.sum(tl.where(b_m, b_e, 0.0), 0)
    b_dr = tl.where(b_m, b_r - sum_r / tl.maximum(n, 1.0), 0.0)
    b_de = tl.where(b_m, b_e - sum_e / tl.maximum(n, 1.0), 0.0)
    p_part = part + i_b * 8
    tl.store(p_part + 0, tl.sum(tl.where(b_m, weight_scale(b_l, b_w), 0.0), 0))
    tl.store(p_part + 1, n)
    tl.store(p_part + 2, tl.sum((b_m & b_clip).to(tl.float32), 0))
    tl.store(p_part + 3, tl.sum(tl.where(b_m, b_v, 0.0), 0))
    tl.store(p_part + 4, sum_r)
    tl.store(p_part + 5, tl.sum(b_dr * b_dr, 0))
    tl.store(p_part + 6, sum_e)
    tl.store(p_part + 7, tl.sum(b_de * b_de, 0))
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
    part = empty(n_blocks, N_PARTS, device=device)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    with device_guard(values):
        value_loss_fwd_kernel[(n_blocks,)](
            values, old_values, returns, loss_mask, seg_scale if cu_seqlens is None else cu_seqlens, seg_scale,
            grad, part, ticket, loss, metrics, T, S, search_steps(S), max(clip, 0.0), USE_CLIP=clip >= 0,
            PER_SEG=S > 1, NEED_GRAD=need_grad, BT=BT, FB=FINISH_BLOCKS, num_warps=NUM_WARPS)
    return loss, metrics, grad
