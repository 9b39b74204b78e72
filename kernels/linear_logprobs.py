"""Triton kernels for `linear_logprobs`: the per-chunk softmax work of the chunk loop.

The op (compactionrl_fast/ops/linear_logprobs.py) multiplies one token chunk at a time with cuBLAS,
`z = (hidden_c @ W.T + b) / temperature` into a [C, V] buffer, then calls:

- `linear_logprobs_stats`: one program per row, an online log-sum-exp over vocabulary tiles that also
  carries sum(p * (z - max)) for the entropy; gathers the target logit. Writes lse, logp, entropy [C].
- `linear_logprobs_dlogits`: one program per (row, vocabulary tile); overwrites the buffer in place
  with dL/dz = g_lp * (onehot - p) - g_ent * p * (log p + H), the gradient of both outputs.

Logits may be bf16/fp16/fp32; every value is cast to float32 right after the load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

STATS_BV = 2048  # vocabulary tile of the row loop: 16 fp32 lanes per thread per accumulator at 4 warps
DLOGITS_BV = 2048
NEG = tl.constexpr(-1e30)  # finite "minus infinity" for the running max: keeps every difference finite (no inf - inf)


@triton.jit
def linear_logprobs_stats_kernel(x_ptr, stride_x, y_ptr, lse_ptr, logp_ptr, ent_ptr, V,
                                 BV: tl.constexpr, ENTROPY: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    p_x = x_ptr + i_t * stride_x
    o_v = tl.arange(0, BV)
    # per-lane running max, sum of exp(z - m) and sum of exp(z - m) * (z - m); combined at the end
    b_m = tl.full([BV], NEG, tl.float32)
    b_s = tl.zeros([BV], tl.float32)
    b_w = tl.zeros([BV], tl.float32)
    for v0 in range(0, V, BV):
        m_v = v0 + o_v < V
        # [BV]
        b_z = tl.load(p_x + v0 + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_z = tl.where(m_v, b_z, float("-inf"))
        b_mn = tl.maximum(b_m, b_z)
        b_d = b_m - b_mn  # <= 0 and finite
        b_a = tl.exp(b_d)
        b_e = tl.exp(b_z - b_mn)
        if ENTROPY:
            # a -inf logit (or a masked lane) has p = 0; its p * log p term is 0, not 0 * -inf
            b_w = b_a * (b_w + b_s * b_d) + b_e * tl.where(b_e > 0, b_z - b_mn, 0.0)
        b_s = b_a * b_s + b_e
        b_m = b_mn
    m = tl.max(b_m, 0)
    b_sc = tl.exp(b_m - m)
    s = tl.sum(b_s * b_sc, 0)
    lse = m + tl.log(s)
    y = tl.load(y_ptr + i_t).to(tl.int64)
    z_y = tl.load(p_x + y).to(tl.float32)
    tl.store(lse_ptr + i_t, lse)
    tl.store(logp_ptr + i_t, z_y - lse)
    if ENTROPY:
        w = tl.sum(b_sc * (b_w + b_s * (b_m - m)), 0)
        # H = lse - E[z] = log s - E[z - m]
        tl.store(ent_ptr + i_t, tl.log(s) - w / s)


@triton.jit
def linear_logprobs_dlogits_kernel(x_ptr, stride_x, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, V,
                                   BV: tl.constexpr, ENTROPY: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_x = x_ptr + i_t * stride_x + o_v
    lse = tl.load(lse_ptr + i_t)
    g_lp = tl.load(glp_ptr + i_t)
    y = tl.load(y_ptr + i_t)
    # [BV]
    b_z = tl.load(p_x, mask=m_v, other=0.0).to(tl.float32)
    b_lp = b_z - lse
    b_p = tl.exp(b_lp)
    b_g = -g_lp * b_p
    if ENTROPY:
        H = tl.load(ent_ptr + i_t)
        g_ent = tl.load(gent_ptr + i_t)
        b_g -= g_ent * b_p * tl.where(b_p > 0, b_lp + H, 0.0)
    b_g = tl.where(o_v == y, b_g + g_lp, b_g)
    tl.store(p_x, b_g.to(x_ptr.dtype.element_ty), mask=m_v)


def linear_logprobs_stats(x, targets, lse, logp, ent, block_v=STATS_BV):
    """Row statistics of a logits chunk, written into lse, logp, ent ([C] fp32; ent None skips the entropy).

    Args:
        x: [C, V] bf16/fp16/fp32 scaled logits z (row stride may exceed V); targets: [C] int64.
        lse: log-sum-exp of z; logp: z[target] - lse; ent: -sum p log p.
    """
    C, V = x.shape
    want_entropy = ent is not None
    if C:
        linear_logprobs_stats_kernel[(C,)](x, x.stride(0), targets, lse, logp, ent if want_entropy else lse, V,
                                           BV=block_v, ENTROPY=want_entropy)


def linear_logprobs_dlogits(x, targets, lse, ent, g_lp, g_ent, block_v=DLOGITS_BV):
    """Overwrite the logits chunk x [C, V] in place with dL/dz.

    g_lp, g_ent: [C] fp32 upstream gradients of logp and entropy (g_ent None: logp only); lse, ent: [C]
    fp32 from the forward. Any 1/temperature factor is folded into g_lp and g_ent by the caller.
    """
    C, V = x.shape
    want_entropy = g_ent is not None
    if C:
        grid = (C, triton.cdiv(V, block_v))
        linear_logprobs_dlogits_kernel[grid](x, x.stride(0), targets, lse, ent if want_entropy else lse, g_lp,
                                             g_ent if want_entropy else g_lp, V, BV=block_v,
                                             ENTROPY=want_entropy)
    return x


def _sig(kernel, x_dtype):
    ptrs = {"x_ptr": f"*{x_dtype}", "y_ptr": "*i64"}
    sig = {}
    for name in kernel.arg_names:
        if name in ("BV", "ENTROPY"):
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptrs.get(name, "*fp32")
        else:
            sig[name] = "i32"
    return sig


# Ahead-of-time compile list (tests/test_aot.py): both kernels, fp32 and bf16 logits, with and without
# the entropy, at the launchers' tile sizes.
AOT_SPECS = [
    (name, _sig(globals()[name], dt), {"BV": bv, "ENTROPY": ent})
    for name, bv in (("linear_logprobs_stats_kernel", STATS_BV), ("linear_logprobs_dlogits_kernel", DLOGITS_BV))
    for dt in ("fp32", "bf16")
    for ent in (False, True)
]
