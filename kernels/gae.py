"""Triton kernels for `segment_gae` (SPEC section 4): segmented reverse GAE over packed rollouts.

Every token acts on the state carried backwards, (a, v, ac) = A and V of the nearest later trainable
token and A of the returns' recurrence, as an affine map (the math of csrc/common/gae_step.h):
  trainable t:  a' = gl*a + gamma*v + (r_t - V_t),  v' = V_t,  ac' = glc*ac + gamma*v + (r_t - V_t);
  masked t:     the identity;  the last token of a segment where the recurrence stops (every segment
  end for "none"/"paper", rollout ends for "stitched"): the zero map first, then its own map.
with gl = gamma*lam_s, glc = gamma*lam_critic (or gl). A token range is the composition of its maps
(`_compose`), so the recurrence splits into independent pieces.

The token range [0, T) is cut into chunks and chunks into BLOCK-token blocks; both may span segments
and rollouts (each lane finds its segment by bisection over `cu_seqlens`). A block is loaded in
reversed token order so that a forward `tl.associative_scan` composes the maps from the block's end
(upstream `reverse=True` has an open GPU correctness issue; it is not used). Two launch plans:
  * one chunk per rollout (enough rollouts to fill the GPU): one pass from a zero carry;
  * fixed chunks (few long rollouts): phase 1 stores each chunk's composed map (no writes), phase 2
    composes them from the last chunk back (one program) into each chunk's carry-in, phase 3 reruns
    each chunk from its carry-in and writes adv and ret.
Per-segment numbers (trainable counts from `_count_kernel`, lambda, the paper's (gamma*lam)^N_later,
reset flags) are a few vectorised torch ops on [S]-sized tensors; no host synchronisation.

Accumulation is float64: with float32 the worst error against the float64 reference on 3000-token
segments is 2.2e-6 relative to 1 + |ref| (tolerance 2e-6), float64 gives 6e-8 (float32 output rounding).
The op is memory-bound; float64 arithmetic is cheap on A100/H100/H200, not on consumer GPUs.
"""
import torch
import triton
import triton.language as tl

from compactionrl_fast.ops._alloc import empty

from .segments import device_guard, sanitize_offsets

ACC = tl.float64  # accumulation dtype of the maps and carries (see the module docstring)
LAM_CONST, LAM_ADAPTIVE_SEGMENT, LAM_ADAPTIVE_ROLLOUT, LAM_TENSOR = 0, 1, 2, 3  # as compactionrl_fast/ops/gae.py
CROSS_NONE, CROSS_PAPER, CROSS_STITCHED = 0, 1, 2
N_MAP = 8  # a chunk map: (xa, ya, pa, z, q, xc, yc, pc), see _compose


@triton.jit
def _compose(xa1, ya1, pa1, z1, q1, xc1, yc1, pc1, xa2, ya2, pa2, z2, q2, xc2, yc2, pc2):
    # A map sends the carry (a, v, ac) after a token range to the carry at its first token:
    #   a' = xa*a + ya*v + pa,  v' = z*v + q,  ac' = xc*ac + yc*v + pc.
    # Map 2 (the earlier range) applied after map 1 (the later range).
    return (xa2 * xa1, xa2 * ya1 + ya2 * z1, xa2 * pa1 + ya2 * q1 + pa2, z2 * z1, z2 * q1 + q2,
            xc2 * xc1, xc2 * yc1 + yc2 * z1, xc2 * pc1 + yc2 * q1 + pc2)


