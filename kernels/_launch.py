"""What every launcher here uses: output allocation, the device guard, float64 scalars as float32 pairs.
kernels/ imports nothing from the package above it, so the test suite's poisoned allocation lives here.

POISON: with COMPACTIONRL_FAST_POISON=1 in the environment when this module is first imported (the test
suite's conftest sets it), float outputs start as NaN and integer ones (counters, flags) as -1, so an element
a kernel forgets to write fails the tests. Read once; a test that must count allocations without the fill
sets `POISON = False` on this module.
"""
import contextlib
import math
import os

import numpy as np
import torch

POISON = os.environ.get("COMPACTIONRL_FAST_POISON") == "1"


def empty(*shape, dtype=torch.float32, device="cpu"):
    """torch.empty, filled with NaN / -1 when POISON is on."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


def device_guard(t):
    """Launch on `t`'s device, not the current one (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def split64(x: float):
    """x as two float32 (hi, lo), hi + lo == x to ~1e-14 relative (lo = 0 past float32): a float64 scalar for a
    Triton kernel without a copy to the device."""
    with np.errstate(over="ignore"):
        hi = float(np.float32(x))
    return hi, float(np.float32(x - hi)) if math.isfinite(hi) else 0.0
