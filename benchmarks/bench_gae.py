"""Benchmark of `segment_gae` against the GAE formulations trainers use, and a plain C scan.

    python benchmarks/bench_gae.py [--quick] [--json PATH] [--device cpu|cuda]
    pytest benchmarks/bench_gae.py --benchmark-only        (small sizes, a smoke run)

Shapes are packed batches of rollouts x tokens with ~30% observation tokens in runs (assistant runs of
~140 tokens, observation runs of ~60, geometric lengths), one segment per rollout or 3 (exec, summary,
exec). Formulations timed on each shape, all computing the same thing (gamma=1, lam=0.95 constant,
cross_segment="none", returns = advantages + values) and checked against the first backend's output once
before timing, so a broken baseline cannot win:

- every available backend of `compactionrl_fast.segment_gae` on the device ("cpp" on CPU; "triton" and
  "cuda" on CUDA), plus the same backend on the paper's recipe (defaults: cross_segment="paper",
  adaptive lambda per rollout, a second lam_critic=1 recurrence for the returns);
- "cpp avx2": the cpp backend held to its 4-lane AVX2 path (`compactionrl_fast._C.cpu_simd("avx2")`), the
  default before the 8-lane AVX-512 path;
- "torch oracle": backend="torch", the float64 python-loop reference; only on the small shape;
- "per-step loop": `reference.masked_gae` on the padded [S, L] layout trainers keep (one row per
  segment): a python loop over the L time steps, vectorised masked torch ops over the S rows. Only the
  loop is timed, not the padding;
- "vectorised torch": `vectorised_gae` below, packed in, packed out, no python loop over time;
- "C scan": a plain single-threaded C reverse scan over the packed tokens (gcc -O3 at benchmark time,
  called through ctypes), one segment at a time, skipping masked tokens; outputs allocated by torch per
  call like every other formulation. The speed-of-light baseline.

GB/s counts the bytes of one read of rewards, values, mask and one write of advantages and returns
(17 bytes per token) for every formulation. On CUDA a device-to-device copy of the same byte count is
timed too, and every row's share of its bandwidth is reported.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compactionrl_fast as crf  # noqa: E402
from compactionrl_fast.ops._dispatch import TABLE, available, cpp_ext  # noqa: E402
from compactionrl_fast.reference.gae import masked_gae  # noqa: E402

from benchmarks import _harness as H  # noqa: E402

GAMMA, LAM = 1.0, 0.95
BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 4  # rewards, values, mask read; advantages, returns written

# name: (rollouts, tokens per rollout, segments per rollout (0: random 1..4), random rollout lengths)
SHAPES = {
    "8x1024": (8, 1024, 1, False),  # small: every formulation, the float64 oracle included
    "128x8192": (128, 8192, 1, False),
    "128x8192 3seg": (128, 8192, 3, False),
    "16x65536": (16, 65536, 1, False),
    "16x65536 3seg": (16, 65536, 3, False),
    "1M varlen": (128, 8192, 0, True),  # 2^20 tokens, rollout lengths 0.25..2x the mean, 1..4 segments
    "4x262144": (4, 262144, 1, False),  # fewer rollouts than CPU lanes: the long ones are cut into pieces
}
QUICK_SHAPES = {
    "4x512": (4, 512, 1, False),
    "32x1024": (32, 1024, 1, False),
    "8x2048 3seg": (8, 2048, 3, False),
}
CUDA_SHAPES = {"512x32768": (512, 32768, 1, False)}  # 16M tokens, for the copy-bandwidth target
# --gpu-plans: the Triton plans against the copy bandwidth at 1M and 16M tokens, R in {8, 264, 4096}, varlen
GPU_PLAN_SHAPES = {f"{T // 2**20}M R{R}": (R, T // R, 1, False) for T in (1 << 20, 1 << 24) for R in (8, 264, 4096)}
GPU_PLAN_SHAPES["16M varlen R264"] = (264, (1 << 24) // 264, 0, True)
ORACLE_MAX_TOKENS = 10_000  # the python-loop oracle takes ~seconds per 10K tokens


# ---------------------------------------------------------------- batches


def _split(total: int, weights: torch.Tensor) -> list[int]:
    """Integer parts of `total` proportional to `weights`, summing exactly to `total`."""
    parts = (weights / weights.sum() * total).floor().long()
    parts[-1] += total - int(parts.sum())
    return parts.tolist()


def make_batch(rollouts, length, segments=1, varlen=False, *, seed=0, device="cpu"):
    """Packed batch (docs/layout.md) of `rollouts` x `length` tokens (exactly, also when varlen).

    Segments follow the compaction pattern exec, summary, exec, ...: a summary gets ~5% of a rollout's
    tokens. The mask alternates trainable runs (mean 140 tokens) and observation runs (mean 60).
    Rewards: a random final reward per rollout on the last trainable token of each segment ("paper").
    """
    g = torch.Generator().manual_seed(seed)
    T = rollouts * length
    lens = _split(T, torch.rand(rollouts, generator=g) * 1.75 + 0.25) if varlen else [length] * rollouts
    seq, segs = [0], [0]
    for n in lens:
        k = int(torch.randint(1, 5, (), generator=g)) if segments == 0 else segments
        w = torch.tensor([0.05 if i % 2 else 0.5 + float(torch.rand((), generator=g)) for i in range(k)])
        for part in _split(n, w):
            seq.append(seq[-1] + part)
        segs.append(segs[-1] + k)
    n_runs = 2 * (T // 100 + 64)
    p = torch.tensor([1 / 140, 1 / 60]).repeat(n_runs // 2)
    run_len = _geometric(p, g)
    on = torch.tensor([True, False]).repeat(n_runs // 2)
    mask = torch.repeat_interleave(on, run_len)[:T]
    if mask.numel() < T:  # vanishingly unlikely; pad with trainable tokens
        mask = torch.cat([mask, torch.ones(T - mask.numel(), dtype=torch.bool)])
    cu_seqlens = torch.tensor(seq, dtype=torch.int32)
    cu_segments = torch.tensor(segs, dtype=torch.int32)
    rewards = crf.place_final_rewards(torch.randn(rollouts, generator=g), mask, cu_seqlens, cu_segments)
    values = torch.randn(T, generator=g)
    b = dict(rewards=rewards, values=values, loss_mask=mask, cu_seqlens=cu_seqlens, cu_segments=cu_segments)
    return {k: v.to(device) for k, v in b.items()}


def _geometric(p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Run lengths >= 1 with mean 1/p (inverse-CDF sampling, so the generator is honoured)."""
    u = torch.rand(p.shape, generator=g, dtype=torch.float64).clamp_min(1e-12)
    return (torch.log(u) / torch.log1p(-p.double())).floor().long() + 1


