"""The chunk plan of `segment_gae` (kernels/gae.py): chunks of the token range scanned backwards, from a zero
carry (one chunk per rollout), or in two passes (fixed chunks: their composed maps, then the tokens from the
carry the later chunks' maps give)."""
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from .gae_scan import (ACC, BLOCK, CARRY_BLOCK, _compose, _segments_of, _store_map, _tile_pass, aot_i32_sizes,
                       aot_offsets)


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
    tokens of rollout c, [cu[cs[c]], cu[cs[c+1]]). params: float64 [4, S] (kernels/gae.py `gae_params`).

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


# What tests/test_aot.py compiles (the choices: kernels/gae_scan.py).
_AOT_SIG = dict(rew_ptr="*fp32", val_ptr="*fp32", start_ptr="*i64", T="i64", S="i64", LOG_S="i32",
                params_ptr="*fp64", gamma_hi="fp32", gamma_lo="fp32", summary_ptr="*fp64", adv_ptr="*fp32",
                ret_ptr="*fp32", n_chunks="i64", chunk="i64")
AOT = [("_gae_chunk_kernel", dict(aot_offsets(idx), **_AOT_SIG),
        {"BLOCK": BLOCK, "WRITE": write, "CARRY": carry, "OWN_CRITIC": own, "HAS_START": start,
         "CARRY_BLOCK": CARRY_BLOCK})
       for idx, write, carry, own, start in [
           ("i64", False, False, False, False), ("i64", False, False, True, False),
           ("i64", True, False, False, False), ("i64", True, False, True, False),
           ("i64", True, True, False, False), ("i64", True, True, True, False),
           ("i32", True, False, True, False), ("i32", True, True, True, False),
           ("i64", False, False, True, True), ("i64", True, True, True, True)]]
AOT += [("_gae_chunk_kernel", aot_i32_sizes(dict(aot_offsets("i32"), **_AOT_SIG)),
         dict(BLOCK=BLOCK, OWN_CRITIC=True, HAS_START=False, CARRY_BLOCK=CARRY_BLOCK, WRITE=w, CARRY=w))
        for w in (False, True)]
