"""Helpers of benchmarks/gpu_check.sh (no network, no installs; Python 3.10+ and torch).

    python benchmarks/gpu_check_lib.py probe OUT/probe.json      versions and the GPU; exit 3 when none is usable
    python benchmarks/gpu_check_lib.py cuda-home                 the CUDA toolkit setup.py would use, or nothing
    python benchmarks/gpu_check_lib.py failed PREV.json STAGE    what STAGE failed last time: "all", "none", or
                                                                 pytest node ids, one a line
    python benchmarks/gpu_check_lib.py report OUT [PREV.json]    OUT/gpu_check.json from the stage files in OUT
                                                                 (stages.tsv, *.xml, bench.json, probe.json); with
                                                                 PREV, stages not rerun keep their earlier results
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception as e:  # noqa: BLE001
        return f"not importable ({type(e).__name__})"


def probe(path):
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "triton": _version("triton"), "numpy": _version("numpy"), "pytest": _version("pytest"),
            "vllm": _version("vllm"), "host": platform.node(), "gpus": []}
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        info["nvcc"] = out[-1] if out else nvcc
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    why = None
    try:
        n = torch.cuda.device_count() if torch.version.cuda else 0
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "sm": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)})
        if not n:
            why = ("torch is a CPU build" if torch.version.cuda is None else
                   f"torch sees no GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                   f"nvidia-smi {'present' if smi else 'absent'})")
    except Exception as e:  # noqa: BLE001 -- a broken driver is "no GPU" too, with its reason
        why = f"{type(e).__name__}: {e}"
    info["no_gpu_reason"] = why
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    gpus = ", ".join(f"{g['name']} sm_{g['sm'].replace('.', '')}" for g in info["gpus"]) or f"no GPU ({why})"
    print(f"python {info['python']} | torch {info['torch']} (CUDA {info['torch_cuda']}) | triton {info['triton']} | "
          f"numpy {info['numpy']} | {info.get('nvcc', 'no nvcc')} | vllm {info['vllm']} | {gpus}")
    return 0 if info["gpus"] else 3


def cuda_home():
    """Runs setup.py with setuptools.setup stubbed out: the same toolkit search and messages as the build."""
    import runpy

    import setuptools

    setuptools.setup = lambda **kw: None
    os.environ.setdefault("COMPACTIONRL_FAST_BUILD_CUDA", "auto")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        ns = runpy.run_path(os.path.join(REPO, "setup.py"), run_name="crf_setup_probe")
    finally:
        os.chdir(cwd)
    home, _ = ns["find_cuda_home"]()
    if home:
        print(home)
    return 0


def _junit(path, stage):
    """One dict per test case of a pytest --junitxml file."""
    out = []
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return out
    for case in root.iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        node = f"{file}::{case.get('name')}"
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "")[:500]
            elif child.tag == "skipped":
                xfail = (child.get("type") or "") == "pytest.xfail"
                outcome, message = ("xfailed" if xfail else "skipped"), (child.get("message") or "")[:300]
        out.append({"stage": stage, "test": node, "outcome": outcome, "seconds": float(case.get("time") or 0),
                    "message": message})
    return out


def _stages(out):
    rows = []
    path = os.path.join(out, "stages.tsv")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                name, status, seconds, note = (line.rstrip("\n").split("\t") + ["", "", ""])[:4]
                rows.append({"stage": name, "status": status, "seconds": float(seconds or 0), "note": note})
    return rows


def report(out, prev_path=None):
    prev = {}
    if prev_path and os.path.exists(prev_path):
        with open(prev_path) as f:
            prev = json.load(f)
    stages = _stages(out)
    ran = {s["stage"] for s in stages if s["status"] != "SKIP"}
    tests = []
    for s in stages:
        xml = os.path.join(out, f"{s['stage']}.xml")
        if os.path.exists(xml):
            tests += _junit(xml, s["stage"])
    if prev:  # a rerun: keep what was not rerun, and the earlier passes of a stage rerun for its failures only
        rerun_ids = {t["test"] for t in tests}
        tests = [t for t in prev.get("tests", []) if t["test"] not in rerun_ids] + tests
        stages = [s for s in prev.get("stages", []) if s["stage"] not in ran] + [s for s in stages if s["stage"] in ran]
    bench = {}
    bench_path = os.path.join(out, "bench.json")
    if os.path.exists(bench_path):
        with open(bench_path) as f:
            suite = json.load(f)
        meta = suite.get("meta", {})
        bench = {"roofline": meta.get("roofline"), "failures": meta.get("failures"),
                 "durations_s": meta.get("durations_s"), "rows": suite.get("rows", [])}
    elif prev.get("benchmarks"):
        bench = prev["benchmarks"]
    plans_path = os.path.join(out, "gae_plans.json")
    if os.path.exists(plans_path):
        with open(plans_path) as f:
            bench["gae_plans"] = json.load(f).get("rows", [])
    probe_info = {}
    if os.path.exists(os.path.join(out, "probe.json")):
        with open(os.path.join(out, "probe.json")) as f:
            probe_info = json.load(f)
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    result = {"environment": probe_info or prev.get("environment"), "stages": stages, "test_counts": counts,
              "tests": tests, "benchmarks": bench, "rerun_of": prev_path if prev else None}
    path = os.path.join(out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"tests: {counts}; benchmark rows: {len(bench.get('rows') or [])}")
    return 0


def failed(prev_path, stage):
    """What `stage` has to redo after the run recorded in prev_path: all, none, or its failed test ids."""
    with open(prev_path) as f:
        prev = json.load(f)
    st = {s["stage"]: s for s in prev.get("stages", [])}.get(stage)
    if st is None or st["status"] not in ("PASS", "SKIP"):
        bad = [t["test"] for t in prev.get("tests", []) if t["stage"] == stage and t["outcome"] == "failed"]
        # a stage that failed without failing tests (timeout, crash, build) is redone whole
        print("\n".join(bad) if bad and st is not None and "timeout" not in st.get("note", "") else "all")
    elif st["status"] == "SKIP" and ("after" in st.get("note", "") or "no GPU" in st.get("note", "")):
        print("all")  # skipped because an earlier stage failed, or there was no GPU
    else:
        print("none")
    return 0


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    sys.exit({"probe": probe, "cuda-home": cuda_home, "failed": failed, "report": report}[cmd](*args))
