"""The CPU ops inside a process that does other work between calls, as a trainer does.

    python benchmarks/bench_real_process.py [--json benchmarks/results/cpu-output-cache.json] [--rounds 15]

The op benchmarks call an op in a tight loop, where glibc hands the freed outputs of one call straight back to
the next. In a trainer other work runs in between, and once glibc has returned the freed blocks to the OS a
call's outputs land on fresh pages: one minor fault per 4 KiB. Here every round does a stand-in for that work
(a small torch loop, then `malloc_trim(0)`, which returns every free block the way glibc's own trimming does
after large frees), then times one call of each op (forward + backward), with the ops' output cache on (the
default) and off (`output_cache(0)`), interleaved in the same process. Rows: median wall ms and minor page
faults per call; "tight" repeats the call with no work in between. 1 thread.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compactionrl_fast as crf  # noqa: E402

from benchmarks import _harness as H  # noqa: E402


def _libc_trim():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return lambda: libc.malloc_trim(0)
    except OSError:  # not glibc: nothing hands pages back this way
        return lambda: None


def other_work(trim):
    """A trainer's in-between work in miniature: small matmuls and activations, then glibc trims its heap."""
    x = torch.randn(128, 128)
    for _ in range(50):
        x = torch.tanh(x @ x.T * 1e-2)
    trim()


def cases():
    """{op: zero-argument fn}: one call, forward + backward, at [128 x 8192] tokens (value head: 8192 x 1024)."""
    from benchmarks import bench_gae, bench_losses

    b = bench_gae.make_batch(128, 8192)
    x = bench_losses.make_inputs(128, 8192)
    lp, v = x["logprobs"].clone().requires_grad_(), x["values"].clone().requires_grad_()
    mk, cu = x["loss_mask"], x["cu_seqlens"]
    h = {k: t.requires_grad_() for k, t in bench_losses.head_inputs(8192, 1024, torch.bfloat16).items()}
    xs = bench_losses.make_inputs(8, 1024)

    def pol():
        loss = crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], mk, cu_seqlens=cu)[0]
        torch.autograd.grad(loss, [lp])

    def val():
        loss = crf.value_loss(v, x["old_values"], x["returns"], mk, clip=0.2, cu_seqlens=cu)[0]
        torch.autograd.grad(loss, [v])

    def head():
        loss = crf.value_head_loss(h["hidden"], h["weight"], h["bias"], xs["old_values"], xs["returns"],
                                   xs["loss_mask"], clip=0.2)[0]
        torch.autograd.grad(loss, [h["hidden"], h["weight"], h["bias"]])

    return {"segment_gae": lambda: bench_gae.run_backend(b, "cpp"), "ppo_policy_loss": pol, "value_loss": val,
            "value_head_loss": head}


def _call(fn):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    return dt * 1e3, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def measure(rounds: int) -> list[dict]:
    trim = _libc_trim()
    limit = crf.output_cache()["limit_bytes"]
    rows = []
    for op, fn in cases().items():
        print(f"... {op}", file=sys.stderr, flush=True)
        fn()
        res = {k: ([], []) for k in ("tight", "cache off", "cache on")}
        for _ in range(rounds):  # the three settings interleaved, so load changes hit them alike
            for setting in ("cache off", "cache on"):
                crf.output_cache(limit_bytes=0 if setting == "cache off" else limit)
                fn()  # the cache (when on) holds this call's blocks, as after any earlier call
                other_work(trim)
                ms, faults = _call(fn)
                res[setting][0].append(ms)
                res[setting][1].append(faults)
            ms, faults = _call(fn)
            res["tight"][0].append(ms)
            res["tight"][1].append(faults)
        crf.output_cache(limit_bytes=limit)
        for setting, (ms, faults) in res.items():
            rows.append({"op": op, "setting": setting, "median_ms": statistics.median(ms), "min_ms": min(ms),
                         "faults": statistics.median(faults), "rounds": rounds})
    return rows


COLUMNS = [("op", "op", ""), ("setting", "setting", ""), ("median_ms", "median ms", ".2f"),
           ("min_ms", "min ms", ".2f"), ("faults", "minor faults / call", ".0f"), ("rounds", "rounds", "d")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write rows (and a .md copy) here")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    env = H.environment("cpu")
    rows = measure(a.rounds)
    notes = ["other work between calls: 50 small matmul+tanh steps, then malloc_trim(0); 'tight': no work between",
             "cache on = the default; cache off = output_cache(limit_bytes=0)"]
    H.report("The CPU ops in a process that does other work between calls", rows, COLUMNS, env, notes, a.json)


if __name__ == "__main__":
    main()
