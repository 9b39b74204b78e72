"""Shared test helpers: random packed batches from shape tables, NaN poisoning, an op recorder, the accuracy rule
of segment_gae."""
from __future__ import annotations

import collections
import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# A segment is (length, mask kind): "rand" ~70% trainable in runs (like assistant turns between
# observations), "none" no trainable token, "all" every token trainable.
# A rollout is a list of segments; a case is a list of rollouts.
SHAPE_TABLE = {
    "single_token": [[(1, "all")], [(1, "all"), (1, "all")]],
    "empty_segments": [[(0, "rand"), (5, "rand"), (0, "rand")], [(0, "rand")], [(3, "all"), (0, "all")]],
    "no_trainable": [[(7, "none"), (9, "rand")], [(4, "rand"), (6, "none")], [(5, "none")]],
    "odd_lengths": [[(63, "rand"), (1, "all"), (500, "rand")], [(17, "rand")], [(1000, "rand"), (2, "none")]],
    "long_multiblock": [[(2500, "rand"), (70, "rand"), (1300, "rand"), (5, "all")], [(3001, "all")]],
    "four_segments": [[(40, "rand"), (13, "all"), (55, "rand"), (9, "all")], [(30, "rand"), (8, "all")],
                      [(25, "rand")]],
}


def random_case(seed: int, n_rollouts: int = 6, max_len: int = 400):
    """A random case: 1..4 segments per rollout, lengths incl. 0 and 1, some segments untrainable."""
    rng = random.Random(seed)
    case = []
    for _ in range(n_rollouts):
        segs = []
        for _ in range(rng.randint(1, 4)):
            n = rng.choice([0, 1, 2, rng.randint(3, max_len), rng.randint(3, max_len)])
            segs.append((n, rng.choice(["rand", "rand", "rand", "none", "all"])))
        case.append(segs)
    return case


def make_mask(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "all":
        return torch.ones(n, dtype=torch.bool)
    if kind == "none":
        return torch.zeros(n, dtype=torch.bool)
    # runs of trainable and observation tokens, about 70% trainable
    out = torch.zeros(n, dtype=torch.bool)
    t, on = 0, bool(torch.rand((), generator=gen) < 0.7)
    while t < n:
        run = int(torch.randint(1, 40, (), generator=gen))
        out[t:t + run] = on
        t += run
        on = bool(torch.rand((), generator=gen) < (0.8 if not on else 0.35))
    return out


def packed_batch(case, *, seed: int = 0, index_dtype=torch.int32, device="cpu"):
    """Build the packed layout (docs/layout.md) for a case: rewards, values, loss_mask [T], cu_seqlens [S+1], cu_segments [R+1]."""
    gen = torch.Generator().manual_seed(seed)
    masks, seq, segs = [], [0], [0]
    for rollout in case:
        for n, kind in rollout:
            masks.append(make_mask(n, kind, gen))
            seq.append(seq[-1] + n)
        segs.append(segs[-1] + len(rollout))
    mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    T = mask.numel()
    rewards = torch.randn(T, generator=gen) * (torch.rand(T, generator=gen) < 0.2)
    values = torch.randn(T, generator=gen)
    out = dict(rewards=rewards, values=values, loss_mask=mask,
               cu_seqlens=torch.tensor(seq, dtype=index_dtype), cu_segments=torch.tensor(segs, dtype=index_dtype))
    return {k: v.to(device) for k, v in out.items()}


def check_gae_accuracy(adv, ret, inputs, label="", **kw):
    """The accuracy rule of segment_gae (tests/ops/test_gae_accuracy.py): against the float64 reference on
    `inputs` (the op's tensor arguments), each output's error is at most twice the float32 sequential loop's,
    plus one float32 ulp of the op's largest output; positions outside the loss mask are 0.

    One ulp of the largest of both outputs: a return is an advantage plus a value, so the advantage's float32
    rounding reaches the return unchanged, however small the return (with a ulp of the largest return instead,
    tiny batches fail on the order of operations alone, e.g. single-token segments where the loop's error is
    0.03 ulp of the values by chance)."""
    from compactionrl_fast.reference import gae as ref

    cpu = {k: v.cpu() for k, v in inputs.items()}
    want, loop = ref.segment_gae(**cpu, **kw), ref.segment_gae(**cpu, **kw, dtype=torch.float32)
    rounding = max(w.abs().max().item() for w in want) * 2.0**-23
    for name, got, w, lp in zip(("advantages", "returns"), (adv, ret), want, loop):
        err, e32 = (got.cpu().double() - w).abs().max().item(), (lp - w).abs().max().item()
        assert err <= 2 * e32 + rounding, \
            f"{label} {name}: error {err:.3g} > 2 x float32 loop error {e32:.3g} + {rounding:.3g} ({kw})"
    off = ~cpu["loss_mask"]
    assert (adv.cpu()[off] == 0).all() and (ret.cpu()[off] == 0).all(), label


class RecordOps(TorchDispatchMode):
    """Records the ops a call dispatches inside the `with`: `ops` counts every aten/custom op by name (prim.*
    device queries are not ops), `calls` holds [(op name, args)] of the compactionrl_fast custom ops."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not name.startswith("prim."):
            self.ops[name] += 1
        if name.startswith("compactionrl_fast."):
            self.calls.append((name, args))
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.ops.values())

    def args(self, name):
        """The arguments of the one call of op `name` (e.g. "ppo_policy_loss")."""
        got = [a for f, a in self.calls if f == f"compactionrl_fast.{name}.default"]
        assert len(got) == 1, self.calls
        return got[0]


def stub_launches(monkeypatch, module, names) -> list:
    """Replace the Triton kernels `names` of `module` by stubs; returns the list each launch appends its
    (kernel name, grid, keyword arguments) to."""
    launches = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs))

    for name in names:
        monkeypatch.setattr(module, name, Stub(name))
    return launches


def build_host_lib(out_dir, source: str, defines: dict, name: str):
    """g++ build of tests/ops/<source> (a CUDA kernel run on the host through tests/cuda_host_emu.h) into
    out_dir/<name>, with -D<key>=<value> for `defines`; returns the ctypes library (skips without g++)."""
    import ctypes
    import os
    import shutil
    import subprocess

    import pytest

    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    from compactionrl_fast.kernels import modes

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    modes.write_header(root)  # csrc/common/modes.h is generated, not committed (setup.py writes it too)
    out = os.path.join(str(out_dir), name)
    # -fno-gnu-unique: each build keeps its own template statics (the emulated shared memory)
    subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-fno-gnu-unique",
                    *(f"-D{k}={v}" for k, v in defines.items()), "-I", os.path.join(root, "csrc"),
                    "-I", os.path.join(root, "tests"), os.path.join(root, "tests", "ops", source), "-o", out],
                   check=True)
    return ctypes.CDLL(out)
