"""Every registered op has each of its pieces (docs/adding-an-op.md), and every public op is registered.

The registry (compactionrl_fast/ops/_registry.py) is what the cross-op tests, the ops snapshot and the speed
check iterate over; this file checks that what a spec names exists: the reference, a fake for each custom op,
cases that bind to the function, its test file, its benchmark, its speed floor, AOT specs for each Triton
kernel it launches, its docs/ops.md section and support-table row, and its export. `missing(spec)` says which
pieces a spec lacks; `test_missing_notices_each_piece` removes each piece in turn to show the check can fail.

`python -m tests.ops.test_registry --update` rewrites docs/ops.md's generated support table.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import sys

import pytest
import torch

import compactionrl_fast as crf
import compactionrl_fast.kernels as kernels_pkg
import compactionrl_fast.ops as ops_pkg
from compactionrl_fast.ops import _dispatch
from compactionrl_fast.ops._registry import SPECS, OpSpec, public_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS_MD = os.path.join(ROOT, "docs", "ops.md")
FLOORS = os.path.join(ROOT, "benchmarks", "check_speedups_floors.json")
# public functions of compactionrl_fast.ops that are no op of their own: counts and a cache setting, built on
# the ops' internal rows (segment_counts) or on none
NOT_OPS = {"global_token_count", "global_denominator", "output_cache"}
NAMES = {"triton": "Triton", "cuda": "CUDA C++", "cpp": "C++", "torch-tuned": "torch-tuned"}


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _has_fake(name):
    """Whether compactionrl_fast::<name> exists with a fake implementation."""
    from torch._library.simple_registry import singleton

    if not hasattr(torch.ops.compactionrl_fast, name):
        return False
    return singleton.find(f"compactionrl_fast::{name}").fake_impl.kernel is not None


def _kernel_names(module):
    """The Triton kernels (jit functions named *_kernel) that kernels/<module>.py defines."""
    mod = importlib.import_module(f"{kernels_pkg.__name__}.{module}")
    return {n for n, obj in vars(mod).items() if n.endswith("_kernel")
            and getattr(getattr(obj, "fn", None), "__module__", None) == mod.__name__}


def missing(spec: OpSpec, *, floors=None, ops_md=None, aot=None) -> list[str]:
    """The pieces `spec` (a public op's) lacks, each as a sentence naming the file to write or edit."""
    from tests._aot_specs import SPECS as AOT

    floors = json.loads(_read(FLOORS))["ops"] if floors is None else floors
    ops_md = _read(OPS_MD) if ops_md is None else ops_md
    aot = AOT if aot is None else aot
    out = []
    ref = spec.reference
    if not (callable(ref) and ref.__module__.startswith("compactionrl_fast.reference")):
        out.append("reference: a float64 function in compactionrl_fast/reference/")
    built_cpp = _dispatch.cpp_ext() is not None  # without the extension its ops (cpp, cuda) do not exist
    for backend, name in spec.ops.items():
        if not _has_fake(name) and (built_cpp or backend not in ("cpp", "cuda")):
            out.append(f"fake: custom op {name} ({backend}) with a fake implementation (register_op)")
    try:
        cases = spec.cases(torch.device("cpu"))
        if not {"small", "large"} <= set(cases):
            out.append('cases: "small" and "large"')
        for name, kw in cases.items():
            inspect.signature(spec.fn).bind(**kw)
    except Exception as e:  # no cases, or keywords the function does not take
        out.append(f"cases: device -> {{name: keyword arguments of {spec.name}}} ({type(e).__name__}: {e})")
    module = spec.fn.__module__.rsplit(".", 1)[-1]
    tests = [p for p in (f"tests/ops/test_{spec.name}.py", f"tests/ops/test_{module}.py")
             if os.path.exists(os.path.join(ROOT, p)) and spec.name in _read(p)]
    if not tests:
        out.append(f"test: tests/ops/test_{spec.name}.py")
    if not (spec.bench and os.path.exists(os.path.join(ROOT, "benchmarks", f"{spec.bench}.py"))):
        out.append(f"bench: benchmarks/bench_{spec.name}.py (and its name in the spec)")
    if not spec.speed:
        out.append("speed: a key for benchmarks/check_speedups.py (speed_check() in its benchmark)")
    for key in spec.speed:
        if key not in floors:
            out.append(f"floor: {key} in check_speedups_floors.json (check_speedups.py --record --only {key})")
    for module in spec.kernels:
        declared = {row[0] for row in aot.get(module, [])}
        if not declared or _kernel_names(module) - declared:
            out.append(f"aot: AOT specs for every kernel of kernels/{module}.py "
                       f"(none for {sorted(_kernel_names(module) - declared)})")
    if "triton" in spec.ops and not spec.kernels:
        out.append("kernels: the kernels modules its Triton backend launches")
    for name in (spec.name,) + spec.also:
        if f"\n## {name}\n" not in ops_md:
            out.append(f"docs: a '## {name}' section in docs/ops.md")
        if name not in crf.__all__ or name not in ops_pkg.__all__:
            out.append(f"export: {name} in compactionrl_fast/ops/__init__.py's __all__ (compactionrl_fast re-exports it)")
    if support_table() not in ops_md:
        out.append("docs: docs/ops.md's support table (python -m tests.ops.test_registry --update)")
    return out


def support_table() -> str:
    """docs/ops.md's "Backend support by op" table, from the registry: each public op's kernel backends per
    device type, its default first ("triton" on CPU tensors, the interpreter, is for the tests only)."""
    rows = ["| op | CUDA tensors | CPU tensors |", "|---|---|---|"]
    for s in public_specs():
        cols = []
        for device, order in (("cuda", s.cuda), ("cpu", s.cpu)):
            kernels = [NAMES[b] for b in order if b != "torch" and not (device == "cpu" and b == "triton")]
            cols.append(", ".join([kernels[0] + " (default)"] + kernels[1:]) if kernels else "torch (the reference)")
        rows.append(f"| {', '.join(f'`{n}`' for n in (s.name,) + s.also)} | {cols[0]} | {cols[1]} |")
    return "\n".join(rows)


def _ops_md(text):
    from tests.test_cli import replace_block

    return replace_block(text, "ops", support_table())


@pytest.mark.parametrize("op", [s.name for s in public_specs()])
def test_registered_op_has_every_piece(op):
    assert missing(SPECS[op]) == []


def test_every_public_op_is_registered():
    covered = {n for s in public_specs() for n in (s.name,) + s.also}
    unregistered = set(ops_pkg.__all__) - covered - NOT_OPS
    assert not unregistered, f"public ops without an OpSpec (compactionrl_fast/ops/_registry.py): {unregistered}"
    for s in public_specs():
        assert getattr(crf, s.name) is s.fn, s.name


def test_every_table_row_and_triton_module_is_registered():
    assert set(_dispatch.TABLE) == set(SPECS)
    claimed = {m for s in SPECS.values() for m in s.kernels}
    with_kernels = {m.name for m in pkgutil.iter_modules(kernels_pkg.__path__)
                    if not m.name.startswith("_") and _kernel_names(m.name)}
    assert with_kernels <= claimed, f"kernels modules no spec launches: {with_kernels - claimed}"


def test_docs_support_table_is_current():
    text = _read(OPS_MD)
    assert _ops_md(text) == text, \
        "docs/ops.md's support table is out of date: python -m tests.ops.test_registry --update"


def test_missing_notices_each_piece():
    """Each piece removed in turn (a copy of value_loss's spec, the files' contents edited in memory) is named."""
    spec = SPECS["value_loss"]
    floors = json.loads(_read(FLOORS))["ops"]
    ops_md = _read(OPS_MD)
    from tests._aot_specs import SPECS as AOT

    assert missing(spec, floors=floors, ops_md=ops_md, aot=AOT) == []
    broken = {
        "reference": (dict(reference=None), {}),
        "fake": (dict(ops=dict(spec.ops, triton="no_such_op")), {}),
        "cases": (dict(cases=lambda device: {"small": {"no_such_argument": 1}}), {}),
        "test": (dict(name="value_loss2", fn=_renamed(spec.fn, "value_loss2", "compactionrl_fast.ops.v2")), {}),
        "bench": (dict(bench="bench_no_such"), {}),
        "speed": (dict(speed=()), {}),
        "floor": ({}, dict(floors={k: v for k, v in floors.items() if k != "value_loss"})),
        # one kernel of a module without specs (segments.py's weights kernel; value_loss launches it)
        "aot": ({}, dict(aot={k: [r for r in v if r[0] != "_segment_weights_kernel"] for k, v in AOT.items()})),
        "kernels": (dict(kernels=()), {}),
        "docs": ({}, dict(ops_md=ops_md.replace("\n## value_loss\n", "\n## the value loss\n"))),
        "export": (dict(also=("not_exported",)), {}),
    }
    for piece, (fields, files) in broken.items():
        got = missing(dataclasses.replace(spec, **fields), **{**dict(floors=floors, ops_md=ops_md, aot=AOT), **files})
        assert any(m.startswith(piece + ":") for m in got), (piece, got)


def _renamed(fn, name, module):
    def f(*a, **k):
        return fn(*a, **k)
    f.__signature__, f.__name__, f.__module__ = inspect.signature(fn), name, module
    return f


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        print(__doc__)
        raise SystemExit(2)
    with open(OPS_MD) as f:
        text = f.read()
    with open(OPS_MD, "w") as f:
        f.write(_ops_md(text))
    print(f"wrote {OPS_MD}")
