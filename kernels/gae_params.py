"""Per-segment numbers of `segment_gae` on Triton: the one place (with csrc/common/gae_step.h
`rollout_params`, its C++/CUDA twin, and the reference's `segment_params`) that turns the lambda and
cross-segment modes (kernels/modes.py) into the numbers the scans read; no mode reaches the scans."""
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from . import modes
from .gae_scan import PARAMS_BLOCK, aot_i32_sizes, aot_offsets


@triton.jit
def _gae_params_kernel(mask_ptr, cu_ptr, cs_ptr, start_ptr, lam_ptr, out_ptr, S, T, gamma_hi, gamma_lo, lam_hi, lam_lo, alpha_hi,
                       alpha_lo, lamc_hi, lamc_lo, ws_ptr, n_ws, LAM_MODE: tl.constexpr, CROSS: tl.constexpr,
                       NEED_COUNTS: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr, ZERO_WS: tl.constexpr):
    """Per-segment numbers of rollout `program_id` (the port of csrc/common/gae_step.h rollout_params):
    out [4, S] float64 rows gl = gamma*lam_s, glc (returns), scale ((gl)^N_later or 1), reset (1: nothing
    flows in from after the segment). The trainable counts are parked in the scale row until it is written.
    Float arguments come as float32 pairs hi + lo (Triton passes Python floats as float32; see
    kernels/_launch.py `split64`). LAM_MODE, CROSS: codes of kernels/modes.py; NEED_COUNTS:
    `modes.needs_counts(LAM_MODE, CROSS)`.
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
        if LAM_MODE == modes.LAM_CONST:
            l_s = tl.zeros([1], tl.float64) + lam
        elif LAM_MODE == modes.LAM_TENSOR:
            l_s = tl.load(lam_ptr + s + o_1).to(tl.float64)
        else:  # adaptive: 1 - 1/(alpha * max(n, 1)), clamped to [0, 1]
            n_a = n_roll.to(tl.float64) if LAM_MODE == modes.LAM_ADAPTIVE_ROLLOUT else n_s
            l_s = tl.minimum(tl.maximum(1.0 - 1.0 / (alpha * tl.maximum(n_a, 1.0)), 0.0), 1.0)
        gl = gamma * l_s
        glc = tl.where(lam_critic >= 0.0, gamma * lam_critic, gl)
        if CROSS == modes.CROSS_PAPER:  # (gl)^N_later, 0^0 = 1
            scale = tl.where(n_later == 0.0, 1.0, tl.where(gl <= 0.0, 0.0, tl.exp(n_later * tl.log(tl.maximum(gl, 1e-300)))))
        else:
            scale = tl.zeros([1], tl.float64) + 1.0
        if CROSS == modes.CROSS_STITCHED:  # the recurrence runs on unless no token of the rollout follows
            nxt = tl.minimum(tl.maximum(tl.load(cu_ptr + s + 1 + o_1).to(tl.int64), 0), T)
            reset = tl.where(nxt == end, 1.0, 0.0).to(tl.float64)
        else:
            reset = tl.zeros([1], tl.float64) + 1.0
        tl.store(out_ptr + s + o_1, gl)
        tl.store(out_ptr + S + s + o_1, glc)
        tl.store(out_ptr + 2 * S + s + o_1, scale)
        tl.store(out_ptr + 3 * S + s + o_1, reset)
        n_later += n_s


# What tests/test_aot.py compiles (the choices: kernels/gae_scan.py): (index dtype, lambda mode, cross mode,
# seg_start, zero ws), every cross mode of kernels/modes.py at least once.
_AOT_SIG = dict(start_ptr="*i64", lam_ptr="*fp32", out_ptr="*fp64", S="i64", T="i64",
                **{f"{k}_{p}": "fp32" for k in ("gamma", "lam", "alpha", "lamc") for p in ("hi", "lo")})
_AOT_CASES = [("i64", modes.LAM_CONST, modes.CROSS_NONE, False, False),
              ("i64", modes.LAM_ADAPTIVE_ROLLOUT, modes.CROSS_PAPER, False, False),
              ("i32", modes.LAM_ADAPTIVE_ROLLOUT, modes.CROSS_PAPER, False, False),
              ("i64", modes.LAM_ADAPTIVE_SEGMENT, modes.CROSS_STITCHED, True, False),
              ("i64", modes.LAM_TENSOR, modes.CROSS_PAPER, True, False),
              ("i64", modes.LAM_ADAPTIVE_ROLLOUT, modes.CROSS_PAPER, False, True)]
_AOT_CASES += [("i64", modes.LAM_CONST, c, False, False) for c in modes.CROSS_SEGMENT.values()
               if c not in {case[2] for case in _AOT_CASES}]
AOT = [("_gae_params_kernel", dict(aot_offsets(idx), **_AOT_SIG, ws_ptr="*i32" if ws else "*fp64", n_ws="i64"),
        {"LAM_MODE": mode, "CROSS": cross, "NEED_COUNTS": modes.needs_counts(mode, cross), "HAS_START": start,
         "BLOCK": PARAMS_BLOCK, "ZERO_WS": ws})
       for idx, mode, cross, start, ws in _AOT_CASES]
AOT.append(("_gae_params_kernel", aot_i32_sizes(dict(aot_offsets("i32"), **_AOT_SIG, ws_ptr="*fp64", n_ws="i64")),
            {"LAM_MODE": modes.LAM_ADAPTIVE_ROLLOUT, "CROSS": modes.CROSS_PAPER,
             "NEED_COUNTS": modes.needs_counts(modes.LAM_ADAPTIVE_ROLLOUT, modes.CROSS_PAPER), "HAS_START": False,
             "BLOCK": PARAMS_BLOCK, "ZERO_WS": False}))
