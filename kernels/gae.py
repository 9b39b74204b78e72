"""Triton kernels for `segment_gae` (docs/ops.md): segmented reverse GAE over packed rollouts.

Every token acts on the state carried backwards, (a, v, ac) = A and V of the nearest later trainable
token and A of the returns' recurrence, as an affine map (the math of csrc/common/gae_step.h):
  trainable t:  a' = gl*a + gamma*v + (r_t - V_t),  v' = V_t,  ac' = glc*ac + gamma*v + (r_t - V_t);
  masked t:     the identity;  the last token of a segment where the recurrence stops (every segment
  end for "none"/"paper", rollout ends for "stitched"): the zero map first, then its own map.
with gl = gamma*lam_s, glc = gamma*lam_critic (or gl). A token range is the composition of its maps
(`_compose`), so the recurrence splits into independent pieces. A map also carries a flag f = 1 when the
recurrence stops inside its range: composing after it, or applying it to a carry, then selects instead of
multiplying by its zero coefficients, so a NaN or inf of a later recurrence never leaks into an earlier one
(0 * NaN), as in the C++ scan.

The token range [0, T) is cut into chunks and chunks into BLOCK-token blocks; both may span segments
and rollouts (each lane finds its segment by bisection over `cu_seqlens`). A block is loaded in
reversed token order so that a forward `tl.associative_scan` composes the maps from the block's end
(upstream `reverse=True` has an open GPU correctness issue; it is not used). Two launch plans, each
params + at most 2 launches, with every size a Python int and every offset read (and clamped) in the kernels:
  * one chunk per rollout (enough rollouts to fill the GPU): one pass from a zero carry;
  * fixed chunks of `chunk` tokens (few long rollouts): pass 1 stores each chunk's composed map (no
    writes); pass 2 composes the maps of the later chunks, up to the first one where the recurrence stops,
    into the chunk's carry-in, reruns the chunk from it and writes adv and ret.
Per-segment numbers (lambda, the paper's (gamma*lam)^N_later, reset flags) come from `_gae_params_kernel`,
one program per rollout (counts included), into [4, S] float64 arrays that the scan reads; no mode enum
reaches the scan and nothing is read on the host. Offsets are never trusted: every kernel clamps what it
reads to [0, T] / [0, S] and bisects only inside [0, S), so bad offsets give wrong numbers, never a bad access.

Precision: a block's sums (rewards minus values, the carried values) and every output are float32, as in
the loops trainers run; the scan's coefficients (products of gamma*lam_s) and everything that crosses
blocks (the carry, a chunk's or a tile's composed map, the per-segment numbers) are float64. A float32
scan forms the powers of gamma*lam by repeated squaring, which doubles their relative error at each
level: like a wrong last bit of gamma*lam, up to 3x the float32 loop's error (4K-token stitched rollouts,
adaptive lambda). The error stays within the accuracy rule of tests/ops/test_gae_accuracy.py.
"""
import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard, empty

ACC = tl.float64  # coefficients, and the maps and carries that cross blocks (see the module docstring)
TOK = tl.float32  # a block's sums and the outputs
LAM_CONST, LAM_ADAPTIVE_SEGMENT, LAM_ADAPTIVE_ROLLOUT, LAM_TENSOR = 0, 1, 2, 3  # as compactionrl_fast/ops/gae.py
CROSS_NONE, CROSS_PAPER, CROSS_STITCHED = 0, 1, 2
N_MAP = 9  # a chunk map: (xa, ya, pa, z, q, xc, yc, pc, f), see _compose


@triton.jit
def _compose(xa1, ya1, pa1, z1, q1, xc1, yc1, pc1, f1, xa2, ya2, pa2, z2, q2, xc2, yc2, pc2, f2):
    # A map sends the carry (a, v, ac) after a token range to the carry at its first token:
    #   a' = xa*a + ya*v + pa,  v' = z*v + q,  ac' = xc*ac + yc*v + pc;
    # f = 1: the recurrence stops inside the range (its coefficients are 0 and the carry is not read).
    # Map 2 (the earlier range) applied after map 1 (the later range). A stopping map 2 is kept as it is:
    # 0 * (a NaN of a later segment or rollout) would be NaN, and the C++ scan never multiplies there.
    # The coefficients x, y may be float64 and the sums p, q float32 (a block's scan, module docstring).
    k = f2 != 0
    t = pa2.dtype
    return (tl.where(k, xa2, xa2 * xa1), tl.where(k, ya2, xa2 * ya1 + ya2 * z1),
            tl.where(k, pa2, tl.cast(xa2, t) * pa1 + tl.cast(ya2, t) * q1 + pa2), tl.where(k, z2, z2 * z1),
            tl.where(k, q2, z2 * q1 + q2), tl.where(k, xc2, xc2 * xc1), tl.where(k, yc2, xc2 * yc1 + yc2 * z1),
            tl.where(k, pc2, tl.cast(xc2, t) * pc1 + tl.cast(yc2, t) * q1 + pc2), tl.maximum(f1, f2))


@triton.jit
def _compose_adv(xa1, ya1, pa1, z1, q1, f1, xa2, ya2, pa2, z2, q2, f2):
    # _compose without the returns' recurrence (lam_critic=None: returns reuse the advantages)
    k = f2 != 0
    t = pa2.dtype
    return (tl.where(k, xa2, xa2 * xa1), tl.where(k, ya2, xa2 * ya1 + ya2 * z1),
            tl.where(k, pa2, tl.cast(xa2, t) * pa1 + tl.cast(ya2, t) * q1 + pa2), tl.where(k, z2, z2 * z1),
            tl.where(k, q2, z2 * q1 + q2), tl.maximum(f1, f2))


