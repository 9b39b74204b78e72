"""Every Triton kernel compiles for sm_80 and sm_90, and every CUDA kernel source compiles with nvcc,
with no register spills (LOCAL/STACK memory) in the cubins."""
import glob
import importlib
import os
import pkgutil
import shutil

import pytest

import compactionrl_fast.kernels as kernels_pkg
from compactionrl_fast.kernels import modes
from tests._aot import ARCHS, aot_specs, compile_cuda_source, compile_triton_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC_MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels_pkg.__path__) if not m.name.startswith("_"))


def _kernels(module):
    """The launchable kernels (jit functions named *_kernel) defined in kernels/<module>.py."""
    mod = importlib.import_module(f"compactionrl_fast.kernels.{module}")
    return {name for name, obj in vars(mod).items() if name.endswith("_kernel")
            and getattr(getattr(obj, "fn", None), "__module__", None) == mod.__name__}


TRITON_MODULES = [m for m in PUBLIC_MODULES if _kernels(m)]
# Standalone kernel files: csrc/cuda/*_kernels.cuh hold the __global__ kernels without torch headers.
CUDA_KERNEL_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*_kernels.cuh")))


@pytest.mark.parametrize("module", TRITON_MODULES)
def test_triton_kernels_compile_without_spills(module):
    triton = pytest.importorskip("triton")
    rows = compile_triton_module(f"compactionrl_fast.kernels.{module}")
    assert rows, f"kernels/{module}.py has no AOT specs"
    assert {r[2] for r in rows} == set(ARCHS)
    for kname, i, cc, consts, usage in rows:
        assert usage, f"{kname} sm_{cc}: no function in cubin"
        for fn, u in usage.items():
            assert u.get("LOCAL", 0) == 0 and u.get("STACK", 0) == 0, \
                f"{kname}{consts} sm_{cc} spills (triton {triton.__version__}): {u}"
            assert u["REG"] <= 255


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("path", CUDA_KERNEL_FILES, ids=os.path.basename)
@pytest.mark.parametrize("cc", ARCHS)
def test_cuda_kernels_compile_without_spills(path, cc):
    modes.write_header(ROOT)  # csrc/common/modes.h is generated, not committed
    usage = compile_cuda_source(path, cc, include_dirs=[os.path.join(ROOT, "csrc")])
    assert usage, f"{path}: no kernel in cubin"
    for fn, u in usage.items():
        assert u.get("LOCAL", 0) == 0 and u.get("STACK", 0) == 0, f"{fn} sm_{cc} spills: {u}"


def test_every_kernel_module_is_tested():
    """Guard against a kernel or a CUDA kernel file silently left out of the lists above: every *_kernel of
    kernels/ has an AOT spec in its module's `AOT`."""
    assert {"gae_params", "gae_chunk", "gae_lookback"} <= set(TRITON_MODULES)
    for module in TRITON_MODULES:
        missing = _kernels(module) - {spec[0] for spec in aot_specs(f"compactionrl_fast.kernels.{module}")}
        assert not missing, f"kernels/{module}.py: no AOT spec for {sorted(missing)}"
    assert any(p.endswith("gae_kernels.cuh") for p in CUDA_KERNEL_FILES)
