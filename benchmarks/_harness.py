"""Shared benchmark harness: timing, peak memory, environment tags, tables and JSON.

A benchmark script builds rows with `measure(name, fn, device=..., nbytes=..., config=...)`, adds ratios
with `add_speedups`, prints them with `format_table` and saves them with `write_json`.

How things are measured (keep the benchmarks' claims honest):
- time: `warmup` calls, then the median (and min) of `reps` calls, `reps` chosen so that timing takes
  about `budget_s` (at least `min_reps`). CPU: `time.perf_counter` around each call. CUDA: a pair of
  CUDA events around each call. Python's garbage collector is off while timing. Each call allocates its
  outputs afresh and drops them, as a caller would.
- GB/s: the caller's byte count (what the op must read and write once) over the median time.
- peak memory: CUDA: `max_memory_allocated` during one call minus the memory allocated before it.
  CPU: torch's CPU allocator reports every allocation and free to the profiler; we run one call under
  `torch.profiler` with `profile_memory=True` and take the peak of the running sum of allocated minus
  freed bytes. Both count the outputs. Memory that does not come from torch's allocator (e.g. buffers a
  C function mallocs itself) is not seen.
- page faults: minor faults per call on CPU (`getrusage`). A fresh multi-MiB output that glibc serves
  with a new `mmap` is faulted in page by page (about 2.6 us per 4 KiB page on the 2-core dev VM: ~5 ms
  per 1M-token GAE call, more than the scan itself). Long-running training processes do not pay this:
  glibc raises its mmap threshold (to at most 32 MiB) the first time such a block is freed, after which
  blocks come from the heap and are reused. `settle_malloc()` puts a benchmark process in that steady
  state, so timings do not depend on allocation history; the faults column shows it worked.
"""
from __future__ import annotations

import datetime
import functools
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

import torch

from compactionrl_fast.app._git import git_revision

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def settle_malloc():
    """Free one 24 MiB tensor so that glibc's dynamic mmap threshold rises (see the module docstring)."""
    x = torch.empty(24 << 18, dtype=torch.float32)
    x.fill_(0.0)
    del x


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


@functools.lru_cache(None)
def _environment(device: str) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git": git_revision(REPO) or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def environment(device) -> dict:
    """Tags for every row: device name, versions, git revision, date and load (taken once per device)."""
    return dict(_environment(str(torch.device(device))))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device="cpu", *, warmup=2, budget_s=1.0, min_reps=3, max_reps=100) -> dict:
    """Median and min wall time of `fn()` in ms, after `warmup` calls; also minor page faults per call.

    `warmup=0` (for a caller that has just run `fn` itself) times `min_reps` calls.
    """
    device = torch.device(device)
    est = float("inf")
    for _ in range(warmup):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        est = min(est, time.perf_counter() - t0)
    reps = int(min(max_reps, max(min_reps, math.ceil(budget_s / max(est, 1e-9)))))
    times = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    try:
        if device.type == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            _sync(device)
            for start, end in events:
                start.record()
                fn()
                end.record()
            _sync(device)
            times = [start.elapsed_time(end) for start, end in events]
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / reps
        if gc_was_enabled:
            gc.enable()
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps, "faults_per_call": faults}


