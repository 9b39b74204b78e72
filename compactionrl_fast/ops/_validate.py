"""Input checks shared by every op. Each raises ValueError/TypeError naming the argument.

The generic checks (a tensor's dtype/shape/device, offsets, floats, choices), then the two that the loss
and GAE ops share: the packed layout (`check_layout`) and a loss denominator (`check_denominator`).

Checks that read device values (offsets, targets) cost a host sync on CUDA. COMPACTIONRL_FAST_CHECKS
decides which run: "auto" (default) runs them on CPU tensors only (no sync there) and never while
torch.compile traces; "1" runs them everywhere (syncs allowed: debugging); "0" runs none. Checks of
dtype, device, shape and Python scalars always run. Kernels never trust offsets: they clamp them.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

CHECKS = ("auto", "1", "0")
_trusted = threading.local()


@contextlib.contextmanager
def trusted_layout():
    """Inside: device-value checks are skipped (a layout built and validated on the host, e.g. by the
    padded-batch adapters, is not read back per op). COMPACTIONRL_FAST_CHECKS=1 still checks."""
    before = getattr(_trusted, "on", False)
    _trusted.on = True
    try:
        yield
    finally:
        _trusted.on = before


def checks_mode() -> str:
    """The COMPACTIONRL_FAST_CHECKS setting: "auto", "1" or "0"."""
    mode = os.environ.get("COMPACTIONRL_FAST_CHECKS", "auto").strip().lower() or "auto"
    if mode not in CHECKS:
        raise ValueError(f"COMPACTIONRL_FAST_CHECKS must be one of {CHECKS}, got {mode!r}")
    return mode


def value_checks(t: torch.Tensor) -> bool:
    """Whether checks that read the values of `t` (a host read) run for this call."""
    mode = checks_mode()
    if mode == "0" or torch.compiler.is_compiling() or t.device.type == "meta":
        return False
    if getattr(_trusted, "on", False) and mode != "1":
        return False
    if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
        return False
    return mode == "1" or t.device.type == "cpu"

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def loss_dtype(*tensors):
    """The type the losses' kernels read their float inputs in: float64 if one input is float64 (the C++ kernels
    compute it in float64; Triton and CUDA refuse it: ops/_dispatch.py), else float32 (exact for bf16/fp16)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_tensor(name, t, *, dtypes=None, ndim=None, device=None, numel=None):
    """Check that `t` is a tensor with one of `dtypes`, `ndim` dims, on `device`, with `numel` elements."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({want}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors must share one device)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got shape {tuple(t.shape)}")
    return t


def check_offsets(name, cu, *, total, device, total_name="T"):
    """`cu` is an int32/int64 [N+1] offset vector: cu[0] = 0, non-decreasing, cu[-1] = total.

    Returns N. Reads `cu` on the host once (one sync for CUDA tensors); the kernels trust it afterwards,
    so a bad offset is an error here rather than an out-of-bounds access later.
    """
    check_tensor(name, cu, dtypes=INDEX_DTYPES, ndim=1, device=device)
    if cu.numel() < 1:
        raise ValueError(f"{name} must have at least one element (offsets [N+1])")
    c = cu.detach().cpu().numpy()  # numpy: a few us per call on small offsets where torch ops take ~15
    if int(c[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(c[0])}")
    down = c[1:] < c[:-1]
    if down.any():
        i = int(down.argmax()) + 1
        raise ValueError(f"{name} must be non-decreasing, but {name}[{i}]={int(c[i])} < {name}[{i-1}]={int(c[i-1])}")
    if int(c[-1]) != total:
        raise ValueError(f"{name}[-1] must equal {total_name}={total}, got {int(c[-1])}")
    return cu.numel() - 1


def check_float(name, x, lo=None, hi=None):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    x = float(x)
    if x != x or (lo is not None and x < lo) or (hi is not None and x > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {x}")
    return x


def check_choice(name, x, choices):
    if x not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {x!r}")
    return x


def check_layout(loss_mask, cu_seqlens, cu_segments):
    """Validate `cu_seqlens`/`cu_segments` against `loss_mask` [T]; returns cu_segments in cu_seqlens' dtype.

    Dtype, shape and device are always checked; the offsets' values only where `value_checks` allows
    (CPU by default: no host sync on CUDA, no data-dependent branch under torch.compile). The kernels
    clamp offsets, so unchecked bad offsets give wrong numbers, never an out-of-bounds access.
    """
    T, device = loss_mask.numel(), loss_mask.device
    if cu_seqlens is None:
        if cu_segments is not None:
            raise ValueError("cu_segments needs cu_seqlens (the segments it groups)")
        return None
    # the type first: a list (or anything else) is a TypeError that names the argument
    check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    if cu_segments is not None:
        check_tensor("cu_segments", cu_segments, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    read = value_checks(cu_seqlens)
    if read:
        check_offsets("cu_seqlens", cu_seqlens, total=T, device=device)
    elif cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must have at least one element (offsets [S+1])")
    if cu_segments is None:
        return None
    S = cu_seqlens.numel() - 1
    if read:
        check_offsets("cu_segments", cu_segments, total=S, device=device, total_name="S (number of segments)")
    elif cu_segments.numel() < 1:
        raise ValueError("cu_segments must have at least one element (offsets [R+1])")
    return cu_segments.to(cu_seqlens.dtype)


def check_denominator(denominator, reduction, device=None):
    """A number >= 0 (a Python float: no host-device copy), a one-element tensor on the data's device
    (read by the kernels: no sync, no recompiles), or None."""
    if denominator is None:
        return None
    if reduction == "sum":
        raise ValueError("denominator has no meaning with reduction='sum' (the sum is not divided)")
    if isinstance(denominator, torch.Tensor):
        if denominator.numel() != 1:
            raise ValueError(f"denominator must be a number or a one-element tensor, got shape "
                             f"{tuple(denominator.shape)}")
        if device is not None and denominator.device != device:
            raise ValueError(f"denominator is on {denominator.device}, expected {device} (the loss_mask's device)")
        if denominator.dtype == torch.bool or denominator.is_complex():
            raise TypeError(f"denominator must be a real number tensor, got {denominator.dtype}")
        if value_checks(denominator):
            d = float(denominator.detach().reshape(()))
            if not d >= 0.0 or d == float("inf"):
                raise ValueError(f"denominator must be a finite number >= 0, got {d}")
        return denominator.reshape(())
    return check_float("denominator", denominator, 0.0, float("inf"))
