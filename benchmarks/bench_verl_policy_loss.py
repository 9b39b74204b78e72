"""verl's `compaction` policy loss (compute_policy_loss_compaction) against `ppo_policy_loss` on the same
padded batch flattened to [B*L], forward + backward, 1 thread, per response-mask dtype.

    python -m benchmarks.bench_verl_policy_loss [--quick] [--rounds N] [--json PATH]

Batch: bench_adapters.make_batch (one row per segment, ~30% observation tokens, right padding). Rows, called
once per round (interleaved, `_harness.time_round_robin`):
  op flat                 ppo_policy_loss on the flattened rows with a bool mask (the baseline)
  adapter, <dtype> mask   the adapter with the mask in that dtype (verl 0.9.1 passes bool; int64 and float32
                          are what other callers and verl's own batches hold)
  <dtype> mask, torch check  the adapter without the one-pass C++ conversion (`mask_to_bool`): `to(bool)` and
                          a reduction check (aminmax for int64, `== 1` compared for float32), and the op counts
                          the mask again: the "before" of the int64 and float32 rows
"x op" is a row's median over the baseline's median in the same rounds; "x op (cpu)" the same with the process
CPU time of each call (less moved by other jobs on a shared machine than the wall clock). With ATEN_CPU_CAPABILITY or
MKL_ENABLE_INSTRUCTIONS set (e.g. `=avx2` / `=AVX2` to stand in for an AVX2-only CPU), the notes say so.
"""
from __future__ import annotations

import argparse
import os

import torch

from benchmarks import _harness as H
from benchmarks.bench_adapters import make_batch
from compactionrl_fast.integrations import verl
from compactionrl_fast.ops import _mask
from compactionrl_fast.ops import ppo_policy_loss

SHAPES = {"128x8192": (128, 8192)}
QUICK_SHAPES = {"32x1024": (32, 1024)}
CFG = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}


def rows_for(B, L):
    b = make_batch(B, L, compacted=False)
    mask = b["mask"]

    def op(m):
        def run():  # the op takes a bool mask: a caller holding an int or float one converts it first
            x = b["logp"].clone().requires_grad_()
            loss, _ = ppo_policy_loss(x.view(-1), b["old"].view(-1), b["adv"].view(-1), m.view(-1).bool(),
                                      clip_low=0.2, clip_high=0.2, dual_clip=3.0)
            loss.backward()
        return run

    def adapter(m, one_pass=True):
        def run():
            x = b["logp"].clone().requires_grad_()
            saved, _mask._HAS_MASK_OP = _mask._HAS_MASK_OP, _mask._HAS_MASK_OP and one_pass
            try:
                loss, _ = verl.compute_policy_loss_compaction(b["old"], x, b["adv"], m, "token-mean", CFG)
            finally:
                _mask._HAS_MASK_OP = saved
            loss.backward()
        return run

    return {"op flat": op(mask), "op flat, int64 mask .bool()": op(mask.long()),
            "op flat, float32 mask .bool()": op(mask.float()),
            "adapter, bool mask": adapter(mask), "adapter, int64 mask": adapter(mask.long()),
            "adapter, float32 mask": adapter(mask.float()),
            "int64 mask, torch check": adapter(mask.long(), one_pass=False),
            "float32 mask, torch check": adapter(mask.float(), one_pass=False)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=200, help="interleaved rounds at most")
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    H.settle_malloc()
    env = H.environment("cpu")
    rows = []
    for shape, (B, L) in (QUICK_SHAPES if args.quick else SHAPES).items():
        fns = rows_for(B, L)
        for fn in fns.values():
            fn()  # warm-up
        timing = H.time_round_robin(fns, torch.device("cpu"), budget_s=args.budget_s, min_reps=10,
                                    max_reps=args.rounds)
        rows += [dict(name=n, shape=shape, **t) for n, t in timing.items()]
    H.add_speedups(rows, "op flat", "speed")
    base_cpu = {r["shape"]: r["cpu_ms"] for r in rows if r["name"] == "op flat"}
    for r in rows:
        r["x_op"] = 1.0 / r.pop("speed")
        r["x_op_cpu"] = r["cpu_ms"] / base_cpu[r["shape"]]
        same = next((f"op flat, {d} mask .bool()" for d in ("int64", "float32") if f"{d} mask" in r["name"]),
                    "op flat")  # the op given the same mask, converted as a caller of the op must
        r["x_same_cpu"] = r["cpu_ms"] / next(q["cpu_ms"] for q in rows
                                             if q["shape"] == r["shape"] and q["name"] == same)
    cols = [("name", "row", ""), ("shape", "shape", ""), ("median_ms", "median ms", ".3f"), ("min_ms", "min ms", ".3f"),
            ("cpu_ms", "cpu ms", ".3f"), ("reps", "rounds", "d"), ("x_op", "x op", ".3f"),
            ("x_op_cpu", "x op (cpu)", ".3f"), ("x_same_cpu", "x op, same mask (cpu)", ".3f")]
    notes = ["1 thread, forward + backward, float32, token-mean, clip 0.2, dual clip 3; rounds interleaved"]
    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS") if os.environ.get(k)}
    if isa:
        notes.append("instruction sets limited: " + ", ".join(f"{k}={v}" for k, v in isa.items())
                     + " (torch's own kernels; this package's C++ kernels pick AVX2 or the baseline at run time)")
    if not _mask._HAS_MASK_OP:
        notes.append("the extension lacks mask_to_bool: every row uses the torch check")
    H.report("verl compaction policy loss vs ppo_policy_loss on the flattened rows (CPU)", rows, cols, env, notes,
             args.json)


if __name__ == "__main__":
    main()
