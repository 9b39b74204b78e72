"""The CUDA loss kernels (csrc/cuda/ppo_loss_kernels.cuh, value_loss_kernels.cuh) run on the host through
tests/cuda_host_emu.h, in place of the cpp op: tests/ops/losses_cuda_host.cpp built with g++ and called
with ctypes, so the CPU tests check the CUDA kernels' logic (block partials, fixed-order reduction)."""
import ctypes
import os

import pytest
import torch

from compactionrl_fast.kernels._launch import empty
from tests.utils import SHAPE_TABLE, build_host_lib, packed_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = [(8, 4), (256, 4)]  # (threads, tokens per thread): many small blocks, and the GPU block shape


def build(tmp_dir, threads, items):
    return signatures(build_host_lib(tmp_dir, "losses_cuda_host.cpp",
                                     {"CRF_LOSS_THREADS": threads, "CRF_LOSS_ITEMS": items}, "losses_host.so"))


def load(path):
    """The host build at `path` (built by `build`)."""
    return signatures(ctypes.CDLL(path))


def signatures(lib):
    """The host build `lib` with its entry points' ctypes signatures."""
    p, i64, f64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
    lib.crf_ppo_loss_host.restype = None
    lib.crf_ppo_loss_host.argtypes = [p] * 6 + [i32, p, i64, i64] + [f64] * 4 + [p] * 3
    lib.crf_value_loss_host.restype = None
    lib.crf_value_loss_host.argtypes = [p] * 5 + [i32, p, i64, i64, f64] + [p] * 3
    return lib


class _Attach(torch.autograd.Function):
    """loss with the kernel's saved per-token gradient as its backward (what the real op registers)."""

    @staticmethod
    def forward(ctx, x, loss, grad):
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, d_loss):
        (grad,) = ctx.saved_tensors
        return grad * d_loss, None, None


def _ptr(t):
    return t.data_ptr() if t is not None and t.numel() else None


def route_cpp_to_cuda_host(monkeypatch, lib):
    """backend="cpp" runs the CUDA kernels on the host instead (same schema, same argument preparation)."""

    def check_segments(T, cu):  # the bindings' shape check (csrc/common/loss_inputs.h), which the kernels rely on
        if cu is not None and cu.numel() < 2 and T > 0:
            raise ValueError(f"cu_seqlens must have at least 2 elements when T > 0, got {cu.numel()}")

    def ppo_policy_loss(logp, old, adv, mask, roll, cu, scale, clip_low, clip_high, dual_clip, tis_cap, need_grad):
        T = logp.numel()
        check_segments(T, cu)
        grad, loss, metrics = empty(T if need_grad else 0), empty(()), empty(5)  # METRICS of ops/ppo_loss.py
        lib.crf_ppo_loss_host(_ptr(logp), _ptr(old), _ptr(adv), _ptr(roll), _ptr(mask), _ptr(cu),
                              int(cu is not None and cu.dtype == torch.int64), _ptr(scale), scale.numel(), T,
                              clip_low, clip_high, dual_clip, tis_cap, _ptr(grad), _ptr(loss), _ptr(metrics))
        return _Attach.apply(logp, loss, grad), metrics, grad

    def value_loss(v, old, ret, mask, cu, scale, clip, need_grad):
        T = v.numel()
        check_segments(T, cu)
        grad, loss, metrics = empty(T if need_grad else 0), empty(()), empty(3)
        lib.crf_value_loss_host(_ptr(v), _ptr(old), _ptr(ret), _ptr(mask), _ptr(cu),
                                int(cu is not None and cu.dtype == torch.int64), _ptr(scale), scale.numel(), T,
                                clip, _ptr(grad), _ptr(loss), _ptr(metrics))
        return _Attach.apply(v, loss, grad), metrics, grad

    monkeypatch.setattr(torch.ops.compactionrl_fast, "ppo_policy_loss", ppo_policy_loss)
    monkeypatch.setattr(torch.ops.compactionrl_fast, "value_loss", value_loss)


def route_small_block(monkeypatch, cuda_host_lib):
    """Route backend="cpp" to the host build of `cuda_host_lib` at the small block shape (skip the GPU one)."""
    lib, threads = cuda_host_lib
    if threads > 32:
        pytest.skip("one block shape is enough here")
    route_cpp_to_cuda_host(monkeypatch, lib)


def host_case(monkeypatch, cuda_host_lib, case):
    """Route backend="cpp" to the host build of `cuda_host_lib` and return (packed batch of `case`, threads per
    block); the GPU block shape runs only the case that spans several blocks, with int64 offsets."""
    lib, threads = cuda_host_lib
    if threads > 32 and case != "long_multiblock":
        pytest.skip("the GPU block shape runs on the case that spans several blocks")
    route_cpp_to_cuda_host(monkeypatch, lib)
    b = packed_batch(SHAPE_TABLE[case], seed=len(case), index_dtype=torch.int64 if threads > 32 else torch.int32)
    return b, threads