def describe(b) -> dict:
    T, S = b["loss_mask"].numel(), b["cu_seqlens"].numel() - 1
    return {"tokens": T, "rollouts": b["cu_segments"].numel() - 1, "segments": S,
            "trainable": round(float(b["loss_mask"].float().mean()), 3)}


def to_padded(x, cu_seqlens, fill=0):
    """Packed [T] -> padded [S, L_max] (one row per segment), the layout trainers keep."""
    lens = cu_seqlens.diff().long()
    S, L = lens.numel(), int(lens.max()) if lens.numel() else 0
    seg = torch.repeat_interleave(torch.arange(S, device=x.device), lens, output_size=x.numel())
    col = torch.arange(x.numel(), device=x.device) - cu_seqlens.long()[:-1][seg]
    out = torch.full((S, L), fill, dtype=x.dtype, device=x.device)
    out[seg, col] = x
    return out, seg, col


# ---------------------------------------------------------------- formulations


def run_backend(b, backend):
    """segment_gae at the shared setting: constant lam, no cross-segment term, returns = adv + values."""
    return crf.segment_gae(b["rewards"], b["values"], b["loss_mask"], b["cu_seqlens"], b["cu_segments"],
                           gamma=GAMMA, lam=LAM, cross_segment="none", lam_critic=None, backend=backend)


def run_recipe(b, backend):
    """segment_gae with the paper's defaults (paper correction, adaptive lambda, lam_critic=1)."""
    return crf.segment_gae(b["rewards"], b["values"], b["loss_mask"], b["cu_seqlens"], b["cu_segments"],
                           backend=backend)


