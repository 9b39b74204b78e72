"""A/B of the CPU loss ops between two built checkouts (issue 27's "at least the old speed" check).

    python benchmarks/experiments/losses_ab.py /path/to/old-checkout /path/to/new-checkout [--rounds 4]

Each checkout must have its extension built in place (`make build` there). One process per checkout and round,
alternated old / new / old / new ..., each timing round-robin calls of the public ops (fwd + bwd, 1 thread) on
bench_losses' [128 x 8192] packed batch with cu_seqlens, and reporting the median process CPU ms per call.
Prints one row per op with each build's range over the rounds.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROLLOUTS, LENGTH = 128, 8192


def make_inputs(torch, rollouts, length, seed=0):
    """bench_losses.make_inputs, repeated here: the old checkout's benchmarks may differ."""
    g = torch.Generator().manual_seed(seed)
    T = rollouts * length
    run = torch.randint(1, 200, (T // 50 + 8,), generator=g)
    on = torch.arange(run.numel()) % 10 < 7
    mask = torch.repeat_interleave(on, run)[:T]
    mask = torch.cat([mask, torch.ones(T - mask.numel(), dtype=torch.bool)])
    old = torch.randn(T, generator=g) * 0.8 - 2.0
    ret = torch.randn(T, generator=g)
    old_v = ret + 0.5 * torch.randn(T, generator=g)
    return dict(logprobs=old + 0.3 * torch.randn(T, generator=g), old_logprobs=old,
                advantages=torch.randn(T, generator=g), values=old_v + 0.3 * torch.randn(T, generator=g),
                old_values=old_v, returns=ret, loss_mask=mask,
                cu_seqlens=torch.arange(0, T + 1, length, dtype=torch.int32))


def child(calls):
    """In a checkout (cwd): {op: median CPU ms} of `calls` round-robin calls."""
    sys.path.insert(0, os.getcwd())
    import torch
    torch.set_num_threads(1)
    import compactionrl_fast as crf
    x = make_inputs(torch, ROLLOUTS, LENGTH)
    lp, v = x["logprobs"].clone().requires_grad_(), x["values"].clone().requires_grad_()
    kw = dict(cu_seqlens=x["cu_seqlens"])

    def policy(bwd):
        loss, _ = crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], x["loss_mask"], **kw)
        if bwd:
            loss.backward()

    def value(clip):
        loss, _ = crf.value_loss(v, x["old_values"], x["returns"], x["loss_mask"], clip=clip, **kw)
        loss.backward()

    ops = {"ppo_policy_loss fwd+bwd": lambda: policy(True), "ppo_policy_loss fwd": lambda: policy(False),
           "value_loss clip fwd+bwd": lambda: value(0.2), "value_loss fwd+bwd": lambda: value(None)}
    for f in ops.values():
        for _ in range(3):
            f()
    times = {k: [] for k in ops}
    for _ in range(calls):
        for k, f in ops.items():
            lp.grad = v.grad = None
            t0 = time.process_time_ns()
            f()
            times[k].append((time.process_time_ns() - t0) / 1e6)
    print(json.dumps({k: sorted(t)[len(t) // 2] for k, t in times.items()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.calls)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = {"old": [], "new": []}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for r in range(a.rounds):
        for name in ("old", "new"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), a.old, a.new, "--child",
                                  "--calls", str(a.calls)], cwd=getattr(a, name), env=env, check=True,
                                 capture_output=True, text=True).stdout
            res[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {res[name][-1]}", flush=True)
    print(f"load average after: {os.getloadavg()}\n")
    print("| median CPU ms per call, range over rounds | old | new |\n|---|---|---|")
    for op in res["old"][0]:
        cells = [f"{min(d[op] for d in res[n]):.2f}-{max(d[op] for d in res[n]):.2f}" for n in ("old", "new")]
        print(f"| {op} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
