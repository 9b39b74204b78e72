"""glibc's malloc thresholds for CPU training: keep freed activation buffers in the process.

A training step on CPU allocates activations of a few MB ([rows, width, MLP width] float32) and frees them
at the backward. glibc serves blocks above its mmap threshold (dynamic, at most 32 MiB) with fresh mmaps and
gives them back at free, and trims the heap top, so every pass faults its pages in again. Fixed thresholds
(`keep_freed_memory`, at the start of each training process on CPU) stop that. Same kernels in the same
order: no number changes. The cost: freed memory stays in the process, up to its peak. Measured on the demo:
benchmarks/results/demo-speed-experiments.md, "Allocator".
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD, TRIM_THRESHOLD = 256 << 20, 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to 256 MiB and its trim threshold to 1 GiB (fixed values also stop glibc's
    own adjustment of them). True when both were set; False where the C library is not glibc, or when
    COMPACTIONRL_FAST_MALLOC=default asks to leave them."""
    if os.environ.get("COMPACTIONRL_FAST_MALLOC", "") == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