@triton.jit
def _store_map(p, stride, xa, ya, pa, z, q, xc, yc, pc, f):
    """One map into column p of a float64 [N_MAP, n] buffer (row stride `stride`)."""
    tl.store(p, xa)
    tl.store(p + stride, ya)
    tl.store(p + 2 * stride, pa)
    tl.store(p + 3 * stride, z)
    tl.store(p + 4 * stride, q)
    tl.store(p + 5 * stride, xc)
    tl.store(p + 6 * stride, yc)
    tl.store(p + 7 * stride, pc)
    tl.store(p + 8 * stride, f)


@triton.jit
def _apply(f, x, y, p, c, v):
    """x*c + y*v + p, the carry (c, v) through a map; p alone when the map stops the recurrence (f = 1)."""
    return tl.where(f != 0, p, x * c + y * v + p)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _gae_params_kernel(mask_ptr, cu_ptr, cs_ptr, start_ptr, lam_ptr, out_ptr, S, T, gamma_hi, gamma_lo, lam_hi, lam_lo, alpha_hi,
                       alpha_lo, lamc_hi, lamc_lo, ws_ptr, n_ws, LAM_MODE: tl.constexpr, CROSS: tl.constexpr,
                       NEED_COUNTS: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr, ZERO_WS: tl.constexpr):
    """Per-segment numbers of rollout `program_id` (the Triton port of csrc/common/gae_step.h rollout_params):
    out [4, S] float64 rows gl = gamma*lam_s, glc (returns), scale ((gl)^N_later or 1), reset (1: nothing
    flows in from after the segment). The trainable counts are parked in the scale row until it is written.
    Float arguments come as float32 pairs hi + lo (Triton passes Python floats as float32; see `_split`).
    ZERO_WS: also zero ws int32 [n_ws] (the look-back plan's tile counter and flags), so that the plan needs no
    fill launch of its own; the look-back kernel runs after this one on the same stream."""
    gamma = tl.zeros([1], tl.float64) + gamma_hi + gamma_lo
    lam = tl.zeros([1], tl.float64) + lam_hi + lam_lo
    alpha = tl.zeros([1], tl.float64) + alpha_hi + alpha_lo
    lam_critic = tl.zeros([1], tl.float64) + lamc_hi + lamc_lo
    r = tl.program_id(0).to(tl.int64)
    o_1 = tl.arange(0, 1)
    # offsets are clamped where read: cs to [0, S], cu to [0, T] (unchecked offsets on CUDA)
    s0 = tl.minimum(tl.maximum(tl.load(cs_ptr + r).to(tl.int64), 0), S)
    s1 = tl.minimum(tl.maximum(tl.load(cs_ptr + r + 1).to(tl.int64), 0), S)
    end = tl.minimum(tl.maximum(tl.load(cu_ptr + s1).to(tl.int64), 0), T)  # the rollout's last token + 1
    o_b = tl.arange(0, BLOCK)
    if ZERO_WS:
        for b in range(r * BLOCK, n_ws, tl.num_programs(0) * BLOCK):
            tl.store(ws_ptr + b + o_b, tl.zeros([BLOCK], tl.int32), mask=b + o_b < n_ws)
    n_roll = tl.zeros([1], tl.int64)
    if NEED_COUNTS:
        for i in range(s1 - s0):
            lo, hi = tl.load(cu_ptr + s0 + i).to(tl.int64), tl.load(cu_ptr + s0 + i + 1).to(tl.int64)
            if HAS_START:  # the segment's tokens sit at start[s] (a padded row), not at cu[s]
                lo, hi = tl.load(start_ptr + s0 + i), tl.load(start_ptr + s0 + i) + (hi - lo)
            lo, hi = tl.minimum(tl.maximum(lo, 0), T), tl.minimum(tl.maximum(hi, 0), T)
            acc = tl.zeros([BLOCK], tl.int64)
            for j in range(tl.cdiv(hi - lo, BLOCK)):
                o_t = lo + j * BLOCK + o_b
                acc += tl.load(mask_ptr + o_t, mask=o_t < hi, other=0).to(tl.int64)
            n = tl.sum(acc, 0)
            tl.store(out_ptr + 2 * S + s0 + i + o_1, n.to(tl.float64) + tl.zeros([1], tl.float64))
            n_roll += n
    n_later = tl.zeros([1], tl.float64)
    for i in range(s1 - s0):
        s = s1 - 1 - i
        if NEED_COUNTS:
            n_s = tl.load(out_ptr + 2 * S + s + o_1)
        else:
            n_s = tl.zeros([1], tl.float64)
        if LAM_MODE == 0:  # LAM_CONST
            l_s = tl.zeros([1], tl.float64) + lam
        elif LAM_MODE == 3:  # LAM_TENSOR
            l_s = tl.load(lam_ptr + s + o_1).to(tl.float64)
        else:  # adaptive: 1 - 1/(alpha * max(n, 1)), clamped to [0, 1]
            n_a = n_roll.to(tl.float64) if LAM_MODE == 2 else n_s
            l_s = tl.minimum(tl.maximum(1.0 - 1.0 / (alpha * tl.maximum(n_a, 1.0)), 0.0), 1.0)
        gl = gamma * l_s
        glc = tl.where(lam_critic >= 0.0, gamma * lam_critic, gl)
        if CROSS == 1:  # paper: (gl)^N_later, 0^0 = 1
            scale = tl.where(n_later == 0.0, 1.0, tl.where(gl <= 0.0, 0.0, tl.exp(n_later * tl.log(tl.maximum(gl, 1e-300)))))
        else:
            scale = tl.zeros([1], tl.float64) + 1.0
        if CROSS == 2:  # stitched: the recurrence runs on unless no token of the rollout follows
            nxt = tl.minimum(tl.maximum(tl.load(cu_ptr + s + 1 + o_1).to(tl.int64), 0), T)
            reset = tl.where(nxt == end, 1.0, 0.0).to(tl.float64)
        else:
            reset = tl.zeros([1], tl.float64) + 1.0
        tl.store(out_ptr + s + o_1, gl)
        tl.store(out_ptr + S + s + o_1, glc)
        tl.store(out_ptr + 2 * S + s + o_1, scale)
        tl.store(out_ptr + 3 * S + s + o_1, reset)
        n_later += n_s


