"""verl's `compaction` policy loss (compute_policy_loss_compaction) against `ppo_policy_loss` on the same
padded batch flattened to [B*L], forward + backward, 1 thread, per response-mask dtype.

    python -m benchmarks.bench_verl_policy_loss [--quick] [--rounds N] [--json PATH]

Batch: bench_adapters.make_batch (one row per segment, ~30% observation tokens, right padding). Rows, called
once per round (interleaved, `_harness.time_round_robin`):
  op flat                 ppo_policy_loss on the flattened rows with a bool mask (the baseline)
  adapter, <dtype> mask   the adapter with the mask in that dtype (verl 0.9.1 passes bool; int64 and float32
                          are what other callers and verl's own batches hold)
  int64 mask, check before  the elementwise 0/1 check the adapter ran before (`(m != 0) & (m != 1)`, `.any()`,
                          `m != 0`) followed by the adapter on the bool mask: the "before" of the int64 row
"x op" is a row's median over the baseline's median in the same rounds.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import _harness as H
from benchmarks.bench_adapters import make_batch
from compactionrl_fast.integrations import verl
from compactionrl_fast.ops import ppo_policy_loss

SHAPES = {"128x8192": (128, 8192)}
QUICK_SHAPES = {"32x1024": (32, 1024)}
CFG = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}


def rows_for(B, L):
    b = make_batch(B, L, compacted=False)
    mask = b["mask"]

    def op_flat():
        x = b["logp"].clone().requires_grad_()
        loss, _ = ppo_policy_loss(x.view(-1), b["old"].view(-1), b["adv"].view(-1), mask.view(-1), clip_low=0.2,
                                  clip_high=0.2, dual_clip=3.0)
        loss.backward()

    def adapter(m, check_before=False):
        def run():
            mm = m
            if check_before:
                if bool(((mm != 0) & (mm != 1)).any()):
                    raise ValueError("not 0/1")
                mm = mm != 0
            x = b["logp"].clone().requires_grad_()
            loss, _ = verl.compute_policy_loss_compaction(b["old"], x, b["adv"], mm, "token-mean", CFG)
            loss.backward()
        return run

    return {"op flat": op_flat, "adapter, bool mask": adapter(mask), "adapter, int64 mask": adapter(mask.long()),
            "adapter, float32 mask": adapter(mask.float()),
            "int64 mask, check before": adapter(mask.long(), check_before=True)}


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
    for r in rows:
        r["x_op"] = 1.0 / r.pop("speed")
    cols = [("name", "row", ""), ("shape", "shape", ""), ("median_ms", "median ms", ".3f"), ("min_ms", "min ms", ".3f"),
            ("reps", "rounds", "d"), ("x_op", "x op", ".3f")]
    notes = ["1 thread, forward + backward, float32, token-mean, clip 0.2, dual clip 3; rounds interleaved"]
    H.report("verl compaction policy loss vs ppo_policy_loss on the flattened rows (CPU)", rows, cols, env, notes,
             args.json)


if __name__ == "__main__":
    main()
