"""Run every op's benchmark, print one table, write JSON and PNG charts.

    python -m benchmarks [--quick | --full] [--only gae,losses] [--device cpu|cuda] [--json PATH]
                         [--compare REV] [--budget S] [--timeout S] [--no-charts] [--no-roofline] [--no-loops]

Discovers `benchmarks/bench_*.py` and runs each in its own process (fresh allocator, threads and
memory counters) as `python -m benchmarks.bench_<op> --device D --budget S --json TMP [size flag]`,
then reads the rows back from TMP. That is the whole contract with a script: it accepts `--device`,
`--budget`, `--json` (rows written with `_harness.write_json`) and `--quick`, optionally `--full`
and `--threads`.

Sizes: `--quick` passes `--quick` (CI-sized, seconds). The default is moderate (a few minutes for the
suite on a 2-core CPU): a script that has a `--full` option runs its default shapes; one that has not
is taken to default to the issue-sized shapes and runs `--quick`. `--full` passes `--full` where the
script has it, else runs the script's default. The scripts' own output goes to a .log next to `--json`,
or to build/bench-logs/ for the default JSON path.

Roofline: before the scripts, a device-to-device copy and a matmul (bf16 on CUDA, float32 on CPU) are
timed; every row with GB/s gets `of_copy_bw` (its share of the copy bandwidth), every row with TFLOP/s
gets `of_matmul`.

Output: one table on stdout; JSON `{"meta": {command, env, config, roofline, durations_s, failures},
"rows": [...]}` at `--json` (default `benchmarks/results/suite-<device>-<size>-<UTC date>.json`); one
PNG chart per script next to it. `--compare REV` runs the same suite from a `git worktree` of REV (its
extension built there) and prints time ratios REV / this tree per row. `python -m benchmarks.report`
turns the latest JSON into the results section of docs/performance.md.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file (the --compare child): import this tree's harness
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import _harness as H  # noqa: E402

RESULTS = os.path.join(H.REPO, "benchmarks", "results")
SIZES = ("quick", "default", "full")


# ---------------------------------------------------------------- discovery and one script


def discover(root, only=None):
    """Names of the benchmark scripts under root/benchmarks (`bench_gae.py` -> "gae"), sorted."""
    names = sorted(os.path.basename(p)[6:-3] for p in glob.glob(os.path.join(root, "benchmarks", "bench_*.py")))
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"--only: no benchmarks/bench_{unknown[0]}.py (have: {', '.join(names)})")
        names = [n for n in names if n in only]
    return names


def script_options(root, name):
    """The `--options` a script's source mentions (its argparse flags)."""
    with open(os.path.join(root, "benchmarks", f"bench_{name}.py")) as f:
        return set(re.findall(r"""["'](--[a-z][a-z-]*)["']""", f.read()))


def script_argv(options, size, device, budget, threads, no_loops=False):
    """Command-line flags for one script: its size flag, device, timing budget, threads, --no-loop."""
    argv = ["--device", device, "--budget", str(budget)]
    if no_loops and "--no-loop" in options:
        argv.append("--no-loop")
    if size == "quick" or (size == "default" and "--full" not in options):
        argv.append("--quick")
    elif size == "full" and "--full" in options:
        argv.append("--full")
    if threads and "--threads" in options:
        argv += ["--threads", str(threads)]
    return argv


def run_script(root, name, argv, *, timeout, log):
    """Run `python -m benchmarks.bench_<name> argv --json TMP` in `root`; (rows, seconds, error or None)."""
    with tempfile.TemporaryDirectory(prefix="crf_bench_") as tmp:
        out = os.path.join(tmp, f"{name}.json")
        cmd = [sys.executable, "-m", f"benchmarks.bench_{name}", *argv, "--json", out]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            log.write(f"==== {' '.join(cmd)}\n{text}\n")
            return [], time.perf_counter() - t0, f"timed out after {timeout} s"
        seconds = time.perf_counter() - t0
        log.write(f"==== {' '.join(cmd)}  (exit {proc.returncode}, {seconds:.1f} s)\n{proc.stdout}\n{proc.stderr}\n")
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return [], seconds, f"exit {proc.returncode}: " + " | ".join(tail)
        try:
            with open(out) as f:
                rows = json.load(f)["rows"]
        except (OSError, ValueError, KeyError) as e:
            return [], seconds, f"no rows in {os.path.basename(out)} ({e})"
    for r in rows:
        r["bench"] = name
    return rows, seconds, None