@triton.jit
def _compose_adv(xa1, ya1, pa1, z1, q1, xa2, ya2, pa2, z2, q2):
    # _compose without the returns' recurrence (lam_critic=None: returns reuse the advantages)
    return xa2 * xa1, xa2 * ya1 + ya2 * z1, xa2 * pa1 + ya2 * q1 + pa2, z2 * z1, z2 * q1 + q2


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _count_kernel(mask_ptr, cu_ptr, cb_ptr, seg_ptr, counts_ptr, n_chunks, BLOCK: tl.constexpr):
    """Trainable tokens per segment: for the part [a0, a1) of segment s inside this chunk,
    counts[s] += P(a1 - 1) - P(a0 - 1), P(t) = trainable tokens in [chunk start, t]."""
    i_c = tl.program_id(0).to(tl.int64)
    lo, hi = tl.load(cb_ptr + i_c), tl.load(cb_ptr + i_c + 1)
    s_lo, s_hi = tl.load(seg_ptr + i_c), tl.load(seg_ptr + n_chunks + i_c)
    n_bisect = tl.load(seg_ptr + 2 * n_chunks + i_c)
    o_b = tl.arange(0, BLOCK)
    i_last = tl.full([1], BLOCK - 1, tl.int32)
    n_c = tl.zeros([1], tl.int64)  # trainable tokens of the chunk before this block
    for i_b in range((hi - lo + BLOCK - 1) // BLOCK):
        o_t = lo + i_b * BLOCK + o_b
        m_t = o_t < hi
        # segment of each token: the largest s in [s_lo, s_hi] with cu[s] <= t, by bisection (inlined:
        # the interpreter pays milliseconds per call of a jit function)
        b_s, b_s_hi = tl.zeros([BLOCK], tl.int64) + s_lo, tl.zeros([BLOCK], tl.int64) + s_hi
        for _ in range(n_bisect):
            b_mid = (b_s + b_s_hi + 1) // 2
            b_le = tl.load(cu_ptr + b_mid).to(tl.int64) <= o_t
            b_s, b_s_hi = tl.where(b_le, b_mid, b_s), tl.where(b_le, b_s_hi, b_mid - 1)
        # [BLOCK]
        b_m = tl.load(mask_ptr + o_t, mask=m_t, other=0).to(tl.int64)
        b_p = tl.associative_scan(b_m, 0, _add) + n_c
        m_first = m_t & ((o_t == lo) | (o_t == tl.load(cu_ptr + b_s, mask=m_t, other=0).to(tl.int64)))
        m_last = m_t & ((o_t == hi - 1) | (o_t == tl.load(cu_ptr + b_s + 1, mask=m_t, other=0).to(tl.int64) - 1))
        tl.atomic_add(counts_ptr + b_s, b_p, mask=m_last)
        tl.atomic_add(counts_ptr + b_s, b_m - b_p, mask=m_first)
        n_c = tl.gather(b_p, i_last, 0)


@triton.jit
def _gae_chunk_kernel(rew_ptr, val_ptr, mask_ptr, cu_ptr, cb_ptr, seg_ptr, gl_ptr, glc_ptr, scale_ptr, reset_ptr,
                      gamma_ptr, carry_ptr, summary_ptr, adv_ptr, ret_ptr, n_chunks,
                      BLOCK: tl.constexpr, WRITE: tl.constexpr, OWN_CRITIC: tl.constexpr):
    """One chunk [cb[c], cb[c+1]) backwards, BLOCK tokens at a time; blocks may span segments.

    WRITE=False (phase 1): store the chunk's composed map to `summary` [8, n_chunks] float64.
    WRITE=True (phase 3): start from `carry` [3, n_chunks] float64 (a, v, ac) and write adv, ret [T].
    """
    pid = tl.program_id(0).to(tl.int64)
    if WRITE:
        # reversed chunk order: the data phase 1 read last is the likeliest to still be in L2
        i_c = n_chunks - 1 - pid
    else:
        i_c = pid
    lo, hi = tl.load(cb_ptr + i_c), tl.load(cb_ptr + i_c + 1)
    # segments s_lo..s_hi overlap the chunk; n_bisect = ceil(log2(s_hi - s_lo + 1))
    s_lo, s_hi = tl.load(seg_ptr + i_c), tl.load(seg_ptr + n_chunks + i_c)
    n_bisect = tl.load(seg_ptr + 2 * n_chunks + i_c)
    gamma = tl.load(gamma_ptr)
    o_b = tl.arange(0, BLOCK)
    o_1 = tl.arange(0, 1)
    # the scans' last lane holds the map of the whole block (lanes before the chunk are identities)
    i_last = tl.full([1], BLOCK - 1, tl.int32)
    one = tl.full([1], 1.0, ACC)
    if WRITE:
        a_c = tl.load(carry_ptr + i_c + o_1)
        v_c = tl.load(carry_ptr + n_chunks + i_c + o_1)
        ac_c = tl.load(carry_ptr + 2 * n_chunks + i_c + o_1)
    else:  # the chunk's map so far, starting from the identity
        m_xa, m_ya, m_pa, m_z, m_q, m_xc, m_yc, m_pc = one, one * 0, one * 0, one, one * 0, one, one * 0, one * 0
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
        b_m = tl.load(mask_ptr + o_t, mask=m_t, other=0) != 0
        b_v32 = tl.load(val_ptr + o_t, mask=b_m, other=0.0)
        b_rv = tl.load(rew_ptr + o_t, mask=b_m, other=0.0).to(ACC) - b_v32.to(ACC)
        # the recurrence stops after the segment's last token (segment end, or rollout end if stitched)
        b_end = tl.load(cu_ptr + b_s + 1, mask=m_t, other=0).to(tl.int64) - 1 == o_t
        b_keep = ~(b_end & (tl.load(reset_ptr + b_s, mask=m_t, other=0) != 0))
        b_xa = tl.where(b_keep, tl.where(b_m, tl.load(gl_ptr + b_s, mask=m_t, other=1.0), 1.0), 0.0)
        b_ya = tl.where(b_keep & b_m, gamma, 0.0)
        b_pa = tl.where(b_m, b_rv, 0.0)
        b_z = tl.where(b_keep & ~b_m, 1.0, 0.0)
        b_q = tl.where(b_m, b_v32, 0.0)
        if OWN_CRITIC:
            b_xc = tl.where(b_keep, tl.where(b_m, tl.load(glc_ptr + b_s, mask=m_t, other=1.0), 1.0), 0.0)
            b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_yc, b_pc = tl.associative_scan(
                (b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_ya, b_pa), 0, _compose)
        else:
            b_xa, b_ya, b_pa, b_z, b_q = tl.associative_scan((b_xa, b_ya, b_pa, b_z, b_q), 0, _compose_adv)
        if WRITE:
            b_a = b_xa * a_c + b_ya * v_c + b_pa
            if OWN_CRITIC:
                b_ac = b_xc * ac_c + b_yc * v_c + b_pc
            else:
                b_ac = b_a
            b_scale = tl.load(scale_ptr + b_s, mask=b_m, other=0.0)
            tl.store(adv_ptr + o_t, tl.where(b_m, b_scale * b_a, 0.0).to(adv_ptr.dtype.element_ty), mask=m_t)
            tl.store(ret_ptr + o_t, tl.where(b_m, b_ac + b_v32, 0.0).to(ret_ptr.dtype.element_ty), mask=m_t)
            a_c, ac_c = tl.gather(b_a, i_last, 0), tl.gather(b_ac, i_last, 0)
            v_c = tl.gather(b_z, i_last, 0) * v_c + tl.gather(b_q, i_last, 0)
        else:
            # chunk map = block map after the map of the later blocks (the formulas of _compose)
            g_xa, g_ya, g_pa = tl.gather(b_xa, i_last, 0), tl.gather(b_ya, i_last, 0), tl.gather(b_pa, i_last, 0)
            g_z, g_q = tl.gather(b_z, i_last, 0), tl.gather(b_q, i_last, 0)
            if OWN_CRITIC:
                g_xc, g_yc, g_pc = tl.gather(b_xc, i_last, 0), tl.gather(b_yc, i_last, 0), tl.gather(b_pc, i_last, 0)
            else:
                g_xc, g_yc, g_pc = g_xa, g_ya, g_pa
            m_xc, m_yc, m_pc = g_xc * m_xc, g_xc * m_yc + g_yc * m_z, g_xc * m_pc + g_yc * m_q + g_pc
            m_xa, m_ya, m_pa = g_xa * m_xa, g_xa * m_ya + g_ya * m_z, g_xa * m_pa + g_ya * m_q + g_pa
            m_z, m_q = g_z * m_z, g_z * m_q + g_q
    if not WRITE:
        p_s = summary_ptr + i_c + o_1
        tl.store(p_s, m_xa)
        tl.store(p_s + n_chunks, m_ya)
        tl.store(p_s + 2 * n_chunks, m_pa)
        tl.store(p_s + 3 * n_chunks, m_z)
        tl.store(p_s + 4 * n_chunks, m_q)
        tl.store(p_s + 5 * n_chunks, m_xc)
        tl.store(p_s + 6 * n_chunks, m_yc)
        tl.store(p_s + 7 * n_chunks, m_pc)


@triton.jit
def _gae_carry_kernel(summary_ptr, carry_ptr, n_chunks, BLOCK: tl.constexpr):
    """Phase 2, one program: carry[:, c] = map[c+1](map[c+2](... map[n-1](0))) for every chunk c."""
    o_b = tl.arange(0, BLOCK)
    i_last = tl.full([1], BLOCK - 1, tl.int32)
    a_b, v_b, ac_b = tl.zeros([1], ACC), tl.zeros([1], ACC), tl.zeros([1], ACC)
    for i_b in range((n_chunks + BLOCK - 1) // BLOCK):
        o_c = n_chunks - 1 - i_b * BLOCK - o_b  # reversed: the chunk whose carry-in this lane computes
        m_c = o_c >= 0
        p_s = summary_ptr + o_c + 1  # the map of the chunk after it (identity past the last chunk)
        m_s = m_c & (o_c + 1 < n_chunks)
        # [BLOCK] each
        b_xa = tl.load(p_s, mask=m_s, other=1.0)
        b_ya = tl.load(p_s + n_chunks, mask=m_s, other=0.0)
        b_pa = tl.load(p_s + 2 * n_chunks, mask=m_s, other=0.0)
        b_z = tl.load(p_s + 3 * n_chunks, mask=m_s, other=1.0)
        b_q = tl.load(p_s + 4 * n_chunks, mask=m_s, other=0.0)
        b_xc = tl.load(p_s + 5 * n_chunks, mask=m_s, other=1.0)
        b_yc = tl.load(p_s + 6 * n_chunks, mask=m_s, other=0.0)
        b_pc = tl.load(p_s + 7 * n_chunks, mask=m_s, other=0.0)
        b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_yc, b_pc = tl.associative_scan(
            (b_xa, b_ya, b_pa, b_z, b_q, b_xc, b_yc, b_pc), 0, _compose)
        b_a = b_xa * a_b + b_ya * v_b + b_pa
        b_v = b_z * v_b + b_q
        b_ac = b_xc * ac_b + b_yc * v_b + b_pc
        tl.store(carry_ptr + o_c, b_a, mask=m_c)
        tl.store(carry_ptr + n_chunks + o_c, b_v, mask=m_c)
        tl.store(carry_ptr + 2 * n_chunks + o_c, b_ac, mask=m_c)
        # lanes past the first chunk hold identity maps: the last lane carries into the next block
        a_b, v_b, ac_b = tl.gather(b_a, i_last, 0), tl.gather(b_v, i_last, 0), tl.gather(b_ac, i_last, 0)


def _sig(idx):
    return {"mask_ptr": "*u8", "cu_ptr": f"*{idx}", "cb_ptr": "*i64", "seg_ptr": "*i64"}


# (kernel name, signature, constexprs) compiled ahead of time for sm_80/sm_90 by tests/test_aot.py: every
# flag combination with int64 offsets, the default path (WRITE, OWN_CRITIC) with int32 offsets too
_CHUNK_SIG = dict(rew_ptr="*fp32", val_ptr="*fp32", gl_ptr="*fp64", glc_ptr="*fp64", scale_ptr="*fp64",
                  reset_ptr="*u8", gamma_ptr="*fp64", carry_ptr="*fp64", summary_ptr="*fp64", adv_ptr="*fp32",
                  ret_ptr="*fp32", n_chunks="i64")
AOT_SPECS = [("_count_kernel", dict(_sig(idx), counts_ptr="*i64", n_chunks="i64"), {"BLOCK": 256})
             for idx in ("i32", "i64")]
AOT_SPECS += [("_gae_chunk_kernel", dict(_sig(idx), **_CHUNK_SIG), {"BLOCK": 256, "WRITE": write, "OWN_CRITIC": own})
              for idx, write, own in [("i64", False, False), ("i64", False, True), ("i64", True, False),
                                      ("i64", True, True), ("i32", True, True)]]
AOT_SPECS += [("_gae_carry_kernel", {"summary_ptr": "*fp64", "carry_ptr": "*fp64", "n_chunks": "i64"},
               {"BLOCK": 256})]

BLOCK = 256             # tokens per block on GPU: 126 registers at 4 warps (512: 200, 1024: spills)
INTERPRET_BLOCK = 32768  # at most; the interpreter pays per operation, not per element: few, large blocks
CARRY_BLOCK = 256       # chunk maps per block in phase 2
NUM_WARPS = 4


def _plan(T, R, device, chunk, block):
    """Chunk boundaries cb [NC+1] (int64) and whether phases 1-2 are needed."""
    if chunk is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            # enough rollouts to fill the GPU: one pass over rollouts; else ~4 balanced chunks per SM
            chunk = 0 if R >= 2 * sms else max(block, triton.cdiv(triton.cdiv(T, 4 * sms), block) * block)
        else:  # interpreter: one block per chunk, so that long inputs run all three phases
            chunk = block
    if chunk == 0:
        return None, True
    cb = torch.arange(0, T + chunk, chunk, device=device, dtype=torch.int64).clamp_(max=T)
    cb = cb[: triton.cdiv(T, chunk) + 1]
    return cb, cb.numel() == 2


def _segment_stats(counts, cu, cs, S, R, gamma, lam_seg, lam, lam_mode, alpha, cross, lam_critic):
    """Per-segment float64 gl = gamma*lam_s, glc (returns), scale ((gl)^N_later or 1), uint8 reset flags."""
    dev = cu.device
    roll = torch.repeat_interleave(torch.arange(R, device=dev), cs.diff(), output_size=S)
    if counts is not None:
        csum = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    if lam_mode == LAM_TENSOR:
        lam_s = lam_seg.double()
    elif lam_mode == LAM_CONST:
        lam_s = torch.full((S,), lam, dtype=torch.float64, device=dev)
    else:
        n = counts if lam_mode == LAM_ADAPTIVE_SEGMENT else (csum[cs[1:]] - csum[cs[:-1]])[roll]
        lam_s = (1.0 - 1.0 / (alpha * n.clamp(min=1).double())).clamp(0.0, 1.0)
    gl = gamma * lam_s
    glc = torch.full_like(gl, gamma * lam_critic) if lam_critic >= 0.0 else gl
    if cross == CROSS_PAPER:
        later = (csum[cs[1:]][roll] - csum[1:]).double()
        scale = torch.where(later == 0, 1.0, torch.where(gl <= 0, 0.0, torch.exp(later * gl.clamp(min=1e-300).log())))
    else:
        scale = torch.ones_like(gl)
    if cross == CROSS_STITCHED:  # the recurrence stops only where the rollout ends
        reset = cu[1:] == cu[cs[1:]][roll]
    else:
        reset = torch.ones(S, dtype=torch.bool, device=dev)
    return gl, glc, scale, reset.to(torch.uint8)


def segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                    cross, lam_critic, *, block=None, chunk=None):
    """Launch the segment_gae kernels on the tensors' device (arguments: `_segment_gae_fwd`)."""
    with device_guard(loss_mask):
        return _segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode,
                                alpha, cross, lam_critic, block=block, chunk=chunk)


