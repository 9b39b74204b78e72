"""Speed check for CI (`make bench-check`): each op's default CPU backend against its naive reference.

    python benchmarks/check_speedups.py [--json build/bench-check.json] [--budget S] [--record]

One process, 1 thread. For every op below, the op and its reference are called alternately (one call of
each per round, `_harness.time_round_robin`), and the speed-up is the ratio of their median process CPU
times: on a shared machine other processes' load lengthens wall times, the longer calls more, while a
1-thread call's CPU time stays its own work. The check fails (exit code 1) when a speed-up is below its
floor in benchmarks/check_speedups_floors.json, about half the speed-up recorded on the development
machine: a regression of the kind this check exists for (a kernel loop that stopped vectorising: several
times slower) fails, the rounds' noise does not. A ratio does not depend on the machine's speed as an
absolute time would; it can depend on its vector width. Wall medians are in the JSON rows too.

Ops (forward + backward where the op has gradients), inputs from the benchmark scripts' makers:
- segment_gae: cpp against `reference.masked_gae`, the per-step loop trainers run on the padded layout
  (the per-token float64 oracle is too slow at a size where the kernel, not the call overhead, counts);
- ppo_policy_loss, value_loss: cpp against the float64 references, token-mean with cu_seqlens;
- value_head_loss: bf16 hidden (the C++ head) against `reference.value_head` + `reference.value_loss`;
- linear_logprobs: the CPU chunk loop against `reference.naive_linear_logprobs`;
- place_final_rewards: cpp against the torch-tuned backend (a cummax over the tokens; the float64 oracle,
  backend "torch", loops over tokens in Python, too slow at this size), rollouts of 4 segments.

`--record` writes the measured speed-ups and floors (half of each) to the floors file, with the git
revision and load they were measured at. The name is not bench_*.py: `python -m benchmarks` runs those.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compactionrl_fast as crf  # noqa: E402
from compactionrl_fast import reference as ref  # noqa: E402
from compactionrl_fast.reference.gae import masked_gae  # noqa: E402

from benchmarks import _harness as H  # noqa: E402

FLOORS = os.path.join(H.REPO, "benchmarks", "check_speedups_floors.json")
CLIP = 0.2


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


def cases():
    """{op: (reference fn, op fn)}: zero-argument callables of one training step's worth of work each."""
    from benchmarks import bench_gae, bench_linear_logprobs, bench_losses

    out = {}
    b = bench_gae.make_batch(64, 2048)  # 128K tokens
    pad = [bench_gae.to_padded(b[k], b["cu_seqlens"])[0] for k in ("rewards", "values")]
    mask = bench_gae.to_padded(b["loss_mask"], b["cu_seqlens"], fill=False)[0]
    out["segment_gae"] = (lambda: masked_gae(*pad, mask, bench_gae.GAMMA, bench_gae.LAM),
                          lambda: bench_gae.run_backend(b, "cpp"))

    x = bench_losses.make_inputs(32, 8192)  # 256K tokens
    lp, v = x["logprobs"].clone().requires_grad_(), x["values"].clone().requires_grad_()
    mk, cu = x["loss_mask"], x["cu_seqlens"]
    pol = dict(cu_seqlens=cu, clip_low=CLIP, clip_high=CLIP)
    out["ppo_policy_loss"] = (
        lambda: _grads(ref.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], mk, **pol)[0], [lp]),
        lambda: _grads(crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], mk, **pol)[0], [lp]))
    out["value_loss"] = (
        lambda: _grads(ref.value_loss(v, x["old_values"], x["returns"], mk, clip=CLIP, cu_seqlens=cu)[0], [v]),
        lambda: _grads(crf.value_loss(v, x["old_values"], x["returns"], mk, clip=CLIP, cu_seqlens=cu)[0], [v]))

    T, Hd = 8192, 1024
    xs = bench_losses.make_inputs(8, T // 8)
    h = {k: t.requires_grad_() for k, t in bench_losses.head_inputs(T, Hd, torch.bfloat16).items()}
    leaves = [h["hidden"], h["weight"], h["bias"]]
    hv = (xs["old_values"], xs["returns"], xs["loss_mask"])
    out["value_head_loss"] = (
        lambda: _grads(ref.value_loss(ref.value_head(*leaves), *hv, clip=CLIP)[0], leaves),
        lambda: _grads(crf.value_head_loss(*leaves, *hv, clip=CLIP)[0], leaves))

    bp = bench_gae.make_batch(32, 4096, segments=4)  # 128K tokens
    place = (torch.randn(32, generator=torch.Generator().manual_seed(0)), bp["loss_mask"], bp["cu_seqlens"],
             bp["cu_segments"])
    out["place_final_rewards"] = (lambda: crf.place_final_rewards(*place, backend="torch-tuned"),
                                  lambda: crf.place_final_rewards(*place))

    hl, wl, yl = bench_linear_logprobs.make_inputs(256, 256, 8192, torch.float32, "cpu")
    out["linear_logprobs"] = (lambda: bench_linear_logprobs.naive_step(hl, wl, yl, False),
                              lambda: bench_linear_logprobs.chunked_step(hl, wl, yl, False))
    return out


def measure(budget_s, min_rounds=7, max_rounds=100):
    """{op: {"ref_ms", "op_ms", ...}}: median CPU ms (and wall ms) of round-robin calls after one warm-up each."""
    H.settle_malloc()
    out = {}
    for op, (ref_fn, op_fn) in cases().items():
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


def record(path, rows, env):
    """Write the measured speed-ups, and floors at half of each, to the floors file; returns its "ops"."""
    ops = {r["op"]: {"speedup": round(r["speedup"], 2), "floor": round(r["speedup"] / 2, 2)} for r in rows}
    meta = {k: env[k] for k in ("git", "date", "device", "torch", "loadavg_at_start")}
    with open(path, "w") as f:
        json.dump({"recorded": {**meta, "threads": 1, "command": H.command_line()}, "ops": ops}, f, indent=1)
        f.write("\n")
    return ops


COLUMNS = [("op", "op", ""), ("ref_ms", "ref CPU ms", ".3f"), ("op_ms", "op CPU ms", ".3f"),
           ("speedup", "speed-up", ".2f"), ("floor", "floor", ".2f"), ("rounds", "rounds", "d"), ("status", "", "")]


def main(argv=None, measure=measure):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=os.path.join(H.REPO, "build", "bench-check.json"), help="rows written here")
    p.add_argument("--floors", default=FLOORS, help="floors file (default: benchmarks/check_speedups_floors.json)")
    p.add_argument("--budget", type=float, default=5.0, help="seconds of timing per op (7 to 100 rounds)")
    p.add_argument("--record", action="store_true", help="write the measured speed-ups and floors to --floors")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the floors are 1-thread ratios
    try:
        env = H.environment("cpu")
        timings = measure(args.budget)
    finally:
        torch.set_num_threads(threads)
    floors = {}
    if os.path.exists(args.floors):
        with open(args.floors) as f:
            floors = json.load(f)["ops"]
    if args.record:
        floors = record(args.floors, judge(timings, {}), env)
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
