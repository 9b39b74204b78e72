"""Triton kernels of `value_loss` (docs/ops.md): one fused pass writes the per-token gradient (times
its reduction weight) and per-block partials of the loss and the metrics; a second tiny pass combines the
partials in block order (no float atomics, bitwise deterministic).

The explained variance is combined from per-block (count, sum, sum of squared deviations from the block
mean) (Chan et al.), so a large mean of the returns does not cancel the variance away.
Launchers here have no autograd; compactionrl_fast/ops/value_loss.py wraps them in a custom op.
"""
import torch
import triton
import triton.language as tl

from compactionrl_fast.ops._alloc import empty

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)

from .ppo_loss import search_steps, segment_scale

N_PARTS = 8  # loss, tokens, clipped, sum_v, sum_r, m2_r, sum_e, m2_e  (e = returns - values)


@triton.jit(do_not_specialize=["T", "S", "n_iter"])
def value_loss_fwd_kernel(v, old, ret, mask, cu, scale, grad, part, T, S, n_iter, eps, USE_CLIP: tl.constexpr,
                          PER_SEG: tl.constexpr, NEED_GRAD: tl.constexpr, BT: tl.constexpr):
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
        b_g = tl.where(b_clip, 0.0, b_e1)
    else:
        b_clip = b_q1 < 0.0  # all false
        b_l = 0.5 * b_q1
        b_g = b_e1
    b_w = segment_scale(o_t, cu, scale, S, n_iter, PER_SEG)
    if NEED_GRAD:
        tl.store(grad + o_t, tl.where(b_m, b_g * b_w, 0.0), mask=m_t)
    # tl.where, not a multiply by the mask: masked positions may hold inf/NaN
    n = tl.sum(b_m.to(tl.float32), 0)
    b_e = b_r - b_v
    sum_r = tl.sum(tl.where(b_m, b_r, 0.0), 0)
    sum_e = tl.sum(tl.where(b_m, b_e, 0.0), 0)
    b_dr = tl.where(b_m, b_r - sum_r / tl.maximum(n, 1.0), 0.0)
    b_de = tl.where(b_m, b_e - sum_e / tl.maximum(n, 1.0), 0.0)
    p_part = part + i_b * 8
    tl.store(p_part + 0, tl.sum(tl.where(b_m, b_l * b_w, 0.0), 0))
    tl.store(p_part + 1, n)
    tl.store(p_part + 2, tl.sum((b_m & b_clip).to(tl.float32), 0))
    tl.store(p_part + 3, tl.sum(tl.where(b_m, b_v, 0.0), 0))
    tl.store(p_part + 4, sum_r)
    tl.store(p_part + 5, tl.sum(b_dr * b_dr, 0))
    tl.store(p_part + 6, sum_e)
    tl.store(p_part + 7, tl.sum(b_de * b_de, 0))


def value_loss_fwd(values, old_values, returns, loss_mask, cu_seqlens, seg_scale, clip, need_grad, BT=1024):
    """Fused forward. Tensors: float32 [T], bool [T], cu_seqlens [S+1] or None, seg_scale float64 [S];
    clip < 0 switches the clip off. Returns (loss float32 [], metrics float32 [3] (clip_fraction,
    value_mean, explained_variance), grad float32 [T] (or [0] without need_grad))."""
    T, device = values.numel(), values.device
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if S < 1 and T > 0:  # a shape check: the kernel would read seg_scale[0] of []
        raise ValueError(f"cu_seqlens must have at least 2 elements when T > 0, got {S + 1}")
    n_blocks = triton.cdiv(T, BT)
    grad = empty(T if need_grad else 0, device=device)
    part = empty(n_blocks, N_PARTS, device=device)
    if n_blocks:
        value_loss_fwd_kernel[(n_blocks,)](
            values, old_values, returns, loss_mask, seg_scale if cu_seqlens is None else cu_seqlens, seg_scale,
            grad, part, T, S, search_steps(S), max(clip, 0.0), USE_CLIP=clip >= 0, PER_SEG=S > 1,
            NEED_GRAD=need_grad, BT=BT)
    return (*reduce_partials(part), grad)


def _combine(n, s, m2):
    """Population variance of the union of blocks with counts n, sums s and squared deviations m2 [B]."""
    N = n.sum()
    mean = s.sum() / N.clamp(min=1.0)
    mean_b = s / n.clamp(min=1.0)
    return (m2.sum() + (n * (mean_b - mean) ** 2).sum()) / N.clamp(min=1.0)


def reduce_partials(part):
    """The second pass: combine the [n_blocks, 8] partials in block order (float64)."""
    p = part.double()
    tot = p.sum(0)
    n = tot[1]
    inv = torch.where(n > 0, 1.0 / torch.where(n > 0, n, 1.0), 0.0)
    var_r = _combine(p[:, 1], p[:, 4], p[:, 5])
    var_e = _combine(p[:, 1], p[:, 6], p[:, 7])
    ev = torch.where(var_r <= 0, 0.0, 1.0 - var_e / torch.where(var_r <= 0, 1.0, var_r))  # NaN stays NaN
    metrics = torch.stack([tot[2] * inv, tot[3] * inv, ev]).float()
    return tot[0].float(), metrics


def _aot_sig(idx):
    return {"v": "*fp32", "old": "*fp32", "ret": "*fp32", "mask": "*i1", "cu": f"*{idx}", "scale": "*fp64",
            "grad": "*fp32", "part": "*fp32", "T": "i32", "S": "i32", "n_iter": "i32", "eps": "fp32",
            "USE_CLIP": "constexpr", "PER_SEG": "constexpr", "NEED_GRAD": "constexpr", "BT": "constexpr"}


# What tests/test_aot.py compiles for sm_80/sm_90.
AOT_SPECS = [
    ("value_loss_fwd_kernel", _aot_sig(idx), {"USE_CLIP": clip, "PER_SEG": per_seg, "NEED_GRAD": True, "BT": 1024})
    for idx, clip, per_seg in [("i32", True, False), ("i32", False, True), ("i64", True, True)]
]
