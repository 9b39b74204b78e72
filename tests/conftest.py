"""Test setup. The Triton kernels are tested on CPU tensors under the Triton interpreter, which must be
switched on before triton is first imported; the ahead-of-time compile tests run in a subprocess
without it (tests/_aot.py)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["COMPACTIONRL_FAST_POISON"] = "1"  # outputs start as NaN: unwritten elements fail

import pytest  # noqa: E402
import torch  # noqa: E402

try:  # the interpreter runs a custom-combine scan one element at a time; swap in a log-step scan
    from tests import _interp_scan

    _interp_scan.install()
except ImportError:  # triton not installed
    pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
