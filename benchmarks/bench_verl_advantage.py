"""The `compaction_sync` advantage step vs verl's own GAE on the same padded V1 batch (CPU, 1 thread).

    PYTHONPATH=build/peers python -m benchmarks.bench_verl_advantage [--quick] [--json PATH]

A batch as verl's V1 trainer holds it: B rows (segments) of L response tokens, ~30% observation tokens and
right padding (bench_adapters.make_batch), keyed `{uid}_{session}_{index}`, 2-3 rows per rollout scattered
through the batch, each row's reward copy on its last token. Rows, called once per round (interleaved):
  compaction_advantages   our step (keys -> rollouts, reward once, place_final_rewards, segment_gae)
  verl gae                verl 0.9.1's core_algos.compute_gae_advantage_return (per row, no rollout link)
"verl/ours" is verl's median over ours (> 1: ours is faster).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import _harness as H
from benchmarks.bench_adapters import make_batch
from compactionrl_fast.integrations.verl.advantages import compaction_advantages

SHAPES = {"128x8192": (128, 8192), "512x2048": (512, 2048)}
QUICK_SHAPES = {"32x1024": (32, 1024)}


def verl_batch(B, L, seed=0):
    """(keys, scores, values, mask): rows of a rollout share its reward on each row's last response token."""
    b = make_batch(B, L, compacted=True, seed=seed)
    mask, values, rid = b["mask"], b["val"], b["ids"]
    g = torch.Generator().manual_seed(seed + 1)
    reward = {r: float(torch.randn(1, generator=g)) for r in set(rid)}
    seen, keys = {}, []
    for r in rid:
        keys.append(f"u{r}_0_{seen.get(r, 0)}")
        seen[r] = seen.get(r, 0) + 1
    scores = torch.zeros(B, L)
    last = L - 1 - mask.flip(-1).float().argmax(-1)  # the last trainable token of each row
    scores[torch.arange(B), last] = torch.tensor([reward[r] for r in rid])
    return keys, scores, values, mask.long()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--budget-s", type=float, default=20.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from verl.trainer.ppo import core_algos

    env = H.environment("cpu")
    rows = []
    for shape, (B, L) in (QUICK_SHAPES if args.quick else SHAPES).items():
        keys, scores, values, mask = verl_batch(B, L)
        cfg = {"gamma": 1.0, "compaction_gae": {}}
        fns = {"compaction_advantages": lambda: compaction_advantages(keys, scores, values, mask, cfg),
               "verl gae": lambda: core_algos.compute_gae_advantage_return(scores, values, mask, 1.0, 0.95)}
        for fn in fns.values():
            fn()  # warm-up
        timing = H.time_round_robin(fns, torch.device("cpu"), budget_s=args.budget_s, min_reps=5)
        for name, t in timing.items():
            rows.append(dict(name=name, shape=shape, **t))
    H.add_speedups(rows, "compaction_advantages", "ours_x")
    for r in rows:
        r["verl_over_ours"] = 1.0 / r.pop("ours_x")
    cols = [("name", "row", ""), ("shape", "shape", ""), ("median_ms", "median ms", ".2f"), ("min_ms", "min ms", ".2f"),
            ("reps", "rounds", "d"), ("verl_over_ours", "row/ours", ".2f")]
    notes = ["1 thread; rounds interleaved; verl's GAE treats each row as its own episode (no rollout link), "
             "ours chains each rollout's rows and places its reward once"]
    H.report("compaction_sync advantage step vs verl's GAE (CPU)", rows, cols, env, notes, args.json)


if __name__ == "__main__":
    main()
