"""Triton kernels of `place_final_rewards` (docs/ops.md): one final reward per rollout put on the last
trainable token of each of its segments ("paper") or of the rollout ("stitched").

Two launches: `_zero_kernel` writes 0 to every output token; `_place_kernel`, one program per rollout, walks
the rollout's segments from the last, finds a segment's last trainable token by scanning BLOCK mask bytes
at a time from the segment's end, and stores the reward there ("stitched": at the first segment, from the
end, that has one). The work is O(S) short scans, not a search per token. Offsets are read clamped
(cu_segments to [0, S], cu_seqlens to [0, T], each end at least its start): bad offsets give wrong
rewards, never an out-of-bounds access. Nothing is read on the host.
"""
import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter with numpy >= 2.4)
from ._launch import device_guard, empty

BLOCK = 256              # mask bytes per step on GPU
ZERO_BLOCK = 1024        # output tokens per program of the zero fill on GPU
INTERPRET_BLOCK = 4096   # the interpreter pays per operation, not per element: large steps
NUM_WARPS = 4


@triton.jit
def _zero_kernel(out_ptr, T, BLOCK: tl.constexpr):
    """out[T] float32 = 0, BLOCK tokens per program."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + o, tl.zeros([BLOCK], tl.float32), mask=o < T)


@triton.jit
def _place_kernel(rr_ptr, mask_ptr, cu_ptr, cs_ptr, out_ptr, T, S, STITCHED: tl.constexpr, BLOCK: tl.constexpr):
    """Rollout `program_id`: rr [R] float32, mask [T] bool, cu [S+1], cs [R+1] int32/int64, out [T] float32
    (zeroed by `_zero_kernel` before)."""
    r = tl.program_id(0).to(tl.int64)
    s0 = tl.minimum(tl.maximum(tl.load(cs_ptr + r).to(tl.int64), 0), S)
    s1 = tl.minimum(tl.maximum(tl.load(cs_ptr + r + 1).to(tl.int64), s0), S)
    reward = tl.load(rr_ptr + r)
    o_b = tl.arange(0, BLOCK).to(tl.int64)
    s = s1 - 1
    while s >= s0:
        b = tl.minimum(tl.maximum(tl.load(cu_ptr + s).to(tl.int64), 0), T)
        e = tl.minimum(tl.maximum(tl.load(cu_ptr + s + 1).to(tl.int64), b), T)
        last = b - 1  # below b: not found (yet)
        hi = e
        while (hi > b) & (last < b):
            o_t = hi - 1 - o_b
            m = tl.load(mask_ptr + o_t, mask=o_t >= b, other=0)
            last = tl.max(tl.where(m != 0, o_t, b - 1), axis=0)
            hi -= BLOCK
        if last >= b:
            tl.store(out_ptr + last, reward)
            if STITCHED:
                s = s0  # the rollout's last trainable token is placed: stop
        s -= 1


def place_final_rewards_fwd(rollout_rewards, loss_mask, cu_seqlens, cu_segments, stitched, *, block=None):
    """`_place_final_rewards_fwd` launched on the tensors' device."""
    with device_guard(loss_mask):
        return _place_final_rewards_fwd(rollout_rewards, loss_mask, cu_seqlens, cu_segments, stitched, block=block)


def _place_final_rewards_fwd(rollout_rewards, loss_mask, cu_seqlens, cu_segments, stitched, *, block=None):
    """rollout_rewards [R] float32, loss_mask [T] bool, cu_seqlens [S+1], cu_segments [R+1] (one index dtype,
    validated by the caller or not at all: read clamped) -> rewards [T] float32. block: mask bytes per step
    (a power of two; None: the device's)."""
    T, S, R = loss_mask.numel(), cu_seqlens.numel() - 1, cu_segments.numel() - 1
    dev = loss_mask.device
    out = empty(T, device=dev)
    if T == 0:
        return out
    gpu = dev.type == "cuda"
    block = block or (BLOCK if gpu else INTERPRET_BLOCK)
    zero_block = ZERO_BLOCK if gpu else max(16, min(INTERPRET_BLOCK * 8, triton.next_power_of_2(T)))
    _zero_kernel[(triton.cdiv(T, zero_block),)](out, T, BLOCK=zero_block, num_warps=NUM_WARPS)
    if R and S:
        _place_kernel[(R,)](rollout_rewards, loss_mask, cu_seqlens, cu_segments, out, T, S,
                            STITCHED=bool(stitched), BLOCK=block, num_warps=NUM_WARPS)
    return out


# What tests/test_aot.py compiles: both modes and index dtypes, the sizes as i64 and as the JIT types them.
_AOT_SIG = dict(rr_ptr="*fp32", mask_ptr="*i1", cu_ptr="*i64", cs_ptr="*i64", out_ptr="*fp32", T="i64", S="i64")
AOT = [("_zero_kernel", {"out_ptr": "*fp32", "T": T}, {"BLOCK": ZERO_BLOCK}, {"num_warps": NUM_WARPS})
       for T in ("i32", "i64")]
AOT += [("_place_kernel", dict(_AOT_SIG, cu_ptr=f"*{idx}", cs_ptr=f"*{idx}", T=size, S=size),
         {"STITCHED": stitched, "BLOCK": BLOCK}, {"num_warps": NUM_WARPS})
        for idx, size, stitched in [("i64", "i64", False), ("i64", "i64", True), ("i32", "i32", False),
                                    ("i32", "i32", True), ("i64", "i32", False)]]
