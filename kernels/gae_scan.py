"""The block scan of `segment_gae` (kernels/gae.py): every token's affine map on the carried state, composed
BLOCK tokens at a time with `tl.associative_scan`, shared by the chunk plan (kernels/gae_chunk.py) and the
look-back plan (kernels/gae_lookback.py). The maps and the precision rules: kernels/gae.py's docstring."""
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)

ACC = tl.float64  # coefficients, and the maps and carries that cross blocks (see kernels/gae.py)
TOK = tl.float32  # a block's sums and the outputs
N_MAP = 9  # a chunk map: (xa, ya, pa, z, q, xc, yc, pc, f), see _compose

# GPU launch sizes: kernels/gae.py launches at them, the kernels modules' `AOT` lists compile at them.
BLOCK = 256             # tokens per block on GPU: no register spills at 4 warps (tests/test_aot.py)
CARRY_BLOCK = 128       # later chunks' maps per step of `_carry_in` (the first step usually meets a stop)
PARAMS_BLOCK = 1024     # mask bytes per step of the per-rollout count
LOOKBACK_TILE = 2048    # tokens per tile of the look-back plan (GPU)


# The AOT lists of gae_params, gae_chunk and gae_lookback: every flag combination with int64 offsets, the
# default path (WRITE, OWN_CRITIC) with int32 offsets too, and the sizes as the JIT types them for a usual call
# (`aot_i32_sizes`). The loss mask is passed as the bool tensor itself (*i1: Triton loads its bytes).
def aot_offsets(idx):
    return {"mask_ptr": "*i1", "cu_ptr": f"*{idx}", "cs_ptr": f"*{idx}"}


def aot_i32_sizes(sig):
    """The sizes as int32, as the JIT types a Python int below 2^31."""
    return {k: "i32" if k in ("T", "S", "n_chunks", "chunk", "n_tiles", "n_ws") else v for k, v in sig.items()}


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
    # in integers (a float log2 puts the kernel on the stack)
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
        # the interpreter pays for every call of a jit function)
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