def reverse_linear_scan(x, c: float, block: int = 32):
    """y[..., k] = x[..., k] + c * y[..., k+1] along the last dim (y past the end = 0), no loop over k.

    Each block of `block` steps solves its local scan with one matmul by the [block, block] matrix
    M[j, i] = c^(j-i) (j >= i). The full value at a block's first step obeys the same recurrence over
    blocks with coefficient c^block, solved recursively; each step then adds c^(block-i) times the
    next block's first value. Only non-negative powers of c appear, so nothing overflows.
    """
    n = x.shape[-1]
    pad = (-n) % block
    xb = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, block))  # [..., nb, block]
    k = torch.arange(block, device=x.device, dtype=torch.float64)
    e = k[:, None] - k[None, :]  # j - i
    M = torch.where(e >= 0, torch.pow(c, e.clamp_min(0)), 0.0).to(x.dtype)
    y = xb @ M  # local scans
    if y.shape[-2] > 1:
        first = reverse_linear_scan(y[..., 0], c ** block, block)  # [..., nb] full value at block starts
        nxt = torch.nn.functional.pad(first[..., 1:], (0, 1))  # next block's first value, 0 at the end
        decay = torch.pow(c, block - k).to(x.dtype)  # c^(block - i)
        y = y + nxt[..., None] * decay
    return y.flatten(-2)[..., :n]


def vectorised_gae(rewards, values, loss_mask, cu_seqlens, gamma=GAMMA, lam=LAM):
    """GAE over packed segments with torch ops only (constant lam, no cross-segment term).

    Trainable tokens are compacted per segment into a zero-padded [S, N_max] matrix (observation tokens
    are skipped, not steps; zero padding gives V_{n+1} = A_{n+1} = 0), the TD residuals are one
    vectorised expression, and A = delta + gamma*lam*A_next is a blocked linear scan. Float32 throughout.
    """
    T, S = loss_mask.numel(), cu_seqlens.numel() - 1
    dev = loss_mask.device
    idx = loss_mask.nonzero().squeeze(1)  # [n] trainable positions
    seg = torch.searchsorted(cu_seqlens.long(), idx, right=True) - 1  # [n] their segments
    n_seg = torch.bincount(seg, minlength=S)
    col = torch.arange(idx.numel(), device=dev) - (n_seg.cumsum(0) - n_seg)[seg]
    N = int(n_seg.max()) + 1 if S else 1
    flat = seg * N + col
    r = torch.zeros(S * N, device=dev).index_put_((flat,), rewards[idx]).view(S, N)
    v = torch.zeros(S * N, device=dev).index_put_((flat,), values[idx]).view(S, N)
    delta = r[:, :-1] + gamma * v[:, 1:] - v[:, :-1]  # [S, N-1]; the last column is always padding
    a = reverse_linear_scan(delta, gamma * lam).reshape(-1)
    adv = torch.zeros(T, device=dev)
    ret = torch.zeros(T, device=dev)
    a_tok = a[seg * (N - 1) + col]
    adv[idx] = a_tok
    ret[idx] = a_tok + values[idx]
    return adv, ret


_C_SOURCE = r"""
#include <stdint.h>
/* GAE reverse scan, one segment at a time; observation tokens are skipped, not steps. */
void gae_scan(const float* r, const float* v, const uint8_t* m, const int64_t* cu, int64_t S,
              float gamma, float lam, float* adv, float* ret) {
  const float gl = gamma * lam;
  for (int64_t s = 0; s < S; ++s) {
    float a = 0.f, v_next = 0.f;
    for (int64_t t = cu[s + 1] - 1; t >= cu[s]; --t) {
      if (m[t]) {
        a = r[t] + gamma * v_next - v[t] + gl * a;
        v_next = v[t];
        adv[t] = a;
        ret[t] = a + v[t];
      } else {
        adv[t] = 0.f;
        ret[t] = 0.f;
      }
    }
  }
}
"""


