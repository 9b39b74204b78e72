"""Inductor's on-disk FX graph cache serves C++ kernels written for one vector ISA to a process that compiles
them for another: NaN / garbage (or heap corruption) when ATEN_CPU_CAPABILITY differs between processes.

    python benchmarks/experiments/inductor_avx2_nan.py

Needs an AVX-512 CPU (there the default kernels are 16 floats wide; under ATEN_CPU_CAPABILITY=avx2 inductor
picks AVX2, 8 wide). Runs four child processes, each compiling the same RMSNorm with one fresh or shared
TORCHINDUCTOR_CACHE_DIR: native; then ATEN_CPU_CAPABILITY=avx2 on the same cache (the FX graph cache key has
no ISA in it: it loads the 16-wide source and builds it with AVX2 flags: wrong); avx2 on a fresh cache
(correct); avx2 on the shared cache with TORCH_COMPILE_CACHE_KEY_TAG=avx2 (the workaround: a tag in the key,
correct). Each prints how many outputs differ from eager by > 1e-4, the max difference and the non-finite
count (each 16-step vector loop handles 8 floats: sums miss half their terms and half the outputs keep
whatever memory held, garbage or NaN).
"""
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F


def rmsnorm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def child():
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    torch.manual_seed(0)
    x, w = torch.randn(222, 64), torch.randn(64)
    y, ref = torch.compile(rmsnorm)(x, w), rmsnorm(x, w)
    print(f"  ATen {torch.backends.cpu.get_cpu_capability()}, inductor ISA {pick_vec_isa()}: "
          f"{int(((y - ref).abs() > 1e-4).sum())} of {y.numel()} wrong, max |compiled - eager| "
          f"{float((y - ref).abs().max()):.3g}, non-finite {int((~y.isfinite()).sum())}")


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:
        child()
        raise SystemExit
    shared = tempfile.mkdtemp()
    runs = [("native, cache A (fills it)", {}, shared),
            ("ATEN_CPU_CAPABILITY=avx2, cache A (native's)", {"ATEN_CPU_CAPABILITY": "avx2"}, shared),
            ("ATEN_CPU_CAPABILITY=avx2, fresh cache", {"ATEN_CPU_CAPABILITY": "avx2"}, tempfile.mkdtemp()),
            ("ATEN_CPU_CAPABILITY=avx2, cache A, TORCH_COMPILE_CACHE_KEY_TAG=avx2",
             {"ATEN_CPU_CAPABILITY": "avx2", "TORCH_COMPILE_CACHE_KEY_TAG": "avx2"}, shared)]
    for name, env, cache in runs:
        print(name, flush=True)
        base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCH_COMPILE_CACHE_KEY_TAG")}
        r = subprocess.run([sys.executable, __file__, "child"], env=base | env | {"TORCHINDUCTOR_CACHE_DIR": cache})
        if r.returncode:
            print(f"  exit code {r.returncode}")
