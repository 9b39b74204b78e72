"""Ahead-of-time compilation of the Triton kernels and the CUDA sources for sm_80 and sm_90, on a
machine with no GPU, and resource usage read from the cubins with cuobjdump.

What to compile for a kernels/ module: its module-level `AOT` (tests/_aot_specs.py collects them), a list of
(kernel name, signature dict, constexpr dict) as `triton.compiler.ASTSource` takes them, and optionally a fourth
item, the compile options its launcher passes (e.g. {"num_warps": 8}; default: Triton's). Triton runs in a
subprocess with the interpreter off (the test process has it on).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ARCHS = (80, 90)

_TRITON_SCRIPT = r"""
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
mod = importlib.import_module(sys.argv[1]); out = sys.argv[2]; specs = json.load(open(sys.argv[3]))
names = []
for i, (kname, sig, consts, *opts) in enumerate(specs):
    fn = getattr(mod, kname)
    for cc in %s:
        k = compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", cc, 32),
                    options=opts[0] if opts else None)
        path = f"{out}/{kname}_{i}_sm{cc}.cubin"
        open(path, "wb").write(k.asm["cubin"])
        names.append([kname, i, cc, path, consts])
print(json.dumps(names))
""" % (ARCHS,)


def cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else shutil.which("cuobjdump")


def resource_usage(cubin: str) -> dict[str, dict[str, int]]:
    """{function name: {"REG": n, "STACK": n, "SHARED": n, "LOCAL": n}} from `cuobjdump --dump-resource-usage`."""
    text = subprocess.run([cuobjdump(), "--dump-resource-usage", cubin], check=True, capture_output=True,
                          text=True).stdout
    out, fn = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            fn = m.group(1)
            continue
        if fn and "REG:" in line:
            out[fn] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            fn = None
    return out


def aot_specs(module: str) -> list:
    """The AOT specs of `module` (compactionrl_fast.kernels.<name>): its `AOT` (none: [])."""
    from tests._aot_specs import SPECS

    return list(SPECS.get(module.rsplit(".", 1)[-1], []))


def compile_triton_module(module: str):
    """Compile every AOT spec of `module` for each arch; returns [(kernel, idx, cc, consts, usage)]."""
    tmp = tempfile.mkdtemp(prefix="crf_aot_")
    specs = os.path.join(tmp, "specs.json")
    with open(specs, "w") as f:
        json.dump(aot_specs(module), f)
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, module, tmp, specs], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT compile of {module} failed:\n{proc.stderr[-4000:]}")
    rows = []
    for kname, i, cc, path, consts in json.loads(proc.stdout.strip().splitlines()[-1]):
        usage = resource_usage(path)
        rows.append((kname, i, cc, consts, usage))
    shutil.rmtree(tmp, ignore_errors=True)
    return rows


def compile_cuda_source(path: str, cc: int, include_dirs=()) -> dict[str, dict[str, int]]:
    """nvcc a standalone CUDA kernel file (no torch headers) to a cubin; returns its resource usage."""
    nvcc = shutil.which("nvcc")
    tmp = tempfile.mkdtemp(prefix="crf_nvcc_")
    out = os.path.join(tmp, f"k_sm{cc}.cubin")
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", f"-arch=sm_{cc}", "-x", "cu", path, "-o", out]
    for d in include_dirs:
        cmd += ["-I", d]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {path} sm_{cc}:\n{proc.stderr[-4000:]}")
    usage = resource_usage(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return usage