class CScan:
    """The plain C scan, compiled with `$CC -O3` (default gcc) into a temporary shared library."""

    def __init__(self):
        cc = os.environ.get("CC", "gcc")
        if shutil.which(cc) is None:
            raise RuntimeError(f"no C compiler ({cc})")
        self.dir = tempfile.mkdtemp(prefix="crf_bench_")
        src, lib = os.path.join(self.dir, "scan.c"), os.path.join(self.dir, "scan.so")
        with open(src, "w") as f:
            f.write(_C_SOURCE)
        subprocess.run([cc, "-O3", "-shared", "-fPIC", src, "-o", lib], check=True, capture_output=True)
        self.lib = ctypes.CDLL(lib)
        self.lib.gae_scan.restype = None
        self.lib.gae_scan.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_float, ctypes.c_float,
                                                              ctypes.c_void_p, ctypes.c_void_p]

    def __call__(self, rewards, values, mask_u8, cu64, gamma=GAMMA, lam=LAM):
        """rewards, values [T] float32, mask_u8 [T] uint8, cu64 [S+1] int64, all contiguous CPU."""
        adv, ret = torch.empty_like(rewards), torch.empty_like(rewards)
        self.lib.gae_scan(rewards.data_ptr(), values.data_ptr(), mask_u8.data_ptr(), cu64.data_ptr(),
                          cu64.numel() - 1, gamma, lam, adv.data_ptr(), ret.data_ptr())
        return adv, ret


_C_SCAN = None


def c_scan():
    global _C_SCAN
    if _C_SCAN is None:
        _C_SCAN = CScan()
    return _C_SCAN


# ---------------------------------------------------------------- the run


def check(name, got, want):
    """Raise if a formulation's (adv, ret) differ from the backend's beyond float32 rounding."""
    for what, x, y in zip(("advantages", "returns"), got, want):
        try:
            torch.testing.assert_close(x.float().cpu(), y.float().cpu(), rtol=1e-4, atol=1e-4)
        except AssertionError as e:
            raise AssertionError(f"{name} disagrees with the reference backend on {what}: {e}") from None


def _with_simd(name, fn):
    """fn() with the CPU scan held to the SIMD path `name` (see csrc/cpu/gae.cpp)."""
    old = cpp_ext().cpu_simd()
    cpp_ext().cpu_simd(name)
    try:
        return fn()
    finally:
        cpp_ext().cpu_simd(old)


def _with_env(name, value, fn):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def formulations(b, device, *, oracle: bool, loops: bool = True, plans: bool = False):
    """(name, zero-argument callable returning packed (adv, ret), timed callable, timing kwargs) tuples."""
    out = []
    # the Triton interpreter on CPU tensors is a test tool, not a backend worth timing
    backends = [x for x in available(device) if x in TABLE["segment_gae"]["ops"]  # its kernels, not the reference
                and not (x == "triton" and device.type == "cpu")]
    for be in backends:
        out.append((be, lambda be=be: run_backend(b, be), None, {}))
    for be in backends:
        out.append((f"{be} recipe", None, lambda be=be: run_recipe(b, be), {}))
    if plans and "triton" in backends:  # the single-pass look-back plan beside the default plan
        out.append(("triton lookback", lambda: _with_env("COMPACTIONRL_FAST_GAE_PLAN", "lookback", lambda: run_backend(b, "triton")), None, {}))
    if "cpp" in backends:  # the 4-lane AVX2 path (the default before the AVX-512 one) on CPUs that have both
        out.append(("cpp avx2", lambda: _with_simd("avx2", lambda: run_backend(b, "cpp")),
                    None, {}))
    if oracle and loops:
        out.append(("torch oracle", lambda: run_backend(b, "torch"), None, dict(warmup=0, min_reps=3)))
    if loops:
        r, seg, col = to_padded(b["rewards"], b["cu_seqlens"])
        v, _, _ = to_padded(b["values"], b["cu_seqlens"])
        m, _, _ = to_padded(b["loss_mask"], b["cu_seqlens"], fill=False)
        loop = lambda: masked_gae(r, v, m, GAMMA, LAM)
        out.append(("per-step loop", lambda: tuple(x[seg, col] for x in loop()), loop,
                    dict(warmup=0, min_reps=3, memory=False)))
    out.append(("vectorised torch", lambda: vectorised_gae(b["rewards"], b["values"], b["loss_mask"],
                                                           b["cu_seqlens"]), None, {}))
    if device.type == "cpu":
        try:
            scan = c_scan()
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            print(f"note: C scan skipped: {e}")
        else:
            m8, cu64 = b["loss_mask"].view(torch.uint8), b["cu_seqlens"].long()
            out.append(("C scan", lambda: scan(b["rewards"], b["values"], m8, cu64), None, {}))
    return out