# ---------------------------------------------------------------- roofline


def roofline(device, budget, copy_bytes=None, matmul_n=None):
    """Measured copy bandwidth (GB/s, read + write) and matmul rate (TFLOP/s) of `device`: a copy of
    `copy_bytes` (1 GiB on CUDA, 256 MiB on CPU) and an n^3 matmul (bf16 8192 on CUDA, float32 2048 on CPU)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n_copy = copy_bytes or ((1 << 30) if cuda else (1 << 28))
    src = torch.ones(n_copy, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src).copy_(src)  # into memory already faulted in: the copy, not the page faults
    copy = H.time_fn(lambda: dst.copy_(src), device, budget_s=budget)
    del src, dst
    dtype, n = (torch.bfloat16, 8192) if cuda else (torch.float32, 2048)
    n = matmul_n or n
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm = H.time_fn(lambda: a @ b, device, budget_s=budget)
    return {"copy_gbps": 2 * n_copy / (copy["median_ms"] * 1e-3) / 1e9, "copy_bytes": n_copy,
            "matmul_tflops": 2 * n ** 3 / (mm["median_ms"] * 1e-3) / 1e12, "matmul": f"{n}^3 {str(dtype)[6:]}"}


def add_roofline(rows, roof):
    for r in rows:
        if r.get("gbps") and roof:
            r["of_copy_bw"] = r["gbps"] / roof["copy_gbps"]
        if r.get("tflops") and roof:
            r["of_matmul"] = r["tflops"] / roof["matmul_tflops"]
    return rows


# ---------------------------------------------------------------- table, charts, compare


def ratios(row) -> str:
    """The script's time ratios as one cell "baseline Nx" (baseline time / this time): its `x_<baseline>`
    columns, and `time_vs_<baseline>` columns (this time / baseline time) inverted."""
    cells = []
    for k, v in row.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            continue
        if k.startswith("x_"):
            cells.append(f"{k[2:]} {v:.3g}x")
        elif k.startswith("time_vs_"):
            cells.append(f"{k[8:]} {1 / v:.3g}x")
    return ", ".join(cells) or None


def shape_of(row) -> str:
    """The row's case: the script's `group` (shape and op) if it has one, else its `shape`."""
    return str(row.get("group") or row.get("shape") or row.get("config") or "-")


COLUMNS = [("bench", "bench", ""), ("shape", "shape", ""), ("name", "formulation", ""),
           ("median_ms", "median ms", ".4g"), ("gbps", "GB/s", ".3g"), ("tflops", "TFLOP/s", ".3g"),
           ("of_copy_bw", "of copy BW", ".1%"), ("of_matmul", "of matmul", ".1%"), ("peak_mib", "peak MiB", ".4g"),
           ("mem_saving", "memory saving (x)", ".3g"), ("ratios", "speedup vs", "")]


def table_rows(rows):
    out = []
    for r in rows:
        d = dict(r)
        d["shape"] = shape_of(r)
        d["ratios"] = ratios(r)
        out.append(d)
    return out


def used_columns(rows, columns=COLUMNS):
    """Drop columns that no row fills (e.g. TFLOP/s in a memory-bound suite)."""
    return [c for c in columns if c[0] in ("bench", "shape", "name") or any(r.get(c[0]) is not None for r in rows)]


def render_charts(rows, stem):
    """One PNG per script: median time of each formulation per shape (log scale). Returns the paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no charts", file=sys.stderr)
        return []
    paths = []
    for bench in sorted({r["bench"] for r in rows}):
        rs = [r for r in rows if r["bench"] == bench and r.get("median_ms")]
        if not rs:
            continue
        shapes = list(dict.fromkeys(shape_of(r) for r in rs))
        names = list(dict.fromkeys(r["name"] for r in rs))
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(shapes) * len(names) + 1.5))
        height = 0.8 / len(names)
        for j, name in enumerate(names):
            ys, xs = [], []
            for i, shape in enumerate(shapes):
                hit = [r["median_ms"] for r in rs if r["name"] == name and shape_of(r) == shape]
                if hit:
                    ys.append(i + j * height)
                    xs.append(hit[0])
            bars = ax.barh(ys, xs, height=height, label=name)
            ax.bar_label(bars, fmt="%.3g", fontsize=6, padding=2)
        ax.set_xlim(min(r["median_ms"] for r in rs) / 4, max(r["median_ms"] for r in rs) * 4)  # room for labels
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(shapes))], shapes)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("median time per call (ms, log scale)")
        env = rs[0].get("env", {})
        ax.set_title(f"{bench}: {env.get('device', '')}"[:110], fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = f"{stem}-{bench}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def row_key(r):
    return (r.get("bench"), shape_of(r), r.get("name"), str(r.get("setting", "")))


def compare_rows(rows, base_rows):
    """Rows present in both runs: time here, time in the base run, base / here (> 1: this tree is faster)."""
    base = {row_key(r): r for r in base_rows}
    out = []
    for r in rows:
        b = base.get(row_key(r))
        if b and r.get("median_ms") and b.get("median_ms"):
            out.append({"bench": r["bench"], "shape": shape_of(r), "name": r["name"],
                        "median_ms": r["median_ms"], "base_ms": b["median_ms"],
                        "speedup": b["median_ms"] / r["median_ms"]})
    return out


def run_at_revision(rev, child_args, timeout):
    """The suite's rows at git revision `rev`: a temporary worktree, its extension built, this runner."""
    wt = tempfile.mkdtemp(prefix="crf_compare_")
    subprocess.run(["git", "-C", H.REPO, "worktree", "add", "--detach", wt, rev], check=True, capture_output=True)
    try:
        if not os.path.isdir(os.path.join(wt, "benchmarks")):
            raise SystemExit(f"--compare: {rev} has no benchmarks/ folder")
        # installed as compactionrl_fast.kernels by package_dir; from a source tree it must sit inside the package
        link = os.path.join(wt, "compactionrl_fast", "kernels")
        if os.path.isdir(os.path.join(wt, "kernels")) and not os.path.exists(link):
            os.symlink(os.path.join(wt, "kernels"), link)
        print(f"--compare: building {rev} in {wt} ...", file=sys.stderr, flush=True)
        build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=wt,
                               capture_output=True, text=True)
        if build.returncode != 0:
            raise SystemExit(f"--compare: building {rev} failed:\n{build.stderr[-3000:]}")
        out = os.path.join(wt, "compare.json")
        runner = os.path.abspath(__file__)
        cmd = [sys.executable, runner, "--root", wt, "--json", out, "--no-charts", "--no-roofline", *child_args]
        print(f"--compare: running the suite at {rev} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=wt, text=True, capture_output=True, timeout=timeout)
        sys.stderr.write(proc.stderr[-2000:])
        if proc.returncode not in (0, 1):  # 1: some scripts failed there; still compare the rest
            raise SystemExit(f"--compare: the suite at {rev} failed (exit {proc.returncode})")
        with open(out) as f:
            return json.load(f)
    finally:
        subprocess.run(["git", "-C", H.REPO, "worktree", "remove", "--force", wt], capture_output=True)
        shutil.rmtree(wt, ignore_errors=True)


# ---------------------------------------------------------------- main


def default_json(device, size):
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.join(RESULTS, f"suite-{torch.device(device).type}-{size}-{stamp}.json")


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI-sized shapes (seconds per script)")
    size.add_argument("--full", action="store_true", help="the issue-sized shapes (long on a CPU)")
    p.add_argument("--only", help="comma-separated script names (gae,losses,...)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, help="seconds of timing per row (default 0.1 quick, 0.5 else)")
    p.add_argument("--threads", type=int, help="torch intra-op threads, passed to the scripts")
    p.add_argument("--timeout", type=float, default=None, help="seconds per script before it counts as failed")
    p.add_argument("--json", help="output path (default benchmarks/results/suite-<device>-<size>-<date>.json)")
    p.add_argument("--compare", metavar="REV", help="also run the suite at git revision REV and print ratios")
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    p.add_argument("--no-roofline", action="store_true", help="skip the copy-bandwidth and matmul measurement")
    p.add_argument("--no-loops", action="store_true", help="skip python-loop baselines (scripts with --no-loop)")
    p.add_argument("--root", default=H.REPO, help=argparse.SUPPRESS)  # the tree whose scripts run (--compare)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    size = "quick" if args.quick else "full" if args.full else "default"
    budget = args.budget if args.budget is not None else (0.1 if args.quick else 0.5)
    root = os.path.abspath(args.root)
    names = discover(root, args.only.split(",") if args.only else None)
    out_json = args.json or default_json(args.device, size)
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    # the scripts' own output: next to an explicit --json, else in build/ (ignored by git)
    stem = os.path.splitext(out_json if args.json else os.path.join(H.REPO, "build", "bench-logs",
                                                                    os.path.basename(out_json)))[0]
    log_path = stem + ".log"
    os.makedirs(os.path.dirname(log_path), exist_ok=True)

    roof = None
    if not args.no_roofline:
        roof = roofline(args.device, min(budget, 0.5))
        print(f"roofline: copy {roof['copy_gbps']:.1f} GB/s (read+write), matmul {roof['matmul']} "
              f"{roof['matmul_tflops']:.3g} TFLOP/s", file=sys.stderr, flush=True)
    rows, durations, failures = [], {}, {}
    with open(log_path, "w") as log:
        for name in names:
            argv_s = script_argv(script_options(root, name), size, args.device, budget, args.threads, args.no_loops)
            print(f"... {name} {' '.join(argv_s)}", file=sys.stderr, flush=True)
            got, seconds, err = run_script(root, name, argv_s, timeout=args.timeout, log=log)
            durations[name] = round(seconds, 1)
            if err:
                failures[name] = err
                print(f"    FAILED ({err}); output in {log_path}", file=sys.stderr, flush=True)
            else:
                print(f"    {len(got)} rows in {seconds:.1f} s", file=sys.stderr, flush=True)
            rows += got
    add_roofline(rows, roof)

    env = H.environment(args.device)
    shown = table_rows(rows)
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | git {env['git']} | {env['date']}")
    if roof:
        print(f"roofline: copy {roof['copy_gbps']:.1f} GB/s, matmul {roof['matmul']} "
              f"{roof['matmul_tflops']:.3g} TFLOP/s")
    if shown:
        print(H.format_table(shown, used_columns(shown)))
    for name, err in failures.items():
        print(f"FAILED {name}: {err}")

    given = argv if argv is not None else sys.argv[1:]
    meta = {"kind": "suite", "command": " ".join(["python -m benchmarks"] + given),
            "env": env, "config": {"size": size, "budget_s": budget, "device": args.device, "device_type":
                                   torch.device(args.device).type, "benches": names, "threads": args.threads},
            "roofline": roof, "durations_s": durations, "failures": failures}
    if args.compare:
        child = _strip(given, ("--compare", "--json", "--root"), ("--no-charts", "--no-roofline"))
        base = run_at_revision(args.compare, child, timeout=None)
        cmp_rows = compare_rows(rows, base["rows"])
        base_git = base["rows"][0]["env"].get("git") if base["rows"] else None  # tagged by that tree's harness
        meta["compare"] = {"rev": args.compare, "git": base_git, "rows": cmp_rows, "failures": base["meta"]["failures"]}
        print(f"\ncompared with {args.compare} (git {base_git}): speedup = {args.compare} time / this tree's time")
        print(H.format_table(cmp_rows, [("bench", "bench", ""), ("shape", "shape", ""), ("name", "formulation", ""),
                                        ("median_ms", "ms here", ".4g"), ("base_ms", f"ms at {args.compare}", ".4g"),
                                        ("speedup", "speedup", ".3f")]))
    H.write_json(out_json, rows, **meta)
    print(f"wrote {os.path.relpath(out_json)} (log: {os.path.relpath(log_path)})")
    if not args.no_charts and rows:
        for path in render_charts(rows, os.path.splitext(out_json)[0]):
            print(f"wrote {os.path.relpath(path)}")
    return 1 if failures else 0


def _strip(argv, with_value, flags):
    """argv without the options in `with_value` (and their values) and the bare `flags`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in with_value:
            skip = True
        elif a.split("=")[0] in with_value or a in flags:
            continue
        else:
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
