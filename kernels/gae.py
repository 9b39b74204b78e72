"""Launcher of the Triton kernels for `segment_gae` (docs/ops.md): segmented reverse GAE over packed rollouts.

Files: kernels/gae_params.py (the per-segment numbers: the modes), kernels/gae_scan.py (the token maps and
the block scan), kernels/gae_chunk.py (the chunk plan), kernels/gae_lookback.py (the look-back plan); this
module picks the plan and the sizes and launches them.

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
one program per rollout (counts included), into [4, S] float64 arrays that the scan reads; no mode code
(kernels/modes.py) reaches the scan and nothing is read on the host. Offsets are never trusted: every kernel
clamps what it reads to [0, T] / [0, S] and bisects only inside [0, S), so bad offsets give wrong numbers,
never a bad access. A third plan, `plan="lookback"`, scans tiles in one launch (kernels/gae_lookback.py).

Precision: a block's sums (rewards minus values, the carried values) and every output are float32, as in
the loops trainers run; the scan's coefficients (products of gamma*lam_s) and everything that crosses
blocks (the carry, a chunk's or a tile's composed map, the per-segment numbers) are float64. A float32
scan forms the powers of gamma*lam by repeated squaring, which doubles their relative error at each
level: like a wrong last bit of gamma*lam, up to 3x the float32 loop's error (4K-token stitched rollouts,
adaptive lambda). The error stays within the accuracy rule of tests/ops/test_gae_accuracy.py.
"""
import functools
import os

import torch
import triton

from ._launch import device_guard, empty, split64
from .gae_chunk import _gae_chunk_kernel
from .gae_lookback import _gae_lookback_kernel
from .gae_params import _gae_params_kernel
from .gae_scan import BLOCK, CARRY_BLOCK, LOOKBACK_TILE, N_MAP, PARAMS_BLOCK  # the GPU sizes
from .modes import needs_counts

INTERPRET_BLOCK = 32768  # at most; the interpreter pays per operation, not per element: few, large blocks
NUM_WARPS = 4


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


def gae_params(mask, cu, cs, lam_seg, gamma, lam, lam_mode, alpha, cross, lam_critic, seg_start=None, ws=None):
    """Per-segment numbers: float64 [4, S] rows gamma*lam_s, gamma*lam_critic_s, scale_s, reset_s.
    mask: [T] bool/uint8; cu: [S+1], cs: [R+1] int32/int64 (read clamped); lam_seg: [S] float32 or None;
    seg_start: [S] int64 where each segment's tokens start (None: at cu[s]); ws: int32 [n] or None, zeroed by
    the same launch (needs R >= 1)."""
    S, R, T = cu.numel() - 1, cs.numel() - 1, mask.numel()
    params = torch.empty(4, S, dtype=torch.float64, device=mask.device)
    if R:
        _gae_params_kernel[(R,)](mask, cu, cs, cu if seg_start is None else seg_start,
                                 params if lam_seg is None else lam_seg, params, S, T,
                                 *split64(gamma), *split64(lam), *split64(alpha), *split64(lam_critic),
                                 params if ws is None else ws, 0 if ws is None else ws.numel(), LAM_MODE=lam_mode,
                                 CROSS=cross, NEED_COUNTS=needs_counts(lam_mode, cross), HAS_START=seg_start is not None,
                                 BLOCK=PARAMS_BLOCK if mask.device.type == "cuda" else INTERPRET_BLOCK,
                                 ZERO_WS=ws is not None)
    return params


def segment_gae_params(loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha, cross, lam_critic):
    """`gae_params` launched on the tensors' device: the per-segment numbers alone, float64 [4, S]."""
    with device_guard(loss_mask):
        return gae_params(loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha, cross, lam_critic)


def segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                    cross, lam_critic, seg_start=None, *, block=None, chunk=None, plan=None, tile=None):
    """Launch the segment_gae kernels on the tensors' device (arguments: `_segment_gae_fwd`)."""
    with device_guard(loss_mask):
        return _segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode,
                                alpha, cross, lam_critic, seg_start, block=block, chunk=chunk, plan=plan, tile=tile)


def _segment_gae_fwd(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                     cross, lam_critic, seg_start=None, *, block=None, chunk=None, plan=None, tile=None):
    """Launch the segment_gae kernels; arguments as `torch.ops.compactionrl_fast.segment_gae`.

    Args:
        rewards, values: [T] float32; loss_mask: [T] bool; cu_seqlens: [S+1], cu_segments: [R+1] int32/int64
            (one dtype, validated by the caller, never read here); lam_seg: [S] float32 or None.
        gamma, lam, alpha: floats; lam_mode, cross: codes of kernels/modes.py (LAMBDA, CROSS_SEGMENT);
            lam_critic: < 0 means None.
        seg_start: [S] int64 or None: segment s holds the tokens [seg_start[s], + its length) instead of
            [cu[s], cu[s+1]) (segments placed anywhere in [0, T), e.g. the rows of a padded batch).
        block: tokens per block (power of two); chunk: tokens per chunk, 0 for one chunk per rollout;
            None picks both for the device.
        plan: "lookback" (one launch: single-pass scan with decoupled look-back over tiles of `tile` tokens)
            or None/"auto": the per-rollout or the chunk plan (COMPACTIONRL_FAST_GAE_PLAN sets the default,
            read at every call).

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
                                         *split64(gamma), ws, agg, incl, adv, ret, n_tiles, log_s, TILE=tile,
                                         BLOCK=min(block, tile),
                                         OWN_CRITIC=own, HAS_START=seg_start is not None, num_warps=NUM_WARPS)
        return adv, ret
    chunk = _chunk_size(T, R, dev, chunk, block)
    n_chunks = R if chunk == 0 else triton.cdiv(T, chunk)
    carry = chunk > 0 and n_chunks > 1  # chunks that start inside a recurrence: pass 1 stores their maps
    summary = torch.empty(N_MAP, n_chunks, dtype=torch.float64, device=dev) if carry else params
    args = (rewards, values, loss_mask, cu, cs, start, T, S, log_s, params, *split64(gamma), summary, adv, ret,
            n_chunks, chunk)
    flags = dict(BLOCK=block, OWN_CRITIC=own, HAS_START=seg_start is not None, CARRY_BLOCK=CARRY_BLOCK,
                 num_warps=NUM_WARPS)
    if carry:
        _gae_chunk_kernel[(n_chunks,)](*args, WRITE=False, CARRY=False, **flags)
    _gae_chunk_kernel[(n_chunks,)](*args, WRITE=True, CARRY=carry, **flags)
    return adv, ret