def bench_shape(shape, spec, device, *, budget_s, loops=True, plans=False):
    b = make_batch(*spec, device=device)
    T = b["loss_mask"].numel()
    config = {"shape": shape, **describe(b)}
    nbytes = BYTES_PER_TOKEN * T
    rows, want = [], None
    for name, fn, timed, kw in formulations(b, device, oracle=T <= ORACLE_MAX_TOKENS, loops=loops, plans=plans):
        if fn is not None:  # the check call also warms up (warmup=0 rows rely on it)
            got = fn()
            if want is None:
                want = got  # the first backend is the reference of the others
            else:
                check(name, got, want)
        memory = kw.pop("memory", True)
        setting = "paper, adaptive lam, lam_critic=1" if name.endswith("recipe") else "none, lam=0.95"
        rows.append(H.measure(name, timed or fn, device=device, nbytes=nbytes, memory=memory,
                              config={**config, "setting": setting}, budget_s=budget_s, **kw))
    # streaming the same bytes once (read half, write half): the bandwidth ceiling
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rows.append(H.measure("copy", lambda: dst.copy_(src), device=device, nbytes=nbytes,
                          config={**config, "setting": "-"}, budget_s=budget_s))
    copy = rows[-1]["gbps"]
    for r in rows:
        r["of_copy_bw"] = r["gbps"] / copy if r["gbps"] else None  # median times
    return rows


COLUMNS = [("shape", "shape", ""), ("name", "formulation", ""), ("median_ms", "median ms", ".3f"),
           ("min_ms", "min ms", ".3f"), ("reps", "reps", "d"), ("gbps", "GB/s", ".3g"),
           ("x_loop", "speedup vs loop", ".4g"), ("x_c", "speedup vs C scan", ".3g"),
           ("peak_mib", "peak MiB", ".1f"), ("faults_per_call", "faults/call", ".0f")]


def run(shapes, device, *, budget_s=1.0, stat="median_ms", loops=True, plans=False):
    if device.type == "cpu":
        H.settle_malloc()
    rows = []
    for shape, spec in shapes.items():
        print(f"... {shape}", file=sys.stderr, flush=True)
        rows += bench_shape(shape, spec, device, budget_s=budget_s, loops=loops, plans=plans)
    H.add_speedups(rows, "per-step loop", "x_loop", stat=stat)
    H.add_speedups(rows, "C scan", "x_c", stat=stat)
    return rows