def _segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                     cross, lam_critic, *, block=None, chunk=None):
    """Launch the segment_gae kernels; arguments as `torch.ops.compactionrl_fast.segment_gae`.

    Args:
        rewards, values: [T] float32; loss_mask: [T] bool; cu_seqlens: [S+1], cu_segments: [R+1] int32/int64
            (one dtype, validated by the caller); lam_seg: [S] float32 or None.
        gamma, lam, alpha: floats; lam_mode: 0 const, 1 adaptive (segment length), 2 adaptive (rollout
            length), 3 per-segment tensor; cross: 0 none, 1 paper, 2 stitched; lam_critic: < 0 means None.
        block: tokens per block (power of two); chunk: tokens per chunk, 0 for one chunk per rollout;
            None picks both for the device.

    Returns:
        (advantages [T] float32, returns [T] float32), zero at non-trainable positions.
    """
    T, S, R = loss_mask.numel(), cu_seqlens.numel() - 1, cu_segments.numel() - 1
    dev = loss_mask.device
    adv, ret = empty(T, device=dev), empty(T, device=dev)
    if T == 0:
        return adv, ret
    if not block:
        block = BLOCK if dev.type == "cuda" else min(INTERPRET_BLOCK, triton.next_power_of_2(max(T, 16)))
    cu, cs = sanitize_offsets(cu_seqlens, T), sanitize_offsets(cu_segments, S)  # unchecked on CUDA
    cb, single = _plan(T, R, dev, chunk, block)
    if cb is None:  # one chunk per rollout
        cb = cu[cs]
    n_chunks = cb.numel() - 1
    # segments overlapping each chunk: the one holding its first token .. the one holding its last
    seg_lo = torch.searchsorted(cu, cb[:-1], right=True) - 1
    seg_hi = torch.searchsorted(cu, cb[1:] - 1, right=True) - 1
    w = (seg_hi - seg_lo).clamp(min=0)
    n_bisect = torch.where(w > 0, torch.floor(torch.log2(w.double().clamp(min=1))) + 1, 0).long()  # bits of w
    seg = torch.stack([seg_lo, seg_hi, n_bisect])
    mask = loss_mask.view(torch.uint8)
    counts = None
    if cross == CROSS_PAPER or lam_mode in (LAM_ADAPTIVE_SEGMENT, LAM_ADAPTIVE_ROLLOUT):
        counts = torch.zeros(S, dtype=torch.int64, device=dev)
        _count_kernel[(n_chunks,)](mask, cu, cb, seg, counts, n_chunks, BLOCK=block, num_warps=NUM_WARPS)
    gl, glc, scale, reset = _segment_stats(counts, cu, cs, S, R, gamma, lam_seg, lam, lam_mode, alpha, cross,
                                           lam_critic)
    gamma_t = torch.full((1,), gamma, dtype=torch.float64, device=dev)
    own = lam_critic >= 0.0
    carry = torch.zeros(3, n_chunks, dtype=torch.float64, device=dev)
    args = (rewards, values, mask, cu, cb, seg, gl, glc, scale, reset, gamma_t)
    if not single:
        summary = torch.empty(N_MAP, n_chunks, dtype=torch.float64, device=dev)
        _gae_chunk_kernel[(n_chunks,)](*args, carry, summary, adv, ret, n_chunks, BLOCK=block, WRITE=False,
                                       OWN_CRITIC=own, num_warps=NUM_WARPS)
        _gae_carry_kernel[(1,)](summary, carry, n_chunks, BLOCK=CARRY_BLOCK, num_warps=NUM_WARPS)
    else:
        summary = carry
    _gae_chunk_kernel[(n_chunks,)](*args, carry, summary, adv, ret, n_chunks, BLOCK=block, WRITE=True,
                                   OWN_CRITIC=own, num_warps=NUM_WARPS)
    return adv, ret
