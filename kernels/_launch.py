"""What every launcher here uses: output allocation and the device guard. kernels/ imports nothing from the
package above it, so the test suite's poisoned allocation lives here.

POISON: with COMPACTIONRL_FAST_POISON=1 in the environment when this module is first imported (the test
suite's conftest sets it), float outputs start as NaN and integer ones (counters, flags) as -1, so an element
a kernel forgets to write fails the tests. Read once; a test that must count allocations without the fill
sets `POISON = False` on this module.
"""
import contextlib
import os

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