@triton.jit
def _segments_of(cu_ptr, lo, hi, S, LOG_S):
    """Segments s_lo, s_hi holding the tokens lo and hi - 1 of a range (the largest s in [0, S) with cu[s] <= t,
    by LOG_S >= bits(S - 1) bisection steps, so never outside [0, S) whatever cu holds), and n_bisect, the
    bits of s_hi - s_lo: the steps of `_tile_pass`'s per-token bisection. lo, hi: int64 scalars."""
    s_lo, s_lo_hi, s_hi, s_hi_hi = lo * 0, lo * 0 + S - 1, lo * 0, lo * 0 + S - 1
    for _ in range(LOG_S):
        mid = (s_lo + s_lo_hi + 1) // 2
        le = tl.load(cu_ptr + mid).to(tl.int64) <= lo
        s_lo, s_lo_hi = tl.where(le, mid, s_lo), tl.where(le, s_lo_hi, mid - 1)
        mid = (s_hi + s_hi_hi + 1) // 2
        le = tl.load(cu_ptr + mid).to(tl.int64) <= hi - 1
        s_hi, s_hi_hi = tl.where(le, mid, s_hi), tl.where(le, s_hi_hi, mid - 1)
    # in integers (a float log2 made triton 3.7 use stack)
    n_bisect = lo * 0
    w = s_hi - s_lo
    for _ in range(LOG_S):
        n_bisect += tl.where(w > 0, 1, 0)
        w = w // 2
    return s_lo, s_hi, n_bisect


