"""Output allocation for the Python-side launchers. With COMPACTIONRL_FAST_POISON=1 (set by the test
suite) float outputs start as NaN, so an element a kernel forgets to write fails the tests."""
import os

import torch


def empty(*shape, dtype=torch.float32, device="cpu"):
    t = torch.empty(*shape, dtype=dtype, device=device)
    if os.environ.get("COMPACTIONRL_FAST_POISON") == "1" and t.is_floating_point():
        t.fill_(float("nan"))
    return t
