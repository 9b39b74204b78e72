"""Benchmark of `linear_logprobs` (chunked LM-head log-probs) against the naive full-logits composition.

    python benchmarks/bench_linear_logprobs.py [--quick | --full] [--json PATH] [--device cpu|cuda]
    pytest benchmarks/bench_linear_logprobs.py --benchmark-only        (small sizes, a smoke run)

Every row times forward + backward of one loss of the log-probs, gradients to hidden and weight
(`torch.autograd.grad`, so the gradients are allocated inside the timed call), and profiles its peak
memory (outputs and gradients included). Timing is round-robin (one call of every row per round,
median over rounds), because one call takes seconds on a CPU and the load of a shared machine drifts
over minutes; the CPU column is the process CPU time of a call (all threads):

- "naive": `reference.naive_linear_logprobs` in the inputs' dtype: [T, V] logits, float32 log_softmax,
  autograd. The baseline of the "x naive" columns.
- "chunked": `linear_logprobs` (CPU: the PyTorch chunk loop; CUDA: cuBLAS chunk loop + Triton kernels);
  on CUDA also "chunked torch". Backward recomputes the logits: 4 matmuls where naive runs 3.
- "fused": `linear_logprobs_loss`, the loss applied chunk by chunk in the forward: 3 matmuls.
- "+H" rows add an entropy bonus (loss - 0.01 * sum(entropy)), the gradient through the entropy too.
- "liger flce": Liger-Kernel's fused linear cross entropy (sum reduction) where it is installed (CUDA).

The loss is -sum(logp) (cross entropy, sum reduction) at temperature 1, so Liger computes the same
thing. Before timing, every row's loss and gradients are checked against the naive row's.
TFLOP/s counts the 3 matmuls of the naive backward (6 T H V) for every row: a throughput, not the
work each row does.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compactionrl_fast as crf  # noqa: E402
from compactionrl_fast.reference import naive_linear_logprobs  # noqa: E402

from benchmarks import _harness as H  # noqa: E402

ENT_COEF = 0.01
# name: (T, H, V, dtype)
QUICK_SHAPES = {"512x256x8192": (512, 256, 8192, torch.float32)}
SHAPES = {"1024x512x32768": (1024, 512, 32768, torch.float32)}
FULL_SHAPES = {"cpu": {"4096x512x32768": (4096, 512, 32768, torch.float32)},  # the CPU target
               "cuda": {"8192x4096x151936 bf16": (8192, 4096, 151936, torch.bfloat16),
                        "32768x4096x151936 bf16": (32768, 4096, 151936, torch.bfloat16)}}  # the GPU target


def make_inputs(T, Hd, V, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, Hd, generator=gen) * 1.5).to(device, dtype).requires_grad_()
    w = (torch.randn(V, Hd, generator=gen) / Hd**0.5).to(device, dtype).requires_grad_()
    y = torch.randint(0, V, (T,), generator=gen).to(device)
    return h, w, y


# ---------------------------------------------------------------- formulations


def naive_step(h, w, y, entropy):
    out = naive_linear_logprobs(h, w, y, return_entropy=entropy)
    loss = -out[0].sum() - ENT_COEF * out[1].sum() if entropy else -out.sum()
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]))


def chunked_step(h, w, y, entropy, backend="auto"):
    out = crf.linear_logprobs(h, w, y, return_entropy=entropy, backend=backend)
    loss = -out[0].sum() - ENT_COEF * out[1].sum() if entropy else -out.sum()
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]))


def _token_loss(lp, ent, sl):
    return -lp.sum() - ENT_COEF * ent.sum() if ent is not None else -lp.sum()


def fused_step(h, w, y, entropy):
    loss, _, _ = crf.linear_logprobs_loss(h, w, y, _token_loss, with_entropy=entropy)
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]))


def liger_step():
    """Liger-Kernel's fused linear cross entropy, or None where it is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    flce = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def step(h, w, y, entropy):
        loss = flce(w, h, y)
        return (loss.detach(), *torch.autograd.grad(loss, [h, w]))
    return step


def formulations(device):
    rows = [("naive", naive_step, False), ("chunked", chunked_step, False), ("fused", fused_step, False),
            ("naive +H", naive_step, True), ("chunked +H", chunked_step, True), ("fused +H", fused_step, True)]
    if device.type == "cuda":
        rows.insert(2, ("chunked torch", lambda h, w, y, e: chunked_step(h, w, y, e, "torch-tuned"), False))
        liger = liger_step()
        if liger is not None:
            rows.append(("liger flce", liger, False))
    return rows


# ---------------------------------------------------------------- the run