@triton.jit
def _tile_pass(rew_ptr, val_ptr, mask_ptr, cu_ptr, start_ptr, T, gl_ptr, glc_ptr, scale_ptr, reset_ptr, adv_ptr, ret_ptr,
               lo, hi, s_lo, s_hi, n_bisect, gamma, a_c, v_c, ac_c,
               BLOCK: tl.constexpr, WRITE: tl.constexpr, OWN_CRITIC: tl.constexpr, HAS_START: tl.constexpr):
    """Tokens [lo, hi) backwards, BLOCK at a time; blocks may span segments s_lo..s_hi (n_bisect = bits of
    s_hi - s_lo). WRITE=False: returns the range's composed map (xa, ya, pa, z, q, xc, yc, pc, f), see `_compose`.
    WRITE=True: runs from the carry (a_c, v_c, ac_c) at hi and writes adv, ret."""
    o_b = tl.arange(0, BLOCK)
    # the scans' last lane holds the map of the whole block (lanes before the range are identities)
    i_last = tl.full([1], BLOCK - 1, tl.int32)
    one = tl.full([1], 1.0, ACC)
    m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc = one, one * 0, one * 0, one, one * 0, one, one * 0, one * 0
    m_f = one * 0
    for i_b in range((hi - lo + BLOCK - 1) // BLOCK):
        e = hi - i_b * BLOCK
        o_t = e - 1 - o_b  # reversed: lane 0 is the block's last token
        m_t = o_t >= lo
        # segment of each token: the largest s in [s_lo, s_hi] with cu[s] <= t, by bisection (inlined:
        # the interpreter pays milliseconds per call of a jit function)
        b_s, b_s_hi = tl.zeros([BLOCK], tl.int64) + s_lo, tl.zeros([BLOCK], tl.int64) + s_hi
        for _ in range(n_bisect):
            b_mid = (b_s + b_s_hi + 1) // 2
            b_le = tl.load(cu_ptr + b_mid).to(tl.int64) <= o_t
            b_s, b_s_hi = tl.where(b_le, b_mid, b_s), tl.where(b_le, b_s_hi, b_mid - 1)
        # [BLOCK]
        if HAS_START:  # token t of segment s sits at t + start[s] - cu[s] (placed segments, e.g. padded rows)
            shift = tl.load(start_ptr + b_s, mask=m_t, other=0) - tl.load(cu_ptr + b_s, mask=m_t, other=0).to(tl.int64)
            o_p = o_t + shift
            m_t = m_t & (o_p >= 0) & (o_p < T)  # unchecked placements never reach outside [0, T)
        else:
            o_p = o_t
        b_m = tl.load(mask_ptr + o_p, mask=m_t, other=0) != 0
        b_v32 = tl.load(val_ptr + o_p, mask=b_m, other=0.0)
        b_rv = tl.load(rew_ptr + o_p, mask=b_m, other=0.0) - b_v32
        # the recurrence stops after the segment's last token (segment end, or rollout end if stitched)
        b_end = tl.load(cu_ptr + b_s + 1, mask=m_t, other=0).to(tl.int64) - 1 == o_t
        b_keep = ~(b_end & (tl.load(reset_ptr + b_s, mask=m_t, other=0.0) != 0.0))
        b_xa = tl.where(b_keep, tl.where(b_m, tl.load(gl_ptr + b_s, mask=m_t, other=1.0), 1.0), 0.0)
        b_ya = tl.where(b_keep & b_m, gamma, 0.0)
        b_pa = tl.where(b_m, b_rv, 0.0)
        b_z = tl.where(b_keep & ~b_m, 1.0, 0.0)
        b_q = tl.where(b_m, b_v32, 0.0)
        b_f = tl.where(b_keep, 0.0, 1.0).to(TOK)
        if OWN_CRITIC:
            b_xc = tl.where(b_keep, tl.where(b_m, tl.load(glc_ptr + b_s, mask=m_t, other=1.0), 1.0), 0.0)
            b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_yc, b_pc, b_f = tl.associative_scan(
                (b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_ya, b_pa, b_f), 0, _compose)
        else:
            b_xa, b_ya, b_pa, b_z, b_q, b_f = tl.associative_scan((b_xa, b_ya, b_pa, b_z, b_q, b_f), 0, _compose_adv)
        # the block's map (last lane), float64 from here on
        g_xa, g_ya, g_pa = tl.gather(b_xa, i_last, 0).to(ACC), tl.gather(b_ya, i_last, 0).to(ACC), tl.gather(
            b_pa, i_last, 0).to(ACC)
        g_z, g_q, g_f = tl.gather(b_z, i_last, 0).to(ACC), tl.gather(b_q, i_last, 0).to(ACC), tl.gather(
            b_f, i_last, 0).to(ACC)
        if OWN_CRITIC:
            g_xc, g_yc, g_pc = tl.gather(b_xc, i_last, 0).to(ACC), tl.gather(b_yc, i_last, 0).to(ACC), tl.gather(
                b_pc, i_last, 0).to(ACC)
        else:
            g_xc, g_yc, g_pc = g_xa, g_ya, g_pa
        if WRITE:  # every token from the carry at the block's end, in float32
            a_t, v_t = a_c.to(TOK), v_c.to(TOK)
            b_a = _apply(b_f, b_xa.to(TOK), b_ya.to(TOK), b_pa, a_t, v_t)
            if OWN_CRITIC:
                b_ac = _apply(b_f, b_xc.to(TOK), b_yc.to(TOK), b_pc, ac_c.to(TOK), v_t)
            else:
                b_ac = b_a
            b_scale = tl.load(scale_ptr + b_s, mask=b_m, other=0.0).to(TOK)
            tl.store(adv_ptr + o_p, tl.where(b_m, b_scale * b_a, 0.0).to(adv_ptr.dtype.element_ty), mask=m_t)
            tl.store(ret_ptr + o_p, tl.where(b_m, b_ac + b_v32, 0.0).to(ret_ptr.dtype.element_ty), mask=m_t)
            # the carry into the next block: the float64 carry through the block's map
            a_n = _apply(g_f, g_xa, g_ya, g_pa, a_c, v_c)
            ac_n = _apply(g_f, g_xc, g_yc, g_pc, ac_c, v_c)
            v_c = _apply(g_f, g_z, 0.0, g_q, v_c, 0.0)
            a_c, ac_c = a_n, ac_n
        else:  # chunk map = block map after the map of the later blocks (the formulas of _compose)
            m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc, m_f = _compose(
                m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc, m_f, g_xa, g_ya, g_pa, g_z, g_q, g_xc, g_yc, g_pc, g_f)
    return m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc, m_f


@triton.jit
def _carry_in(summary_ptr, i, n, BLOCK: tl.constexpr):
    """The carry (a, v, ac) into the end of chunk i: the maps of chunks i+1, i+2, ... (`summary` [N_MAP, n]
    float64) composed BLOCK at a time until one stops the recurrence (nothing later can flow in), applied to
    the zero state past the last chunk, which leaves the composed map's constant terms."""
    o_b = tl.arange(0, BLOCK)
    i_last = tl.full([1], BLOCK - 1, tl.int32)
    one = tl.full([1], 1.0, ACC)
    c_xa, c_ya, c_pa, c_z, c_q, c_xc, c_yc, c_pc = one, one * 0, one * 0, one, one * 0, one, one * 0, one * 0
    c_f = one * 0
    j = i + 1
    while j < n:
        o_c = j + BLOCK - 1 - o_b  # reversed: lane 0 holds the block's last chunk; lanes past chunk n-1: identities
        m_c = o_c < n
        p = summary_ptr + o_c
        # [BLOCK] each
        b_xa, b_ya, b_pa = tl.load(p, mask=m_c, other=1.0), tl.load(p + n, mask=m_c, other=0.0), tl.load(
            p + 2 * n, mask=m_c, other=0.0)
        b_z, b_q = tl.load(p + 3 * n, mask=m_c, other=1.0), tl.load(p + 4 * n, mask=m_c, other=0.0)
        b_xc, b_yc, b_pc = tl.load(p + 5 * n, mask=m_c, other=1.0), tl.load(p + 6 * n, mask=m_c, other=0.0), tl.load(
            p + 7 * n, mask=m_c, other=0.0)
        b_f = tl.load(p + 8 * n, mask=m_c, other=0.0)
        b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_yc, b_pc, b_f = tl.associative_scan(
            (b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_yc, b_pc, b_f), 0, _compose)
        # the chunks so far (earlier) applied after this block (later)
        c_xa, c_ya, c_pa, c_z, c_q, c_xc, c_yc, c_pc, c_f = _compose(
            tl.gather(b_xa, i_last, 0), tl.gather(b_ya, i_last, 0), tl.gather(b_pa, i_last, 0),
            tl.gather(b_z, i_last, 0), tl.gather(b_q, i_last, 0), tl.gather(b_xc, i_last, 0),
            tl.gather(b_yc, i_last, 0), tl.gather(b_pc, i_last, 0), tl.gather(b_f, i_last, 0),
            c_xa, c_ya, c_pa, c_z, c_q, c_xc, c_yc, c_pc, c_f)
        j += BLOCK
        if tl.max(c_f, 0) != 0:
            j = j * 0 + n  # n in j's int64 type (the JIT passes a small n as int32)
    return c_pa, c_q, c_pc


@triton.jit
def _gae_chunk_kernel(rew_ptr, val_ptr, mask_ptr, cu_ptr, cs_ptr, start_ptr, T, S, LOG_S, params_ptr, gamma_hi,
                      gamma_lo, summary_ptr, adv_ptr, ret_ptr, n_chunks, chunk, BLOCK: tl.constexpr,
                      WRITE: tl.constexpr, CARRY: tl.constexpr, OWN_CRITIC: tl.constexpr, HAS_START: tl.constexpr,
                      CARRY_BLOCK: tl.constexpr):
    """Chunk c backwards (`_tile_pass`): the tokens [c*chunk, min(T, (c+1)*chunk)), or for chunk = 0 the
    tokens of rollout c, [cu[cs[c]], cu[cs[c+1]]). params: float64 [4, S] (`gae_params`).

    WRITE=False (pass 1): store the chunk's composed map to `summary` [N_MAP, n_chunks] float64.
    WRITE=True: write adv, ret [T] from the carry at the chunk's end: zero, or with CARRY the later chunks'
    maps from `summary` composed (`_carry_in`).
    """
    pid = tl.program_id(0).to(tl.int64)
    if WRITE:
        # reversed chunk order: the data pass 1 read last is the likeliest to still be in L2
        i_c = n_chunks - 1 - pid
    else:
        i_c = pid
    if chunk > 0:
        lo = i_c * chunk
        hi = tl.minimum(lo + chunk, T)
    else:  # offsets clamped where read
        r0 = tl.minimum(tl.maximum(tl.load(cs_ptr + i_c).to(tl.int64), 0), S)
        r1 = tl.minimum(tl.maximum(tl.load(cs_ptr + i_c + 1).to(tl.int64), 0), S)
        lo = tl.minimum(tl.maximum(tl.load(cu_ptr + r0).to(tl.int64), 0), T)
        hi = tl.minimum(tl.maximum(tl.load(cu_ptr + r1).to(tl.int64), lo), T)
    s_lo, s_hi, n_bisect = _segments_of(cu_ptr, lo, hi, S, LOG_S)
    gamma = tl.zeros([1], ACC) + gamma_hi + gamma_lo
    o_1 = tl.arange(0, 1)
    if WRITE and CARRY:
        a_c, v_c, ac_c = _carry_in(summary_ptr, i_c, n_chunks, CARRY_BLOCK)
    else:
        a_c, v_c, ac_c = tl.zeros([1], ACC), tl.zeros([1], ACC), tl.zeros([1], ACC)
    m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc, m_f = _tile_pass(
        rew_ptr, val_ptr, mask_ptr, cu_ptr, start_ptr, T, params_ptr, params_ptr + S, params_ptr + 2 * S,
        params_ptr + 3 * S, adv_ptr, ret_ptr, lo, hi, s_lo, s_hi, n_bisect, gamma, a_c, v_c, ac_c, BLOCK, WRITE,
        OWN_CRITIC, HAS_START)
    if not WRITE:
        _store_map(summary_ptr + i_c + o_1, n_chunks, m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc, m_f)


@triton.jit
def _gae_lookback_kernel(rew_ptr, val_ptr, mask_ptr, cu_ptr, start_ptr, T, S, gl_ptr, glc_ptr, scale_ptr, reset_ptr,
                         gamma_hi, gamma_lo, ws_ptr, agg_ptr, incl_ptr, adv_ptr, ret_ptr, n_tiles, LOG_S,
                         TILE: tl.constexpr, BLOCK: tl.constexpr, OWN_CRITIC: tl.constexpr, HAS_START: tl.constexpr,
                         INCL_EVERY: tl.constexpr):
    """Single-pass reverse scan with decoupled look-back (the mirror of the CUB/Merrill-Garland scheme).

    Tiles of TILE tokens are taken in a dynamic order from an atomic counter (ws[0]), last tile first, so a
    tile waits only on tiles that already started. Each tile publishes its composed map (agg, flag 1), looks
    towards later tiles for its carry (composing their maps until a tile with a published inclusive
    state, flag 2), publishes its own inclusive state, then writes its tokens from that carry.
    ws: int32 [1 + n_tiles] zeros (counter, flags); agg: float64 [N_MAP, n_tiles]; incl: float64 [3, n_tiles].
    INCL_EVERY: 1 (every tile publishes its inclusive state); tests pass k > 1 (only tiles i % k == 0 publish) so
    that the look-back composes published maps under the interpreter too, whose programs run one after another.
    """
    vid = tl.atomic_add(ws_ptr, 1).to(tl.int64)
    i = n_tiles - 1 - vid
    lo = i * TILE
    hi = tl.minimum(lo + TILE, T)
    s_lo, s_hi, n_bisect = _segments_of(cu_ptr, lo, hi, S, LOG_S)
    gamma = tl.zeros([1], ACC) + gamma_hi + gamma_lo
    zero = tl.zeros([1], ACC)
    o_1 = tl.arange(0, 1)
    m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc, m_f = _tile_pass(
        rew_ptr, val_ptr, mask_ptr, cu_ptr, start_ptr, T, gl_ptr, glc_ptr, scale_ptr, reset_ptr, adv_ptr, ret_ptr,
        lo, hi, s_lo, s_hi, n_bisect, gamma, zero, zero, zero, BLOCK, False, OWN_CRITIC, HAS_START)
    if not OWN_CRITIC:
        m_xc, m_yc, m_pc = m_xa, m_ya, m_pa
    flag = ws_ptr + 1
    # publish the aggregate
    _store_map(agg_ptr + i + o_1, n_tiles, m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc, m_f)
    tl.debug_barrier()
    tl.atomic_xchg(flag + i, 1, sem="release")
    # look towards later tiles: carry = M[i+1](M[i+2](... (inclusive state of the first tile found))), where the
    # state past the last tile is 0 (a tile may compose its way to the end while the last tile, which has
    # published its map, has not yet published its state)
    c_xa, c_ya, c_pa, c_z, c_q, c_xc, c_yc, c_pc = zero + 1.0, zero, zero, zero + 1.0, zero, zero + 1.0, zero, zero
    c_f = zero
    s_a, s_v, s_ac = zero, zero, zero
    j = i + 1
    while j < n_tiles:
        f = tl.atomic_add(flag + j, 0, sem="acquire")
        while f == 0:  # tile j started before this one: it publishes soon
            f = tl.atomic_add(flag + j, 0, sem="acquire")
        if f == 2:
            p_i = incl_ptr + j + o_1
            s_a = tl.load(p_i, volatile=True)
            s_v = tl.load(p_i + n_tiles, volatile=True)
            s_ac = tl.load(p_i + 2 * n_tiles, volatile=True)
            j = j * 0 + n_tiles  # n_tiles in j's int64 type (the JIT passes a small n_tiles as int32)
        else:
            p_j = agg_ptr + j + o_1
            g_xa, g_ya, g_pa = tl.load(p_j, volatile=True), tl.load(p_j + n_tiles, volatile=True), tl.load(
                p_j + 2 * n_tiles, volatile=True)
            g_z, g_q = tl.load(p_j + 3 * n_tiles, volatile=True), tl.load(p_j + 4 * n_tiles, volatile=True)
            g_xc, g_yc, g_pc = tl.load(p_j + 5 * n_tiles, volatile=True), tl.load(p_j + 6 * n_tiles, volatile=True), \
                tl.load(p_j + 7 * n_tiles, volatile=True)
            g_f = tl.load(p_j + 8 * n_tiles, volatile=True)
            # the tiles so far (earlier) applied after tile j (later): _compose(M_j, C)
            c_xa, c_ya, c_pa, c_z, c_q, c_xc, c_yc, c_pc, c_f = _compose(
                g_xa, g_ya, g_pa, g_z, g_q, g_xc, g_yc, g_pc, g_f, c_xa, c_ya, c_pa, c_z, c_q, c_xc, c_yc, c_pc, c_f)
            j += 1
    a_c = _apply(c_f, c_xa, c_ya, c_pa, s_a, s_v)
    v_c = _apply(c_f, c_z, 0.0, c_q, s_v, 0.0)
    ac_c = _apply(c_f, c_xc, c_yc, c_pc, s_ac, s_v)
    # publish the inclusive state at the tile's first token: M_i(carry)
    publish = True
    if INCL_EVERY != 1:
        publish = i % INCL_EVERY == 0
    if publish:
        p_i = incl_ptr + i + o_1
        tl.store(p_i, _apply(m_f, m_xa, m_ya, m_pa, a_c, v_c))
        tl.store(p_i + n_tiles, _apply(m_f, m_z, 0.0, m_q, v_c, 0.0))
        tl.store(p_i + 2 * n_tiles, _apply(m_f, m_xc, m_yc, m_pc, ac_c, v_c))
        tl.debug_barrier()
        tl.atomic_xchg(flag + i, 2, sem="release")
    _tile_pass(rew_ptr, val_ptr, mask_ptr, cu_ptr, start_ptr, T, gl_ptr, glc_ptr, scale_ptr, reset_ptr, adv_ptr, ret_ptr,
               lo, hi, s_lo, s_hi, n_bisect, gamma, a_c, v_c, ac_c, BLOCK, True, OWN_CRITIC, HAS_START)


BLOCK = 256             # tokens per block on GPU: <= 168 registers at 4 warps, no spills (tests/test_aot.py)
INTERPRET_BLOCK = 32768  # at most; the interpreter pays per operation, not per element: few, large blocks
CARRY_BLOCK = 128       # later chunks' maps per step of `_carry_in` (the first step usually meets a stop)
PARAMS_BLOCK = 1024     # mask bytes per step of the per-rollout count
LOOKBACK_TILE = 2048    # tokens per tile of the look-back plan (GPU)
NUM_WARPS = 4


# (kernel name, signature, constexprs) compiled ahead of time for sm_80/sm_90 by tests/test_aot.py: every
# flag combination with int64 offsets, the default path (WRITE, OWN_CRITIC) with int32 offsets too, and the
# sizes as the JIT types them for a usual call (a Python int below 2^31 is an i32 argument).
# The loss mask is passed as the bool tensor itself (*i1: Triton loads its bytes).
def _offsets(idx):
    return {"mask_ptr": "*i1", "cu_ptr": f"*{idx}", "cs_ptr": f"*{idx}"}


def _small(sig):
    return {k: "i32" if k in ("T", "S", "n_chunks", "chunk", "n_tiles", "n_ws") else v for k, v in sig.items()}


_CHUNK_SIG = dict(rew_ptr="*fp32", val_ptr="*fp32", start_ptr="*i64", T="i64", S="i64", LOG_S="i32", params_ptr="*fp64",
                  gamma_hi="fp32", gamma_lo="fp32", summary_ptr="*fp64", adv_ptr="*fp32", ret_ptr="*fp32",
                  n_chunks="i64", chunk="i64")
_PARAMS_SIG = dict(start_ptr="*i64", lam_ptr="*fp32", out_ptr="*fp64", S="i64", T="i64",
                   **{f"{k}_{p}": "fp32" for k in ("gamma", "lam", "alpha", "lamc") for p in ("hi", "lo")})
AOT_SPECS = [("_gae_params_kernel", dict(_offsets(idx), **_PARAMS_SIG, ws_ptr="*i32" if ws else "*fp64", n_ws="i64"),
              {"LAM_MODE": mode, "CROSS": cross, "NEED_COUNTS": counts, "HAS_START": start, "BLOCK": PARAMS_BLOCK,
               "ZERO_WS": ws})
             for idx, mode, cross, counts, start, ws in [("i64", 0, 0, False, False, False),
                                                         ("i64", 2, 1, True, False, False),
                                                         ("i32", 2, 1, True, False, False),
                                                         ("i64", 1, 2, True, True, False),
                                                         ("i64", 3, 1, True, True, False),
                                                         ("i64", 2, 1, True, False, True)]]
AOT_SPECS += [("_gae_chunk_kernel", dict(_offsets(idx), **_CHUNK_SIG),
               {"BLOCK": BLOCK, "WRITE": write, "CARRY": carry, "OWN_CRITIC": own, "HAS_START": start,
                "CARRY_BLOCK": CARRY_BLOCK})
              for idx, write, carry, own, start in [
                  ("i64", False, False, False, False), ("i64", False, False, True, False),
                  ("i64", True, False, False, False), ("i64", True, False, True, False),
                  ("i64", True, True, False, False), ("i64", True, True, True, False),
                  ("i32", True, False, True, False), ("i32", True, True, True, False),
                  ("i64", False, False, True, True), ("i64", True, True, True, True)]]
_LOOKBACK_SIG = dict(rew_ptr="*fp32", val_ptr="*fp32", mask_ptr="*i1", cu_ptr="*i64", start_ptr="*i64", T="i64",
                     S="i64", gl_ptr="*fp64", glc_ptr="*fp64", scale_ptr="*fp64", reset_ptr="*fp64", gamma_hi="fp32",
                     gamma_lo="fp32", ws_ptr="*i32", agg_ptr="*fp64", incl_ptr="*fp64", adv_ptr="*fp32",
                     ret_ptr="*fp32", n_tiles="i64", LOG_S="i32")
AOT_SPECS += [("_gae_lookback_kernel", _LOOKBACK_SIG, {"TILE": LOOKBACK_TILE, "BLOCK": BLOCK, "OWN_CRITIC": own,
                                                       "HAS_START": start, "INCL_EVERY": 1})
              for own, start in [(True, False), (False, False), (True, True)]]
_CHUNK_CONSTS = dict(BLOCK=BLOCK, OWN_CRITIC=True, HAS_START=False, CARRY_BLOCK=CARRY_BLOCK)
AOT_SPECS += [  # a usual call as the JIT types it: int32 offsets, int32 sizes
    ("_gae_params_kernel", _small(dict(_offsets("i32"), **_PARAMS_SIG, ws_ptr="*fp64", n_ws="i64")),
     {"LAM_MODE": 2, "CROSS": 1, "NEED_COUNTS": True, "HAS_START": False, "BLOCK": PARAMS_BLOCK, "ZERO_WS": False}),
    ("_gae_chunk_kernel", _small(dict(_offsets("i32"), **_CHUNK_SIG)), dict(_CHUNK_CONSTS, WRITE=False, CARRY=False)),
    ("_gae_chunk_kernel", _small(dict(_offsets("i32"), **_CHUNK_SIG)), dict(_CHUNK_CONSTS, WRITE=True, CARRY=True)),
    ("_gae_lookback_kernel", _small(dict(_LOOKBACK_SIG, cu_ptr="*i32")),
     {"TILE": LOOKBACK_TILE, "BLOCK": BLOCK, "OWN_CRITIC": True, "HAS_START": False, "INCL_EVERY": 1})]


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def _chunk_size(T, R, device, chunk, block):
    """Tokens per chunk (a Python int), 0 for one chunk per rollout; `chunk` given: that."""
    if chunk is not None:
        return chunk
    if device.type == "cuda":
        sms = _sm_count(device)
        # enough rollouts to fill the GPU: one pass over rollouts; else ~4 balanced chunks per SM
        return 0 if R >= 2 * sms else max(block, triton.cdiv(triton.cdiv(T, 4 * sms), block) * block)
    return block  # interpreter: one block per chunk, so that long inputs run both passes


def _split(x: float):
    """x as float32 hi + lo (hi + lo == x to ~1e-14 relative): float64 scalars for Triton without a copy."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


def gae_params(mask, cu, cs, lam_seg, gamma, lam, lam_mode, alpha, cross, lam_critic, seg_start=None, ws=None):
    """Per-segment numbers: float64 [4, S] rows gamma*lam_s, gamma*lam_critic_s, scale_s, reset_s.
    mask: [T] bool/uint8; cu: [S+1], cs: [R+1] int32/int64 (read clamped); lam_seg: [S] float32 or None;
    seg_start: [S] int64 where each segment's tokens start (None: at cu[s]); ws: int32 [n] or None, zeroed by
    the same launch (needs R >= 1)."""
    S, R, T = cu.numel() - 1, cs.numel() - 1, mask.numel()
    params = torch.empty(4, S, dtype=torch.float64, device=mask.device)
    if R:
        need_counts = cross == CROSS_PAPER or lam_mode in (LAM_ADAPTIVE_SEGMENT, LAM_ADAPTIVE_ROLLOUT)
        _gae_params_kernel[(R,)](mask, cu, cs, cu if seg_start is None else seg_start,
                                 params if lam_seg is None else lam_seg, params, S, T,
                                 *_split(gamma), *_split(lam), *_split(alpha), *_split(lam_critic),
                                 params if ws is None else ws, 0 if ws is None else ws.numel(), LAM_MODE=lam_mode,
                                 CROSS=cross, NEED_COUNTS=need_counts, HAS_START=seg_start is not None,
                                 BLOCK=PARAMS_BLOCK if mask.device.type == "cuda" else INTERPRET_BLOCK,
                                 ZERO_WS=ws is not None)
    return params


def segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                    cross, lam_critic, seg_start=None, *, block=None, chunk=None, plan=None, tile=None, incl_every=1):
    """Launch the segment_gae kernels on the tensors' device (arguments: `_segment_gae_fwd`)."""
    with device_guard(loss_mask):
        return _segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode,
                                alpha, cross, lam_critic, seg_start, block=block, chunk=chunk, plan=plan, tile=tile,
                                incl_every=incl_every)