def time_round_robin(fns, device, *, budget_s, min_reps=3, max_reps=20):
    """{name: timing} with one call of every formulation per round, so that the load of a shared machine
    drifts over all of them alike (calls take seconds on a CPU). Median and min wall ms, and the median
    process CPU ms (all threads) of each; the caller has run every fn once already (the warm-up)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    est = 0.0
    for fn in fns.values():
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        est += time.perf_counter() - t0
    reps = int(min(max_reps, max(min_reps, math.ceil(budget_s / max(est, 1e-9)))))
    wall, cpu = {n: [] for n in fns}, {n: [] for n in fns}
    gc.disable()
    try:
        for _ in range(reps):
            for name, fn in fns.items():
                sync()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                sync()
                wall[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((time.process_time() - c0) * 1e3)
    finally:
        gc.enable()
    return {n: {"median_ms": statistics.median(wall[n]), "min_ms": min(wall[n]), "reps": reps,
                "cpu_ms": statistics.median(cpu[n])} for n in fns}


def _cpu_peak_bytes(fn):
    from torch._C._profiler import _EventType  # private, but the only record of CPU allocation order
    from torch.profiler import ProfilerActivity, profile

    err = os.dup(2)  # kineto logs every start/stop to stderr; keep the benchmark's output readable
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
            del out
    finally:
        os.dup2(err, 2)
        os.close(err)

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    allocs = [e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
              if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    running, peak = 0, 0
    for e in sorted(allocs, key=lambda e: e.start_time_ns):
        running += e.extra_fields.alloc_size
        peak = max(peak, running)
    return peak


def peak_memory(fn, device="cpu"):
    """Peak extra bytes torch allocates during one call of `fn()` (outputs included); None if unmeasurable."""
    device = torch.device(device)
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return peak
    try:
        return _cpu_peak_bytes(fn)
    except (ImportError, AttributeError, RuntimeError):
        return None


def measure(name, fn, *, device="cpu", nbytes=None, config=None, memory=True, **timing) -> dict:
    """One result row: `config` keys, `name`, time (ms), GB/s from `nbytes`, peak MiB, faults, env tags."""
    row = dict(config or {})
    row["name"] = name
    row.update(time_fn(fn, device, **timing))
    row["gbps"] = nbytes / (row["median_ms"] * 1e-3) / 1e9 if nbytes else None
    row["gbps_min_time"] = nbytes / (row["min_ms"] * 1e-3) / 1e9 if nbytes else None
    peak = peak_memory(fn, device) if memory else None
    row["peak_mib"] = None if peak is None else peak / 2**20
    row["env"] = environment(device)
    return row


def add_speedups(rows, baseline: str, column: str, group: str = "shape", stat: str = "median_ms"):
    """row[column] = baseline's time / row's time (`stat`: "median_ms" or "min_ms"), within rows sharing
    `row[group]`. On a loaded machine the min is the better estimate of the uncontended time."""
    base = {r[group]: r[stat] for r in rows if r["name"] == baseline}
    for r in rows:
        b = base.get(r[group])
        r[column] = b / r[stat] if b is not None else None
    return rows


def _cells(rows, columns):
    def fmt(value, spec):
        if value is None:
            return "-"
        return format(value, spec) if spec else str(value)

    head = [h for _, h, _ in columns]
    body = [[fmt(r.get(k), spec) for k, _, spec in columns] for r in rows]
    return head, body


def format_table(rows, columns) -> str:
    """Aligned text table; `columns` is a list of (row key, header, format spec or "")."""
    head, body = _cells(rows, columns)
    width = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, width)))
    return "\n".join([line(head), line(["-" * w for w in width])] + [line(b) for b in body])


def markdown_table(rows, columns) -> str:
    head, body = _cells(rows, columns)
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(b) + " |" for b in body])


def command_line() -> str:
    """The command that produced this run, for the results files."""
    return " ".join(["python"] + [os.path.relpath(sys.argv[0], REPO) if sys.argv[0].endswith(".py") else sys.argv[0]]
                    + sys.argv[1:])


def write_json(path, rows, **meta):
    """Write {"meta": ..., "rows": [...]} to `path` (folders created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
        f.write("\n")


def report(title, rows, columns, env, notes, json_path=None):
    """Print the table, the notes and the load average; with `json_path`, write JSON and a markdown copy."""
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | git {env['git']} | {env['date']} "
          f"| load {env['loadavg_at_start']}")
    print(format_table(rows, columns))
    for n in notes:
        print("note:", n)
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(f"load average at the end: {load_end}")
    if json_path:
        cmd = command_line()
        write_json(json_path, rows, command=cmd, env=env, loadavg_at_end=load_end, notes=notes)
        md = os.path.splitext(json_path)[0] + ".md"
        with open(md, "w") as f:
            f.write(f"# {title}\n\nCommand: `{cmd}`\n\n"
                    + "".join(f"- {k}: {v}\n" for k, v in env.items()) + f"- loadavg_at_end: {load_end}\n\n"
                    + markdown_table(rows, columns) + "\n\n" + "".join(f"- {n}\n" for n in notes))
        print(f"wrote {json_path} and {md}")
