"""Speed check for CI (`make bench-check`): each op's default CPU backend against its naive reference.

    python benchmarks/check_speedups.py [--json build/bench-check.json] [--budget S] [--record] [--only K,..]

One process, 1 thread. For every op below, the op and its reference are called alternately (one call of
each per round, `_harness.time_round_robin`), and the speed-up is the ratio of their median process CPU
times: on a shared machine other processes' load lengthens wall times, the longer calls more, while a
1-thread call's CPU time stays its own work. The check fails (exit code 1) when a speed-up is below its
floor in benchmarks/check_speedups_floors.json, about half the speed-up recorded on the development
machine: a regression of the kind this check exists for (a kernel loop that stopped vectorising: several
times slower) fails, the rounds' noise does not. A ratio does not depend on the machine's speed as an
absolute time would; it can depend on its vector width. Wall medians are in the JSON rows too.

The ops come from the registry (compactionrl_fast/ops/_registry.py): each spec's `speed` keys are timed on the
cases its benchmark module's `speed_check()` gives (benchmarks/<spec.bench>.py: the inputs, the op and the
reference it is compared with, forward + backward where the op has gradients), and judged against the floors
under the same keys. A new op needs no edit here: its speed_check, and its floor (`--record --only KEY`).

`--record` writes the measured speed-ups and floors (half of each) to the floors file, with the git
revision and load they were measured at (with `--only`, those keys' entries, each with its own revision and
load; the others kept). The name is not bench_*.py: `python -m benchmarks` runs those.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compactionrl_fast.ops._registry import SPECS  # noqa: E402

from benchmarks import _harness as H  # noqa: E402

FLOORS = os.path.join(H.REPO, "benchmarks", "check_speedups_floors.json")


def cases(only=None):
    """{speed key: (reference fn, op fn)}: zero-argument callables of one training step's worth of work each, for
    every registered op's `speed` keys (or those in `only`), from its benchmark module's `speed_check()`."""
    made, out = {}, {}
    for spec in SPECS.values():
        for key in spec.speed:
            if only is None or key in only:
                if spec.bench not in made:
                    made[spec.bench] = importlib.import_module(f"benchmarks.{spec.bench}").speed_check()
                out[key] = made[spec.bench][key]
    return out


def measure(budget_s, min_rounds=7, max_rounds=100, only=None):
    """{op: {"ref_ms", "op_ms", ...}}: median CPU ms (and wall ms) of round-robin calls after one warm-up each."""
    H.settle_malloc()
    out = {}
    for op, (ref_fn, op_fn) in cases(only).items():
        print(f"... {op}", file=sys.stderr, flush=True)
        ref_fn(), op_fn()
        t = H.time_round_robin({"ref": ref_fn, "op": op_fn}, torch.device("cpu"), budget_s=budget_s,
                               min_reps=min_rounds, max_reps=max_rounds)
        out[op] = {"ref_ms": t["ref"]["cpu_ms"], "op_ms": t["op"]["cpu_ms"], "rounds": t["op"]["reps"],
                   "ref_wall_ms": t["ref"]["median_ms"], "op_wall_ms": t["op"]["median_ms"]}
    return out


def judge(timings, floors):
    """One row per op: times, speed-up, its floor and "OK" or "FAIL" (also FAIL where no floor is recorded)."""
    rows = []
    for op, t in timings.items():
        speedup = t["ref_ms"] / t["op_ms"]
        floor = floors.get(op, {}).get("floor")
        rows.append({"op": op, **t, "speedup": speedup, "floor": floor,
                     "status": "OK" if floor is not None and speedup >= floor else "FAIL"})
    return rows


def record(path, rows, env, only=False):
    """Write the measured speed-ups, and floors at half of each, to the floors file; returns its "ops". `only`:
    add or replace these rows' entries, each with its own git revision, date and load, and keep the rest."""
    meta = {k: env[k] for k in ("git", "date", "device", "torch", "loadavg_at_start")}
    meta.update(threads=1, command=H.command_line())
    new = {r["op"]: {"speedup": round(r["speedup"], 2), "floor": round(r["speedup"] / 2, 2)} for r in rows}
    if only:
        with open(path) as f:
            saved = json.load(f)
        for entry in new.values():
            entry["recorded"] = meta
        meta, new = saved["recorded"], {**saved["ops"], **new}
    with open(path, "w") as f:
        json.dump({"recorded": meta, "ops": new}, f, indent=1)
        f.write("\n")
    return new


COLUMNS = [("op", "op", ""), ("ref_ms", "ref CPU ms", ".3f"), ("op_ms", "op CPU ms", ".3f"),
           ("speedup", "speed-up", ".2f"), ("floor", "floor", ".2f"), ("rounds", "rounds", "d"), ("status", "", "")]


def main(argv=None, measure=measure):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=os.path.join(H.REPO, "build", "bench-check.json"), help="rows written here")
    p.add_argument("--floors", default=FLOORS, help="floors file (default: benchmarks/check_speedups_floors.json)")
    p.add_argument("--budget", type=float, default=5.0, help="seconds of timing per op (7 to 100 rounds)")
    p.add_argument("--record", action="store_true", help="write the measured speed-ups and floors to --floors")
    p.add_argument("--only", help="comma-separated keys: time (and --record) only these, e.g. a new op's")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the floors are 1-thread ratios
    try:
        env = H.environment("cpu")
        only = args.only.split(",") if args.only else None
        timings = measure(args.budget, only=only)
    finally:
        torch.set_num_threads(threads)
    floors = {}
    if os.path.exists(args.floors):
        with open(args.floors) as f:
            floors = json.load(f)["ops"]
    if args.record:
        floors = record(args.floors, judge(timings, {}), env, only=bool(only))
    rows = judge(timings, floors)
    print(f"{env['device']} | git {env['git']} | {env['date']} | load {env['loadavg_at_start']}")
    print(H.format_table(rows, COLUMNS))
    H.write_json(args.json, rows, command=H.command_line(), env=env, floors=os.path.relpath(args.floors, H.REPO),
                 loadavg_at_end=[round(x, 2) for x in os.getloadavg()])
    failed = [r["op"] for r in rows if r["status"] != "OK"]
    if failed:
        print(f"bench-check FAILED: {', '.join(failed)} below the floor (or none recorded in {args.floors})")
        return 1
    print(f"bench-check passed; rows in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