def _segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                     cross, lam_critic, seg_start=None, *, block=None, chunk=None, plan=None, tile=None,
                     incl_every=1):
    """Launch the segment_gae kernels; arguments as `torch.ops.compactionrl_fast.segment_gae`.

    Args:
        rewards, values: [T] float32; loss_mask: [T] bool; cu_seqlens: [S+1], cu_segments: [R+1] int32/int64
            (one dtype, validated by the caller, never read here); lam_seg: [S] float32 or None.
        gamma, lam, alpha: floats; lam_mode: 0 const, 1 adaptive (segment length), 2 adaptive (rollout
            length), 3 per-segment tensor; cross: 0 none, 1 paper, 2 stitched; lam_critic: < 0 means None.
        seg_start: [S] int64 or None: segment s holds the tokens [seg_start[s], + its length) instead of
            [cu[s], cu[s+1]) (segments placed anywhere in [0, T), e.g. the rows of a padded batch).
        block: tokens per block (power of two); chunk: tokens per chunk, 0 for one chunk per rollout;
            None picks both for the device.
        plan: "lookback" (one launch: single-pass scan with decoupled look-back over tiles of `tile` tokens)
            or None/"auto": the per-rollout or the chunk plan (COMPACTIONRL_FAST_GAE_PLAN sets the default;
            "auto" stays the default until a GPU measurement says otherwise). incl_every: tests only (see
            `_gae_lookback_kernel`'s INCL_EVERY).

    Launches: the per-segment numbers, then one scan per rollout (chunk = 0), the chunk plan's two passes, or
    the look-back scan (its tile counter and flags zeroed by the first launch).
    Host work: the outputs, the [4, S] numbers and the chunk plan's [N_MAP, n_chunks] maps; no device read.

    Returns:
        (advantages [T] float32, returns [T] float32), zero at non-trainable positions.
    """
    T, S, R = loss_mask.numel(), cu_seqlens.numel() - 1, cu_segments.numel() - 1
    dev = loss_mask.device
    adv, ret = empty(T, device=dev), empty(T, device=dev)
    if T == 0:
        return adv, ret
    if S == 0 or R == 0:  # tokens but no segment (unchecked offsets): no token is trainable
        return adv.zero_(), ret.zero_()
    if not block:
        block = BLOCK if dev.type == "cuda" else min(INTERPRET_BLOCK, triton.next_power_of_2(max(T, 16)))
    cu, cs = cu_seqlens, cu_segments
    start = cu if seg_start is None else seg_start  # placed segments: segment s starts at start[s]
    own, log_s = lam_critic >= 0.0, max(1, S.bit_length())
    lookback = (plan or os.environ.get("COMPACTIONRL_FAST_GAE_PLAN", "auto")) == "lookback"
    if lookback:
        tile = tile or (LOOKBACK_TILE if dev.type == "cuda" else block)
        n_tiles = triton.cdiv(T, tile)
        ws = empty(1 + n_tiles, dtype=torch.int32, device=dev)  # tile counter, flags: zeroed by gae_params
    params = gae_params(loss_mask, cu, cs, lam_seg, gamma, lam, lam_mode, alpha, cross, lam_critic, seg_start,
                        ws if lookback else None)
    if lookback:
        agg = torch.empty(N_MAP, n_tiles, dtype=torch.float64, device=dev)
        incl = torch.empty(3, n_tiles, dtype=torch.float64, device=dev)
        _gae_lookback_kernel[(n_tiles,)](rewards, values, loss_mask, cu, start, T, S, *params.unbind(0),
                                         *_split(gamma), ws, agg, incl, adv, ret, n_tiles, log_s, TILE=tile,
                                         BLOCK=min(block, tile),
                                         OWN_CRITIC=own, HAS_START=seg_start is not None, INCL_EVERY=incl_every,
                                         num_warps=NUM_WARPS)
        return adv, ret
    chunk = _chunk_size(T, R, dev, chunk, block)
    n_chunks = R if chunk == 0 else triton.cdiv(T, chunk)
    carry = chunk > 0 and n_chunks > 1  # chunks that start inside a recurrence: pass 1 stores their maps
    summary = torch.empty(N_MAP, n_chunks, dtype=torch.float64, device=dev) if carry else params
    args = (rewards, values, loss_mask, cu, cs, start, T, S, log_s, params, *_split(gamma), summary, adv, ret,
            n_chunks, chunk)
    flags = dict(BLOCK=block, OWN_CRITIC=own, HAS_START=seg_start is not None, CARRY_BLOCK=CARRY_BLOCK,
                 num_warps=NUM_WARPS)
    if carry:
        _gae_chunk_kernel[(n_chunks,)](*args, WRITE=False, CARRY=False, **flags)
    _gae_chunk_kernel[(n_chunks,)](*args, WRITE=True, CARRY=carry, **flags)
    return adv, ret
