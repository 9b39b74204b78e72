"""place_final_rewards against segment_gae, the two steps of the advantage computation, per backend.

    python -m benchmarks.bench_place [--quick] [--threads 1] [--device cpu|cuda] [--json PATH]

Batches from bench_gae.make_batch: rollouts of 4 segments (exec, summary, exec, summary), ~70% trainable
tokens, 131K and 1M tokens. For each size, every formulation is called once per round (interleaved,
`_harness.time_round_robin`); "x GAE" is a row's median over the median of `segment_gae` with the paper's
defaults on the device's default backend, measured in the same rounds (the goal: at most 1). Rows:
placement per backend ("cpp" C++, "torch-tuned" the cummax composite; on CUDA tensors "triton" and "cuda"; the
Triton interpreter is no speed number and is left out), both modes, and "searchsorted (before)", the torch
composite placement ran before the kernels (a `searchsorted` over every token), kept here as the baseline.
"""
from __future__ import annotations

import argparse

import torch

import compactionrl_fast as crf
from benchmarks import _harness as H
from benchmarks.bench_gae import make_batch
from compactionrl_fast.kernels.modes import REWARD_PLACEMENT
from compactionrl_fast.ops._dispatch import TABLE, available

SHAPES = {"131K": (32, 4096), "1M": (256, 4096)}  # (rollouts, tokens per rollout), 4 segments each
QUICK_SHAPES = {"16K": (8, 2048)}


def searchsorted_placement(rollout_rewards, loss_mask, cu_seqlens, cu_segments, stitched):
    """The torch composite of place_final_rewards before this benchmark's kernels (the baseline): each token's
    segment by `searchsorted`, each segment's last trainable token by a scatter-amax over [T]."""
    T, S, R = loss_mask.numel(), cu_seqlens.numel() - 1, cu_segments.numel() - 1
    out = torch.zeros(T + 1, dtype=torch.float32, device=loss_mask.device)
    idx = torch.arange(max(T, S, R), device=loss_mask.device)
    pos = idx[:T]
    seg_of_tok = torch.searchsorted(cu_seqlens[1:].clamp(0, T), pos, right=True).clamp_(max=S - 1)
    last = torch.full((S,), -1, dtype=torch.long, device=loss_mask.device).scatter_reduce_(
        0, seg_of_tok, torch.where(loss_mask, pos, -1), "amax")
    roll_of_seg = torch.searchsorted(cu_segments[1:].clamp(0, S), idx[:S], right=True).clamp_(max=R - 1)
    if stitched:
        last = torch.full((R,), -1, dtype=torch.long, device=loss_mask.device).scatter_reduce_(
            0, roll_of_seg, last, "amax")
        roll_of_seg = idx[:R]
    out.index_put_((torch.where(last >= 0, last, T),), rollout_rewards.float()[roll_of_seg])
    return out[:T]


def formulations(b, rr, device):
    """{name: fn}: the GAE baseline first, then the placements."""
    args = (rr, b["loss_mask"], b["cu_seqlens"], b["cu_segments"])
    fns = {"segment_gae (paper defaults)": lambda: crf.segment_gae(b["rewards"], b["values"], b["loss_mask"],
                                                                   b["cu_seqlens"], b["cu_segments"])}
    # the float64 reference (a Python loop) and the Triton interpreter are no speed numbers
    backends = [k for k in available(device) if k in TABLE["place_final_rewards"][device.type] and k != "torch"
                and not (k == "triton" and device.type != "cuda")]
    for backend in backends:
        for mode in REWARD_PLACEMENT:
            fns[f"place {backend} {mode}"] = lambda backend=backend, mode=mode: crf.place_final_rewards(
                *args, mode, backend=backend)
    for mode in ("paper", "stitched"):
        fns[f"place searchsorted (before) {mode}"] = lambda mode=mode: searchsorted_placement(*args, mode == "stitched")
    return fns


def run(shapes, device, budget_s):
    rows = []
    for shape, (rollouts, length) in shapes.items():
        b = make_batch(rollouts, length, segments=4, device=device)
        rr = torch.randn(rollouts, generator=torch.Generator().manual_seed(1)).to(device)
        fns = formulations(b, rr, device)
        want = searchsorted_placement(rr, b["loss_mask"], b["cu_seqlens"], b["cu_segments"], False)
        for name, fn in fns.items():  # the warm-up, and every placement checked against the baseline
            out = fn()
            if name.startswith("place") and name.endswith("paper"):
                assert torch.equal(out, want), name
        t = H.time_round_robin(fns, device, budget_s=budget_s, min_reps=7, max_reps=200)
        gae_ms = t["segment_gae (paper defaults)"]["median_ms"]
        for name, timing in t.items():
            rows.append({"shape": shape, "tokens": b["loss_mask"].numel(), "rollouts": rollouts,
                         "segments": b["cu_seqlens"].numel() - 1, "name": name, **timing,
                         "x_gae": timing["median_ms"] / gae_ms})
    return rows


COLUMNS = [("shape", "shape", ""), ("name", "formulation", ""), ("median_ms", "median ms", ".3f"),
           ("min_ms", "min ms", ".3f"), ("cpu_ms", "CPU ms", ".3f"), ("x_gae", "x GAE", ".2f"), ("reps", "rounds", "d")]


def speed_check():
    """benchmarks/check_speedups.py's case (the registry's `speed` key -> (reference fn, op fn)): cpp against the
    torch-tuned backend (a cummax over the tokens; the float64 oracle, backend "torch", loops over tokens in
    Python, too slow at this size), 32 rollouts of 4 segments, 128K tokens."""
    b = make_batch(32, 4096, segments=4)
    args = (torch.randn(32, generator=torch.Generator().manual_seed(0)), b["loss_mask"], b["cu_seqlens"],
            b["cu_segments"])
    return {"place_final_rewards": (lambda: crf.place_final_rewards(*args, backend="torch-tuned"),
                                    lambda: crf.place_final_rewards(*args))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one small shape (seconds), for CI")
    p.add_argument("--json", help="write rows to this JSON path (and a markdown table next to it, .md)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=3.0, help="seconds of timing per shape (min 7 rounds)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = run(QUICK_SHAPES if args.quick else SHAPES, device, args.budget)
    env = H.environment(device)
    notes = [f"{torch.get_num_threads()} thread(s); medians of interleaved rounds; 'x GAE' = median / the median "
             "of segment_gae (paper defaults, default backend) in the same rounds.",
             "Batches: bench_gae.make_batch(rollouts, 4096, segments=4): 4 segments per rollout, ~70% trainable.",
             "'searchsorted (before)': the torch composite the op ran before its kernels, kept as the baseline."]
    H.report(f"place_final_rewards vs segment_gae ({device.type})", rows, COLUMNS, env, notes, args.json)
    return rows


if __name__ == "__main__":
    main()
