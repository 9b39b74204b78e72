"""Per-call overhead of the public ops: wall time of the public call vs the bare kernel op at small T.

At T = 4K tokens a kernel takes microseconds, so what a caller pays is validation, dispatch and the eager
torch ops around the kernel. Each row times the public op ("op") and the registered kernel op called
directly with prepared arguments ("kernel"), interleaved in one run; "overhead us" is the difference of
the medians. CPU rows use the default (cpp) backend; on CUDA the default (triton) backend.

    python -m benchmarks.bench_overhead [--tokens 4096] [--device cpu|cuda] [--json PATH]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import compactionrl_fast as crf
from benchmarks import _harness as H
from compactionrl_fast.ops.gae import CROSS_MODES, LAM_ADAPTIVE_ROLLOUT
from compactionrl_fast.ops._reduction import segment_weights


def _batch(T, device, n_seg=8):
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(T, generator=g) < 0.7
    cu = torch.linspace(0, T, n_seg + 1).long()
    cs = torch.tensor([0, n_seg // 2, n_seg])
    x = torch.randn(T, generator=g)
    return {k: v.to(device) for k, v in dict(mask=mask, cu=cu, cs=cs, x=x, y=x * 0.5, z=x.abs()).items()}


def _cases(b, device):
    """(name, public call, bare kernel call) per op."""
    mask, cu, cs, x, y, z = b["mask"], b["cu"], b["cs"], b["x"], b["y"], b["z"]
    ops = torch.ops.compactionrl_fast
    cuda = device.type == "cuda"
    gae_op = ops.segment_gae_triton if cuda else ops.segment_gae
    pl_op = ops.ppo_policy_loss_triton if cuda else ops.ppo_policy_loss
    vl_op = ops.value_loss_triton if cuda else ops.value_loss
    place_op = ops.place_final_rewards_triton if cuda else ops.place_final_rewards
    w = segment_weights(mask, cu, cs, "token-mean")
    return [
        ("segment_gae", lambda: crf.segment_gae(x, y, mask, cu, cs),
         lambda: gae_op(x, y, mask, cu, cs, None, 1.0, 0.0, LAM_ADAPTIVE_ROLLOUT, 1.5, CROSS_MODES["paper"], 1.0)),
        ("place_final_rewards", lambda: crf.place_final_rewards(x[:2], mask, cu, cs),
         lambda: place_op(x[:2], mask, cu, cs, False)),
        ("ppo_policy_loss", lambda: crf.ppo_policy_loss(x, y, z, mask, cu_seqlens=cu, cu_segments=cs),
         lambda: pl_op(x, y, z, mask, None, cu, w, 0.8, 1.2, 3.4e38, float("inf"), False)),
        ("value_loss", lambda: crf.value_loss(x, y, z, mask, cu_seqlens=cu, clip=0.2),
         lambda: vl_op(x, y, z, mask, cu, w, 0.2, False)),
    ]


def _median_us(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="(accepted for the suite runner; sizes are small anyway)")
    p.add_argument("--json", help="write rows to this JSON path (and a markdown table next to it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    env = H.environment(device)
    b = _batch(args.tokens, device)
    rows = []
    for name, public, kernel in _cases(b, device):
        for f in (public, kernel, public, kernel):  # warm-up
            f()
        H._sync(device)
        reps = 50
        t0 = time.perf_counter()
        public()
        kernel()
        H._sync(device)
        reps = max(50, min(5000, int(args.budget / max(time.perf_counter() - t0, 1e-6))))
        op_us, k_us = [], []
        for _ in range(5):  # interleaved rounds
            op_us.append(_median_us(public, reps // 5))
            k_us.append(_median_us(kernel, reps // 5))
        op, k = statistics.median(op_us), statistics.median(k_us)
        rows.append(dict(shape=f"T={args.tokens}", name=name, device=device.type, op_us=op, kernel_us=k,
                         overhead_us=op - k, reps=reps, env=env))
    columns = [("name", "op", ""), ("shape", "shape", ""), ("op_us", "op us", ".1f"), ("kernel_us", "kernel us", ".1f"),
               ("overhead_us", "overhead us", ".1f")]
    notes = [f"{args.threads} thread(s); medians of 5 interleaved rounds; the kernel op is called with prepared "
             "arguments (per-segment weights computed once outside the loop)",
             "CUDA timings here are host wall times of asynchronous launches (no synchronisation per call)"
             if device.type == "cuda" else "CPU: the kernel time includes the kernel's own work at this size"]
    H.report(f"per-call overhead ({device.type})", rows, columns, env, notes, args.json)


if __name__ == "__main__":
    main()
