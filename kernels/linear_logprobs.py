"""Triton kernels for `linear_logprobs`: the per-chunk softmax work of the chunk loop.

The op (compactionrl_fast/ops/linear_logprobs.py) multiplies one token chunk at a time with cuBLAS,
`x = hidden_c @ W.T + b` into a [C, V] buffer, then calls (z = x / temperature, scaled in fp32):

- `linear_logprobs_stats`: one program per BT rows (BT = 1 for an LM vocabulary), an online
  log-sum-exp over vocabulary tiles that also carries sum(p * (z - max)) for the entropy; gathers the
  target logit. Writes lse, logp, entropy [C].
- `linear_logprobs_dlogits`: one program per (BT rows, vocabulary tile); overwrites the buffer in place
  with dL/dz = g_lp * (onehot - p) - g_ent * p * (log p + H), the gradient of both outputs.

Why a chunk loop around cuBLAS rather than one fully tiled Triton kernel (matmul + online lse): the
matmuls are >90% of the FLOPs and cuBLAS runs them near peak for any shape; the [C, V] buffer costs a
few extra passes over C * V elements, small next to the 2 * C * V * H matmul FLOPs at H >= 1024.

Logits may be bf16/fp16/fp32; every value is cast to float32 right after the load.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard

TILE = 2048  # elements per [BT, BV] block: 16 fp32 lanes per thread per accumulator at 4 warps
# finite "minus infinity" for the running max (float32's lowest): keeps every difference finite or -inf,
# never NaN, and stays below any finite logit (at temperature 1e-30 logits reach -1e31)
NEG = tl.constexpr(-3.4028234663852886e38)


def tile_shape(V, tile=TILE):
    """(BT, BV): rows x vocabulary columns of one block. Large vocabularies take one row per program; a
    small one packs several rows into a block so that programs stay busy."""
    bv = min(tile, triton.next_power_of_2(V))
    return max(1, min(16, tile // bv)), bv


@triton.jit
def linear_logprobs_stats_kernel(x_ptr, stride_x, y_ptr, lse_ptr, logp_ptr, ent_ptr, C, V, inv_t,
                                 BT: tl.constexpr, BV: tl.constexpr, ENTROPY: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < C
    o_v = tl.arange(0, BV)
    # per-lane running max, sum of exp(z - m) and sum of exp(z - m) * (z - m); combined at the end
    b_m = tl.full([BT, BV], NEG, tl.float32)
    b_s = tl.zeros([BT, BV], tl.float32)
    b_w = tl.zeros([BT, BV], tl.float32)
    for v0 in range(0, V, BV):
        m_x = m_t[:, None] & (v0 + o_v < V)[None, :]
        # [BT, BV]
        b_z = tl.load(x_ptr + o_t[:, None] * stride_x + (v0 + o_v)[None, :], mask=m_x, other=0.0)
        b_z = tl.where(m_x, b_z.to(tl.float32) * inv_t, float("-inf"))
        b_mn = tl.maximum(b_m, b_z)
        b_d = b_m - b_mn  # <= 0 and finite
        b_a = tl.exp(b_d)
        b_e = tl.exp(b_z - b_mn)
        if ENTROPY:
            # a -inf logit (or a masked lane) has p = 0; its p * log p term is 0, not 0 * -inf
            # b_d may be -inf (NEG minus a large logit) where nothing was summed yet: b_s = 0 there
            b_w = b_a * (b_w + tl.where(b_s > 0, b_s * b_d, 0.0)) + b_e * tl.where(b_e > 0, b_z - b_mn, 0.0)
        b_s = b_a * b_s + b_e
        b_m = b_mn
    # [BT]
    b_mx = tl.max(b_m, 1)
    b_sc = tl.exp(b_m - b_mx[:, None])
    b_sum = tl.where(m_t, tl.sum(b_s * b_sc, 1), 1.0)  # rows past C: no log(0) or 0 / 0
    b_lse = b_mx + tl.log(b_sum)
    b_y = tl.load(y_ptr + o_t, mask=m_t, other=0).to(tl.int64)
    # an out-of-range target (unchecked on CUDA) reads nothing and gives logp NaN
    b_ok = (b_y >= 0) & (b_y < V)
    b_zy = tl.load(x_ptr + o_t * stride_x + b_y, mask=m_t & b_ok, other=float("nan")).to(tl.float32) * inv_t
    tl.store(lse_ptr + o_t, b_lse, mask=m_t)
    tl.store(logp_ptr + o_t, b_zy - b_lse, mask=m_t)
    if ENTROPY:
        b_wsum = tl.sum(b_sc * (b_w + tl.where(b_s > 0, b_s * (b_m - b_mx[:, None]), 0.0)), 1)
        # H = lse - E[z] = log s - E[z - m]: no cancellation against a large lse
        tl.store(ent_ptr + o_t, tl.log(b_sum) - b_wsum / b_sum, mask=m_t)


@triton.jit
def linear_logprobs_dlogits_kernel(x_ptr, stride_x, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, C, V, inv_t,
                                   BT: tl.constexpr, BV: tl.constexpr, ENTROPY: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < C
    m_x = m_t[:, None] & (o_v < V)[None, :]
    p_x = x_ptr + o_t[:, None] * stride_x + o_v[None, :]
    # [BT]
    b_lse = tl.load(lse_ptr + o_t, mask=m_t, other=0.0)
    b_glp = tl.load(glp_ptr + o_t, mask=m_t, other=0.0)
    b_y = tl.load(y_ptr + o_t, mask=m_t, other=-1)
    # [BT, BV]
    b_lp = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32) * inv_t - b_lse[:, None]
    b_p = tl.exp(b_lp)
    b_g = -b_glp[:, None] * b_p
    if ENTROPY:
        b_h = tl.load(ent_ptr + o_t, mask=m_t, other=0.0)
        b_gent = tl.load(gent_ptr + o_t, mask=m_t, other=0.0)
        b_g -= b_gent[:, None] * b_p * tl.where(b_p > 0, b_lp + b_h[:, None], 0.0)
    b_g = tl.where(o_v[None, :] == b_y[:, None], b_g + b_glp[:, None], b_g)
    tl.store(p_x, b_g.to(x_ptr.dtype.element_ty), mask=m_x)


def linear_logprobs_stats(x, targets, lse, logp, ent, inv_t=1.0, tile=TILE):
    """Row statistics of a logits chunk, written into lse, logp, ent ([C] fp32; ent None skips the entropy).

    Args:
        x: [C, V] bf16/fp16/fp32 logits before the temperature (row stride may exceed V); targets: [C] int64.
        lse: log-sum-exp of z = x * inv_t (scaled in fp32, after the load); logp: z[target] - lse;
        ent: -sum p log p.
    """
    C, V = x.shape
    want_entropy = ent is not None
    if C:
        BT, BV = tile_shape(V, tile)
        with device_guard(x):
            linear_logprobs_stats_kernel[(triton.cdiv(C, BT),)](x, x.stride(0), targets, lse, logp,
                                                                ent if want_entropy else lse, C, V, inv_t, BT=BT,
                                                                BV=BV, ENTROPY=want_entropy)


def linear_logprobs_dlogits(x, targets, lse, ent, g_lp, g_ent, inv_t=1.0, tile=TILE):
    """Overwrite the logits chunk x [C, V] (before the temperature: z = x * inv_t) in place with dL/dz.

    g_lp, g_ent: [C] fp32 upstream gradients of logp and entropy (g_ent None: logp only); lse, ent: [C]
    fp32 from the forward. Any 1/temperature factor is folded into g_lp and g_ent by the caller.
    """
    C, V = x.shape
    want_entropy = g_ent is not None
    if C:
        BT, BV = tile_shape(V, tile)
        grid = (triton.cdiv(C, BT), triton.cdiv(V, BV))
        with device_guard(x):
            linear_logprobs_dlogits_kernel[grid](x, x.stride(0), targets, lse, ent if want_entropy else lse, g_lp,
                                                 g_ent if want_entropy else g_lp, C, V, inv_t, BT=BT, BV=BV,
                                                 ENTROPY=want_entropy)
    return x


# What tests/test_aot.py compiles: both kernels, fp32 and bf16 logits, with and without the entropy, at the
# launchers' block shapes for an LM vocabulary (one row per program) and a small one.
def _aot_sig(kernel, x_dtype):
    sig = {}
    for name in kernel.arg_names:
        if name in ("BT", "BV", "ENTROPY"):
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = {"x_ptr": f"*{x_dtype}", "y_ptr": "*i64"}.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name == "inv_t" else "i32"
    return sig


AOT = [(kernel.__name__, _aot_sig(kernel, dt), {"BT": bt, "BV": bv, "ENTROPY": ent})
       for kernel in (linear_logprobs_stats_kernel, linear_logprobs_dlogits_kernel)
       for dt in ("fp32", "bf16")
       for ent in (False, True)
       for bt, bv in (tile_shape(151936), tile_shape(300))]