def speed_check():
    """benchmarks/check_speedups.py's case (the registry's `speed` key -> (reference fn, op fn)): cpp against
    `reference.masked_gae`, the per-step loop trainers run on the padded layout (the per-token float64 oracle is
    too slow at a size where the kernel, not the call overhead, counts), 128K tokens; segment_params (cpp) against
    its reference."""
    b = make_batch(64, 2048)
    pad = [to_padded(b[k], b["cu_seqlens"])[0] for k in ("rewards", "values")]
    mask = to_padded(b["loss_mask"], b["cu_seqlens"], fill=False)[0]
    from compactionrl_fast.reference.gae import segment_params

    p = make_batch(64, 2048, segments=4)  # segment_params: 256 segments, cpp against the reference's loop
    layout = (p["loss_mask"], p["cu_seqlens"], p["cu_segments"])
    return {"segment_gae": (lambda: masked_gae(*pad, mask, GAMMA, LAM), lambda: run_backend(b, "cpp")),
            "segment_params": (lambda: segment_params(*layout), lambda: crf.segment_params(*layout, backend="cpp"))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (seconds), for CI")
    p.add_argument("--json", help="write rows to this JSON path (and a markdown table next to it, .md)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row (min 3 reps)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="time statistic of GB/s and speedups (min: on a machine others are loading)")
    p.add_argument("--no-loop", action="store_true",
                   help="skip the python-loop baselines (torch oracle, per-step loop): one launch per step on CUDA")
    p.add_argument("--gpu-plans", action="store_true",
                   help="CUDA: the Triton plans (default and single-pass look-back) at 1M and 16M tokens, R in "
                        "{8, 264, 4096} and varlen, against the copy bandwidth (no loop baselines)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = dict(QUICK_SHAPES if args.quick else SHAPES)
    if device.type == "cuda" and not args.quick:
        shapes.update(CUDA_SHAPES)
    stat = args.stat + "_ms"
    if args.gpu_plans:
        shapes = dict(GPU_PLAN_SHAPES)
    rows = run(shapes, device, budget_s=args.budget, stat=stat, loops=not args.no_loop and not args.gpu_plans,
               plans=args.gpu_plans)
    columns = [c if c[0] != "gbps" or stat == "median_ms" else ("gbps_min_time", "GB/s", c[2]) for c in COLUMNS]
    columns += [("of_copy_bw", "of copy BW", ".0%")]
    env = H.environment(device)
    notes = [f"GB/s and speedups from the {args.stat} time of each row.",
             f"settings: gamma={GAMMA}, lam={LAM}, cross_segment='none', returns = adv + values, unless "
             "'recipe' (segment_gae defaults). Byte count: 17 bytes/token (rewards, values, mask, adv, ret).",
             "Every shape but the small ones holds 2^20 = 1,048,576 tokens (the '1M tokens' case); '1M varlen' "
             "has random rollout lengths (0.25..2x the mean) and 1..4 segments per rollout.",
             f"'torch oracle' (float64 python loops) only on shapes <= {ORACLE_MAX_TOKENS} tokens: it needs "
             "minutes for 1M tokens. 'per-step loop' times the loop on the padded layout (padding untimed), "
             "peak memory not profiled (L x ~8 ops). 'C scan' is single-threaded; segment_gae cpp uses "
             f"{torch.get_num_threads()} threads."]
    H.report(f"segment_gae benchmark ({device.type})", rows, columns, env, notes, args.json)
    return rows


# ---------------------------------------------------------------- pytest-benchmark (small sizes)

_SMALL = (16, 2048, 3, False)


def _small():
    if "b" not in _small.__dict__:
        _small.b = make_batch(*_SMALL)
    return _small.b


def _cpp_or_skip():
    import pytest

    if "cpp" not in available(torch.device("cpu")):
        pytest.skip("the C++ extension is not built")


def test_segment_gae_cpp(benchmark):
    _cpp_or_skip()
    b = _small()
    got = benchmark(run_backend, b, "cpp")
    check("cpp", got, c_scan()(b["rewards"], b["values"], b["loss_mask"].view(torch.uint8), b["cu_seqlens"].long()))


def test_segment_gae_cpp_1m(benchmark):
    """2^20 tokens: large enough for the cpp backend to split rollouts across threads."""
    _cpp_or_skip()
    if "b1m" not in _small.__dict__:
        _small.b1m = make_batch(128, 8192, 3)
    b = _small.b1m
    got = benchmark(run_backend, b, "cpp")
    check("cpp", got, c_scan()(b["rewards"], b["values"], b["loss_mask"].view(torch.uint8), b["cu_seqlens"].long()))


def test_segment_gae_cpp_recipe(benchmark):
    _cpp_or_skip()
    benchmark(run_recipe, _small(), "cpp")


def test_per_step_loop(benchmark):
    _cpp_or_skip()
    b = _small()
    (r, seg, col), (v, _, _), (m, _, _) = (to_padded(b[k], b["cu_seqlens"]) for k in ("rewards", "values", "loss_mask"))
    adv, ret = benchmark(masked_gae, r, v, m, GAMMA, LAM)
    check("per-step loop", (adv[seg, col], ret[seg, col]), run_backend(b, "cpp"))


def test_vectorised_torch(benchmark):
    _cpp_or_skip()
    b = _small()
    got = benchmark(vectorised_gae, b["rewards"], b["values"], b["loss_mask"], b["cu_seqlens"])
    check("vectorised torch", got, run_backend(b, "cpp"))


def test_c_scan(benchmark):
    _cpp_or_skip()
    b = _small()
    got = benchmark(c_scan(), b["rewards"], b["values"], b["loss_mask"].view(torch.uint8), b["cu_seqlens"].long())
    check("C scan", got, run_backend(b, "cpp"))


if __name__ == "__main__":
    main()
