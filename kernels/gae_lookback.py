"""The look-back plan of `segment_gae` (kernels/gae.py): one launch, a single-pass reverse scan over tiles."""
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from .gae_scan import (ACC, BLOCK, LOOKBACK_TILE, _apply, _compose, _segments_of, _store_map, _tile_pass,
                       aot_i32_sizes)


@triton.jit
def _gae_lookback_kernel(rew_ptr, val_ptr, mask_ptr, cu_ptr, start_ptr, T, S, gl_ptr, glc_ptr, scale_ptr, reset_ptr,
                         gamma_hi, gamma_lo, ws_ptr, agg_ptr, incl_ptr, adv_ptr, ret_ptr, n_tiles, LOG_S,
                         TILE: tl.constexpr, BLOCK: tl.constexpr, OWN_CRITIC: tl.constexpr, HAS_START: tl.constexpr,
                         INCL_EVERY: tl.constexpr = 1):
    """Single-pass reverse scan with decoupled look-back (the mirror of the CUB/Merrill-Garland scheme).

    Tiles of TILE tokens are taken in a dynamic order from an atomic counter (ws[0]), last tile first, so a
    tile waits only on tiles that already started. Each tile publishes its composed map (agg, flag 1), looks
    towards later tiles for its carry (composing their maps until a tile with a published inclusive
    state, flag 2), publishes its own inclusive state, then writes its tokens from that carry.
    ws: int32 [1 + n_tiles] zeros (counter, flags); agg: float64 [N_MAP, n_tiles]; incl: float64 [3, n_tiles].
    INCL_EVERY: 1 (the launcher's: every tile publishes its inclusive state); k > 1: only tiles i % k == 0
    publish, so that the look-back composes published maps under the interpreter too, whose programs run one
    after another (tests/ops/test_gae.py launches it so).
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


# What tests/test_aot.py compiles (the choices: kernels/gae_scan.py).
_AOT_SIG = dict(rew_ptr="*fp32", val_ptr="*fp32", mask_ptr="*i1", cu_ptr="*i64", start_ptr="*i64", T="i64", S="i64",
                gl_ptr="*fp64", glc_ptr="*fp64", scale_ptr="*fp64", reset_ptr="*fp64", gamma_hi="fp32",
                gamma_lo="fp32", ws_ptr="*i32", agg_ptr="*fp64", incl_ptr="*fp64", adv_ptr="*fp32", ret_ptr="*fp32",
                n_tiles="i64", LOG_S="i32")
AOT = [("_gae_lookback_kernel", sig, {"TILE": LOOKBACK_TILE, "BLOCK": BLOCK, "OWN_CRITIC": own, "HAS_START": start,
                                      "INCL_EVERY": 1})
       for sig, own, start in [(_AOT_SIG, True, False), (_AOT_SIG, False, False), (_AOT_SIG, True, True),
                               (aot_i32_sizes(dict(_AOT_SIG, cu_ptr="*i32")), True, False)]]
