"""The op registry: each op declares one `OpSpec` next to its code (`SPEC = declare(OpSpec(...))` at the bottom
of ops/<op>.py), and everything that loops over the ops reads `SPECS`: the dispatch table
(`_dispatch.TABLE` is filled from the specs here, nowhere else), the cross-op tests (tests/test_cuda_backends.py,
tests/ops/test_host_sync.py, tests/ops/test_compile.py), the ops snapshot (tests/ops_snapshot.py),
benchmarks/check_speedups.py, docs/ops.md's support table, and tests/ops/test_registry.py, which fails when an
op lacks one of its pieces (docs/adding-an-op.md).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from . import _dispatch


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op: its backends and how the tests, the snapshot and the speed check run it.

    name: the dispatch table's key; for a public op also its function's name in `compactionrl_fast`.
    cuda, cpu: its backends per device type, fastest first ("torch", the float64 reference, last or nearly).
    ops: backend -> the custom op (torch.ops.compactionrl_fast.<name>) that runs it; "torch" never has one.
    fn: the public function (None: an internal row, e.g. the loss ops' reduction weights).
    reference: the float64 reference in compactionrl_fast.reference (what backend="torch" runs).
    cases: device -> {case name: keyword arguments of `fn`}, built on the device without a host copy (so
        FakeTensorMode builds them too); "small" and "large" at least.
    grads: the keyword arguments that receive a gradient (the tests compare those gradients too).
    tol: (rtol, atol) of a kernel backend's outputs and gradients against the reference on `cases`.
    budget: eager torch ops one call may dispatch on CUDA tensors, outputs included (test_host_sync.py).
    kernels: the modules of compactionrl_fast.kernels whose Triton kernels it launches (each declares the
        AOT specs tests/test_aot.py compiles, `AOT`).
    bench: its benchmark script in benchmarks/ (e.g. "bench_losses"; `python -m benchmarks` runs it).
    speed: the keys of benchmarks/check_speedups_floors.json it is timed under (check_speedups.py).
    also: other public functions built on this op's custom ops (value_head_loss on value_head's).
    """
    name: str
    cuda: tuple
    cpu: tuple
    ops: dict
    fn: Optional[Callable] = None
    reference: Optional[Callable] = None
    cases: Optional[Callable] = None
    grads: tuple = ()
    tol: tuple = (1e-5, 1e-6)
    budget: int = 8
    kernels: tuple = ()
    bench: Optional[str] = None
    speed: tuple = ()
    also: tuple = ()


SPECS: dict[str, OpSpec] = {}


def declare(spec: OpSpec) -> OpSpec:
    """Add `spec` to SPECS and its row to the dispatch table."""
    if spec.name in SPECS:
        raise ValueError(f"op {spec.name!r} is declared twice")
    if "torch" in spec.ops:
        raise ValueError(f"{spec.name}: backend 'torch' is the reference, run in Python: no custom op")
    SPECS[spec.name] = spec
    _dispatch.TABLE[spec.name] = {"cuda": spec.cuda, "cpu": spec.cpu, "ops": dict(spec.ops)}
    return spec


def public_specs() -> list[OpSpec]:
    """The registered public ops (those with a function), in declaration order."""
    return [s for s in SPECS.values() if s.fn is not None]


# ---------------------------------------------------------------- inputs for the specs' cases


def wave(n: int, k: float, device, dtype=torch.float32) -> torch.Tensor:
    """[n] values in [-1, 1] that look random (sin of a multiple of the index), made on `device` without a
    generator: the same on CPU and CUDA, and buildable under FakeTensorMode."""
    return torch.sin(torch.arange(n, device=device, dtype=torch.float32) * k + k).to(dtype)


def packed(device, seg_lens, rollout_sizes, *, index_dtype=torch.int64, trainable=0.6):
    """A packed layout on `device`: loss_mask [T] bool (about `trainable` of the tokens; the first token of
    every segment is not), cu_seqlens [S+1] and cu_segments [R+1] of `index_dtype`."""
    cu, cs = [0], [0]
    for n in seg_lens:
        cu.append(cu[-1] + n)
    for r in rollout_sizes:
        cs.append(cs[-1] + r)
    assert cs[-1] == len(seg_lens), "rollout_sizes must add up to the segments"
    T = cu[-1]
    first = set(cu[:-1])
    mask = (wave(T, 2.3, device) < 2 * trainable - 1) & torch.tensor([t not in first for t in range(T)], device=device)
    return dict(loss_mask=mask, cu_seqlens=torch.tensor(cu, dtype=index_dtype, device=device),
                cu_segments=torch.tensor(cs, dtype=index_dtype, device=device))


SMALL = ((5, 0, 1, 7, 3, 12, 2), (3, 1, 3))  # an empty segment, a one-token one; 3 rollouts
LARGE = ((1500, 0, 700, 1, 2100, 40), (2, 4))  # several kernel blocks per segment
