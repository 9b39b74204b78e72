"""Benchmark of the fused losses (forward + backward) against the naive PyTorch composition trainers write.

    python benchmarks/bench_losses.py [--quick | --full] [--json PATH] [--device cpu|cuda] [--compile]
    pytest benchmarks/bench_losses.py --benchmark-only        (small sizes, a smoke run)

Every row is one training step's worth of work: forward, `backward()`, and the gradient left in the
input's `.grad` (cleared before each call, so each call allocates it afresh as a training step does).

- policy: `ppo_policy_loss` (token-mean, clip 0.2, metrics from the same pass) against the naive
  composition `exp` / `clamp` / `maximum` / masked mean with autograd, with the same metrics (clip
  fraction, approx KL, ratio max, computed under no_grad as trainers log them) and without them
  ("loss only"). Also the fused op with segment-mean and with dual clip + truncated IS weights.
- value: `value_loss` (clip 0.2) against the naive clipped value loss (+ clip fraction, value mean,
  explained variance, and "loss only").
- value head: `value_head_loss` ([T, H] hidden -> values -> clipped value loss; gradients to hidden,
  weight and bias) against `hidden @ weight + bias` followed by the naive value loss, in fp32 and bf16.

Shapes: the issue's [128 x 8192] = 2^20 tokens for the losses. The value head at H = 4096 over 2^20
tokens needs 8 GiB (bf16) to 16 GiB (fp32) for `hidden` alone, plus as much for its gradient, which does
not fit the 24 GiB development VM next to other work: on CPU it runs 16K tokens (default) or 64K
(`--full`); on CUDA 2^20 tokens.

GB/s counts one read of every input and one write of every gradient: 17 bytes/token for the losses
(3 float32 inputs + the bool mask read, the float32 gradient written); 3 * H * itemsize + 17 bytes/token
for the head (hidden read forward and backward, d_hidden written). On CUDA a device-to-device copy of the
same byte count is timed too, and each row's share of its bandwidth reported. Peak MiB is what torch
allocates during one call, outputs (the gradient) included.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compactionrl_fast as crf  # noqa: E402

from benchmarks import _harness as H  # noqa: E402

CLIP, VCLIP = 0.2, 0.2
LOSS_BYTES_PER_TOKEN = 4 * 3 + 1 + 4

# name: (kind, rollouts, tokens per rollout, hidden size, hidden dtype)
SHAPES = {
    "128x8192": ("loss", 128, 8192, None, None),
    "head 16Kx4096 fp32": ("head", 16, 1024, 4096, torch.float32),
    "head 16Kx4096 bf16": ("head", 16, 1024, 4096, torch.bfloat16),
}
FULL_SHAPES = {
    "128x8192": ("loss", 128, 8192, None, None),
    "head 64Kx4096 fp32": ("head", 64, 1024, 4096, torch.float32),
    "head 64Kx4096 bf16": ("head", 64, 1024, 4096, torch.bfloat16),
}
QUICK_SHAPES = {
    "8x2048": ("loss", 8, 2048, None, None),
    "head 2Kx1024 bf16": ("head", 2, 1024, 1024, torch.bfloat16),
}
CUDA_SHAPES = {
    "128x8192": ("loss", 128, 8192, None, None),
    "512x8192": ("loss", 512, 8192, None, None),
    "head 128x8192x4096 bf16": ("head", 128, 8192, 4096, torch.bfloat16),
}


# ---------------------------------------------------------------- inputs


def make_inputs(rollouts, length, *, seed=0, device="cpu"):
    """Packed batch: one segment per rollout, ~70% trainable tokens in runs, ratios around 1 +- 0.3."""
    g = torch.Generator().manual_seed(seed)
    T = rollouts * length
    run = torch.randint(1, 200, (T // 50 + 8,), generator=g)
    on = torch.arange(run.numel()) % 10 < 7
    mask = torch.repeat_interleave(on, run)[:T]
    mask = torch.cat([mask, torch.ones(T - mask.numel(), dtype=torch.bool)])
    old = torch.randn(T, generator=g) * 0.8 - 2.0
    ret = torch.randn(T, generator=g)
    old_v = ret + 0.5 * torch.randn(T, generator=g)
    x = dict(logprobs=old + 0.3 * torch.randn(T, generator=g), old_logprobs=old,
             advantages=torch.randn(T, generator=g), rollout_logprobs=old + 0.1 * torch.randn(T, generator=g),
             values=old_v + 0.3 * torch.randn(T, generator=g), old_values=old_v, returns=ret, loss_mask=mask,
             cu_seqlens=torch.arange(0, T + 1, length, dtype=torch.int32))
    return {k: v.to(device) for k, v in x.items()}


def head_inputs(T, Hd, dtype, *, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, Hd, generator=g).to(dtype)
    weight = (torch.randn(Hd, generator=g) / Hd ** 0.5).to(dtype)
    return dict(hidden=hidden.to(device), weight=weight.to(device), bias=torch.zeros((), dtype=dtype, device=device))


# ---------------------------------------------------------------- formulations


def naive_policy(lp, old, adv, mask, metrics=True):
    """The usual composition (verl/OpenRLHF style), token-mean over trainable tokens."""
    m = mask.float()
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP)
    loss = (torch.maximum(pg1, pg2) * m).sum() / m.sum().clamp(min=1.0)
    out = {}
    if metrics:
        with torch.no_grad():
            n = m.sum().clamp(min=1.0)
            out = {"clip_fraction": ((pg2 > pg1).float() * m).sum() / n,
                   "approx_kl": (((ratio - 1.0) - log_ratio) * m).sum() / n,
                   "ratio_max": torch.where(mask, ratio, 0.0).max()}
    return loss, out


def naive_value(v, old, ret, mask, metrics=True):
    m = mask.float()
    v_clip = old + torch.clamp(v - old, -VCLIP, VCLIP)
    q1, q2 = (v - ret) ** 2, (v_clip - ret) ** 2
    loss = 0.5 * (torch.maximum(q1, q2) * m).sum() / m.sum().clamp(min=1.0)
    out = {}
    if metrics:
        with torch.no_grad():
            n = m.sum().clamp(min=1.0)
            mean = lambda x: (x * m).sum() / n  # noqa: E731
            var = lambda x: mean((x - mean(x)) ** 2)  # noqa: E731
            out = {"clip_fraction": mean((q2 > q1).float()), "value_mean": mean(v),
                   "explained_variance": 1.0 - var(ret - v) / var(ret)}
    return loss, out


def step(leaf, fn):
    """A training step's worth: forward, backward; returns (loss, metrics, grad) and leaves .grad empty, so
    that the next call allocates its gradient afresh (and no call frees memory it did not allocate)."""
    def run():
        loss, m = fn(leaf)
        loss.backward()
        grad, leaf.grad = leaf.grad, None
        return loss.detach(), m, grad
    return run


def loss_formulations(x, *, compile_naive=False):
    """(name, leaf, fn of the leaf) for the policy and the value loss."""
    lp = x["logprobs"].clone().requires_grad_()
    v = x["values"].clone().requires_grad_()
    mk = x["loss_mask"]
    pol = lambda **kw: (lambda t: crf.ppo_policy_loss(t, x["old_logprobs"], x["advantages"], mk,  # noqa: E731
                                                      clip_low=CLIP, clip_high=CLIP, **kw))
    val = lambda t: crf.value_loss(t, x["old_values"], x["returns"], mk, clip=VCLIP)  # noqa: E731
    out = [
        ("policy", "fused", lp, pol()),
        ("policy", "fused segment-mean", lp, pol(cu_seqlens=x["cu_seqlens"], reduction="segment-mean")),
        ("policy", "fused dual-clip + TIS", lp, pol(dual_clip=3.0, rollout_logprobs=x["rollout_logprobs"],
                                                    tis_cap=2.0)),
        ("policy", "naive torch", lp, lambda t: naive_policy(t, x["old_logprobs"], x["advantages"], mk)),
        ("policy", "naive torch, loss only", lp,
         lambda t: naive_policy(t, x["old_logprobs"], x["advantages"], mk, metrics=False)),
        ("value", "fused", v, val),
        ("value", "naive torch", v, lambda t: naive_value(t, x["old_values"], x["returns"], mk)),
        ("value", "naive torch, loss only", v,
         lambda t: naive_value(t, x["old_values"], x["returns"], mk, metrics=False)),
    ]
    if compile_naive:
        cp = torch.compile(naive_policy)
        cv = torch.compile(naive_value)
        out += [("policy", "torch.compile(naive)", lp, lambda t: cp(t, x["old_logprobs"], x["advantages"], mk)),
                ("value", "torch.compile(naive)", v, lambda t: cv(t, x["old_values"], x["returns"], mk))]
    return out


class _Params:
    """hidden, weight, bias as leaves; `take_grads()` returns and clears their gradients."""

    def __init__(self, h):
        self.h = {k: t.clone().requires_grad_() for k, t in h.items()}

    def take_grads(self):
        out = {k: t.grad for k, t in self.h.items()}
        for t in self.h.values():
            t.grad = None
        return out


def head_formulations(x, h):
    p = _Params(h)
    mk = x["loss_mask"]

    def fused():
        loss, m = crf.value_head_loss(p.h["hidden"], p.h["weight"], p.h["bias"], x["old_values"], x["returns"], mk,
                                      clip=VCLIP)
        loss.backward()
        return loss.detach(), m, p.take_grads()["weight"]

    def naive():
        values = (p.h["hidden"] @ p.h["weight"] + p.h["bias"]).float()
        loss, m = naive_value(values, x["old_values"], x["returns"], mk)
        loss.backward()
        return loss.detach(), m, p.take_grads()["weight"]

    return [("value head", "fused", fused), ("value head", "naive torch", naive)]


def check(name, got, want, rtol):
    """Raise if a formulation's loss, metrics or gradient differ from the fused op's beyond rounding."""
    (l1, m1, g1), (l0, m0, g0) = got, want
    torch.testing.assert_close(l1.float(), l0.float(), rtol=rtol, atol=1e-6, msg=lambda s: f"{name} loss: {s}")
    torch.testing.assert_close(g1.float(), g0.float(), rtol=rtol, atol=rtol * float(g0.abs().max()),
                               msg=lambda s: f"{name} gradient: {s}")
    # metrics: the naive value loss also counts as "clipped" tokens inside the clip range where
    # old + (v - old) rounds away from v (~0.1% of tokens); the fused op does not
    for k in m1:
        torch.testing.assert_close(m1[k].float(), m0[k].float(), rtol=max(rtol, 1e-3), atol=max(rtol, 2e-3),
                                   msg=lambda s: f"{name} {k}: {s}")


# ---------------------------------------------------------------- the run


def bench_shape(shape, spec, device, *, budget_s, compile_naive):
    kind, rollouts, length, Hd, dtype = spec
    T = rollouts * length
    x = make_inputs(rollouts, length, device=device)
    config = {"shape": shape, "tokens": T, "trainable": round(float(x["loss_mask"].float().mean()), 3)}
    rows = []
    if kind == "loss":
        cases = [(op, name, step(leaf, fn)) for op, name, leaf, fn in loss_formulations(x, compile_naive=compile_naive)]
        nbytes = LOSS_BYTES_PER_TOKEN * T
        rtol = 1e-5
    else:
        cases = [(op, name, fn) for op, name, fn in head_formulations(x, head_inputs(T, Hd, dtype, device=device))]
        config.update(hidden=Hd, dtype=str(dtype).replace("torch.", ""))
        nbytes = (3 * Hd * torch.finfo(dtype).bits // 8 + LOSS_BYTES_PER_TOKEN) * T
        rtol = 1e-4 if dtype == torch.float32 else 5e-2  # naive bf16 rounds the values to bf16
    ref = {}
    for op, name, fn in cases:
        got = fn()  # warms up; checked against the op's fused row
        if name == "fused":
            ref[op] = got
        elif name.startswith("fused"):
            pass  # different settings: nothing to compare against
        else:
            check(f"{op} {name}", got, ref[op], rtol)
        del got
        rows.append(H.measure(name, fn, device=device, nbytes=nbytes, config={**config, "op": op,
                                                                             "group": f"{shape} {op}"},
                              budget_s=budget_s))
    if device.type == "cuda":
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        copy = H.measure("d2d copy", lambda: src.clone(), device=device, nbytes=nbytes,
                         config={**config, "op": "-", "group": f"{shape} copy"}, budget_s=budget_s)
        for r in rows:
            r["of_copy_bw"] = r["gbps"] / copy["gbps"]
        rows.append(copy)
    t_buf = 4 * T / 2**20  # MiB of one float32 [T] buffer
    for r in rows:
        r["peak_over_T"] = None if r["peak_mib"] is None else r["peak_mib"] / t_buf
    return rows


COLUMNS = [("shape", "shape", ""), ("op", "op", ""), ("name", "formulation", ""), ("median_ms", "median ms", ".3f"),
           ("min_ms", "min ms", ".3f"), ("reps", "reps", "d"), ("gbps", "GB/s", ".3g"),
           ("x_naive", "speedup vs naive", ".3g"), ("peak_mib", "peak MiB", ".1f"),
           ("peak_over_T", "peak / [T] f32", ".2f"), ("faults_per_call", "faults/call", ".0f")]


def run(shapes, device, *, budget_s=1.0, compile_naive=False):
    if device.type == "cpu":
        H.settle_malloc()
    rows = []
    for shape, spec in shapes.items():
        print(f"... {shape}", file=sys.stderr, flush=True)
        rows += bench_shape(shape, spec, device, budget_s=budget_s, compile_naive=compile_naive)
    H.add_speedups(rows, "naive torch", "x_naive", group="group")
    return rows


def speed_check(clip=0.2):
    """benchmarks/check_speedups.py's cases (the registry's `speed` keys -> (reference fn, op fn)), forward and
    backward: ppo_policy_loss and value_loss (cpp) against the float64 references, token-mean with cu_seqlens,
    256K tokens; value_head_loss with a bf16 hidden (the C++ head) against reference value_head + value_loss."""
    from compactionrl_fast import reference as ref

    grads = torch.autograd.grad
    x = make_inputs(32, 8192)
    lp, v = x["logprobs"].clone().requires_grad_(), x["values"].clone().requires_grad_()
    mk, cu = x["loss_mask"], x["cu_seqlens"]
    pol = dict(cu_seqlens=cu, clip_low=clip, clip_high=clip)
    out = {"ppo_policy_loss": (
        lambda: grads(ref.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], mk, **pol)[0], [lp]),
        lambda: grads(crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], mk, **pol)[0], [lp]))}
    out["value_loss"] = (
        lambda: grads(ref.value_loss(v, x["old_values"], x["returns"], mk, clip=clip, cu_seqlens=cu)[0], [v]),
        lambda: grads(crf.value_loss(v, x["old_values"], x["returns"], mk, clip=clip, cu_seqlens=cu)[0], [v]))
    T, Hd = 8192, 1024
    xs = make_inputs(8, T // 8)
    h = {k: t.requires_grad_() for k, t in head_inputs(T, Hd, torch.bfloat16).items()}
    leaves = [h["hidden"], h["weight"], h["bias"]]
    hv = (xs["old_values"], xs["returns"], xs["loss_mask"])
    out["value_head_loss"] = (
        lambda: grads(ref.value_loss(ref.value_head(*leaves), *hv, clip=clip)[0], leaves),
        lambda: grads(crf.value_head_loss(*leaves, *hv, clip=clip)[0], leaves))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small shapes (seconds), for CI")
    size.add_argument("--full", action="store_true", help="a larger value-head shape (64K x 4096) on CPU")
    p.add_argument("--json", help="write rows to this JSON path (and a markdown table next to it, .md)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row (min 3 reps)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the naive losses")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.quick:
        shapes = QUICK_SHAPES
    elif device.type == "cuda":
        shapes = CUDA_SHAPES
    else:
        shapes = FULL_SHAPES if args.full else SHAPES
    rows = run(shapes, device, budget_s=args.budget, compile_naive=args.compile)
    columns = COLUMNS + ([("of_copy_bw", "of copy BW", ".0%")] if device.type == "cuda" else [])
    env = H.environment(device)
    notes = ["Each row: forward + backward, gradient left in .grad (cleared before each call). Policy: token-mean, "
             "clip 0.2 unless named; value: clip 0.2. 'naive torch' includes the metrics (under no_grad), "
             "'loss only' does not. Byte count: 17 bytes/token for the losses; 3*H*itemsize + 17 for the head.",
             "peak MiB: torch allocations during one call, the gradient output included; 'peak / [T] f32' divides "
             "it by one float32 [T] buffer (4 bytes/token).",
             f"CPU value head shapes are smaller than [128x8192]x4096, which needs 16-48 GiB; threads: "
             f"{torch.get_num_threads()}."]
    H.report(f"fused losses benchmark ({device.type})", rows, columns, env, notes, args.json)
    return rows


# ---------------------------------------------------------------- pytest-benchmark (small sizes)


def _small():
    if "x" not in _small.__dict__:
        _small.x = make_inputs(8, 2048)
    return _small.x


def _case(op, name):
    x = _small()
    return next(step(leaf, fn) for o, n, leaf, fn in loss_formulations(x) if (o, n) == (op, name))


def test_policy_fused(benchmark):
    fn = _case("policy", "fused")
    got = benchmark(fn)
    check("policy naive", _case("policy", "naive torch")(), got, 1e-5)


def test_policy_naive(benchmark):
    benchmark(_case("policy", "naive torch"))


def test_value_fused(benchmark):
    got = benchmark(_case("value", "fused"))
    check("value naive", _case("value", "naive torch")(), got, 1e-5)


def test_value_naive(benchmark):
    benchmark(_case("value", "naive torch"))


def test_value_head_fused(benchmark):
    x = _small()
    fused, naive = (fn for _, _, fn in head_formulations(x, head_inputs(x["loss_mask"].numel(), 256, torch.float32)))
    got = benchmark(fused)
    check("value head naive", naive(), got, 1e-4)


if __name__ == "__main__":
    main()