def check(name, got, want, dtype):
    """Raise if a row's loss or gradients differ from the naive row's beyond the dtype's rounding."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for what, a, b in zip(("loss", "d_hidden", "d_weight"), got, want):
        err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        if not err < tol:
            raise AssertionError(f"{name} disagrees with naive on {what}: max-relative error {err:.2e} >= {tol}")


def bench_shape(shape, spec, device, *, budget_s):
    T, Hd, V, dtype = spec
    h, w, y = make_inputs(T, Hd, V, dtype, device)
    config = {"shape": shape, "T": T, "H": Hd, "V": V, "dtype": str(dtype).replace("torch.", "")}
    flops = 6 * T * Hd * V
    fns, entropy_of, want = {}, {}, {}
    for name, step, entropy in formulations(device):
        fn = lambda step=step, entropy=entropy: step(h, w, y, entropy)
        got = fn()  # the check call is also the warm-up
        if name.startswith("naive"):
            want[entropy] = got
        else:
            check(name, got, want[entropy], dtype)
        del got
        fns[name], entropy_of[name] = fn, entropy
    want.clear()
    timings = H.time_round_robin(fns, device, budget_s=budget_s)
    rows = []
    for name, fn in fns.items():
        peak = H.peak_memory(fn, device)
        row = {**config, "entropy": entropy_of[name], "name": name, **timings[name],
               "peak_mib": None if peak is None else peak / 2**20, "env": H.environment(device)}
        row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
        rows.append(row)
    for r in rows:  # ratios to the naive row with the same entropy setting
        base = next(b for b in rows if b["name"] == ("naive +H" if r["entropy"] else "naive"))
        r["time_vs_naive"] = r["median_ms"] / base["median_ms"]
        r["cpu_vs_naive"] = r["cpu_ms"] / base["cpu_ms"]
        if r.get("peak_mib") and base.get("peak_mib"):
            r["mem_saving"] = base["peak_mib"] / r["peak_mib"]
    return rows


COLUMNS = [("shape", "shape", ""), ("name", "formulation", ""), ("median_ms", "median ms", ".1f"),
           ("min_ms", "min ms", ".1f"), ("reps", "reps", "d"), ("tflops", "TFLOP/s", ".3g"),
           ("time_vs_naive", "time / naive", ".2f"), ("cpu_ms", "CPU ms", ".0f"),
           ("cpu_vs_naive", "CPU / naive", ".2f"), ("peak_mib", "peak MiB", ".0f"),
           ("mem_saving", "naive peak / peak", ".1f")]


def run(shapes, device, *, budget_s=1.0):
    H.environment(device)  # the tags (load average included) are taken now, before the first shape
    if device.type == "cpu":
        H.settle_malloc()
    rows = []
    for shape, spec in shapes.items():
        print(f"... {shape}", file=sys.stderr, flush=True)
        rows += bench_shape(shape, spec, device, budget_s=budget_s)
    return rows


def speed_check():
    """benchmarks/check_speedups.py's case (the registry's `speed` key -> (reference fn, op fn)): the CPU chunk
    loop against `reference.naive_linear_logprobs`, forward and backward, T=256, H=256, V=8192."""
    h, w, y = make_inputs(256, 256, 8192, torch.float32, "cpu")
    return {"linear_logprobs": (lambda: naive_step(h, w, y, False), lambda: chunked_step(h, w, y, False))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small shape (seconds), for CI")
    size.add_argument("--full", action="store_true", help="the issue's shapes (CPU: 4096x512x32768 fp32, "
                      "minutes on 2 cores; CUDA: 32768x4096x151936 bf16)")
    p.add_argument("--json", help="write rows to this JSON path (and a markdown table next to it, .md)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row (min 3 reps)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES[device.type] if args.full else SHAPES
    rows = run(shapes, device, budget_s=args.budget)
    env = H.environment(device)
    notes = ["loss = -sum(logp) (- 0.01 * sum(entropy) in '+H' rows), temperature 1, no bias; forward + "
             "backward to hidden and weight per call. Peak: torch allocations during one call minus before "
             "(outputs and gradients included).",
             "chunked: default chunk size (CPU 2^24 logits per chunk, CUDA 2^28); backward recomputes each "
             "chunk's logits (4 matmuls). fused = linear_logprobs_loss (3 matmuls).",
             "TFLOP/s = 6 T H V / time for every row (the naive backward's 3 matmuls)."]
    H.report(f"linear_logprobs benchmark ({device.type})", rows, COLUMNS, env, notes, args.json)
    return rows


# ---------------------------------------------------------------- pytest-benchmark (small sizes)

_SMALL = (256, 128, 4096, torch.float32)


def _small():
    if "x" not in _small.__dict__:
        _small.x = make_inputs(*_SMALL, torch.device("cpu"))
    return _small.x


def test_naive(benchmark):
    benchmark(naive_step, *_small(), False)


def test_chunked(benchmark):
    got = benchmark(chunked_step, *_small(), False)
    check("chunked", got, naive_step(*_small(), False), torch.float32)


def test_fused(benchmark):
    got = benchmark(fused_step, *_small(), False)
    check("fused", got, naive_step(*_small(), False), torch.float32)


def test_chunked_entropy(benchmark):
    got = benchmark(chunked_step, *_small(), True)
    check("chunked +H", got, naive_step(*_small(), True), torch.float32)


if __name__ == "__main__":
    main()
