"""The benchmark runner (`python -m benchmarks`) on a tiny fake suite: discovery, size flags, one table,
JSON with its tags, charts, failures; the compare logic; pytest-benchmark collection of the real scripts."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks import __main__ as runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAST = textwrap.dedent('''
    """A fake benchmark: rows that record the flags it was given."""
    import argparse, json, sys
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--full", action="store_true")
    p.add_argument("--device")
    p.add_argument("--budget", type=float)
    p.add_argument("--json")
    a = p.parse_args()
    size = "quick" if a.quick else "full" if getattr(a, "full", False) else "default"
    rows = [{"shape": "8x8", "name": n, "median_ms": ms, "gbps": gb, "x_naive": 10.0 / ms, "setting": size,
             "env": {"device": "fake", "git": "abc"}} for n, ms, gb in (("fused", 1.0, 2.0), ("naive", 10.0, 0.2))]
    with open(a.json, "w") as f:
        json.dump({"meta": {}, "rows": rows}, f)
''')
BROKEN = 'import sys\nprint("boom", file=sys.stderr)\nsys.exit(3)\n'
NO_FULL = FAST.replace('p.add_argument("--full", action="store_true")\n', "")


@pytest.fixture()
def fake_root(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "bench_fast.py").write_text(FAST)
    (tmp_path / "benchmarks" / "bench_broken.py").write_text(BROKEN)
    return tmp_path


def test_runner_on_a_fake_suite(fake_root, tmp_path, capsys):
    out = tmp_path / "res" / "suite.json"
    rc = runner.main(["--root", str(fake_root), "--json", str(out), "--no-roofline", "--quick", "--timeout", "60"])
    assert rc == 1  # bench_broken failed; the others still ran
    text = capsys.readouterr().out
    assert "fused" in text and "naive 10x" in text and "FAILED broken: exit 3: boom" in text
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["kind"] == "suite" and meta["config"]["size"] == "quick"
    assert meta["config"]["benches"] == ["broken", "fast"]
    assert set(meta["env"]) >= {"device", "torch", "triton", "git", "date"}
    assert meta["failures"].keys() == {"broken"} and meta["command"].startswith("python -m benchmarks")
    assert [r["bench"] for r in data["rows"]] == ["fast", "fast"] and data["rows"][0]["setting"] == "quick"
    assert (tmp_path / "res" / "suite-fast.png").stat().st_size > 1000
    assert "boom" in (tmp_path / "res" / "suite.log").read_text()


def test_size_flags(fake_root, tmp_path):
    (fake_root / "benchmarks" / "bench_nofull.py").write_text(NO_FULL)
    opts = runner.script_options(str(fake_root), "fast")
    assert {"--quick", "--full", "--json"} <= opts
    assert "--full" not in runner.script_options(str(fake_root), "nofull")
    argv = lambda name, size: runner.script_argv(runner.script_options(str(fake_root), name), size, "cpu", 0.1, 2)
    assert argv("fast", "quick")[-1] == "--quick" and argv("fast", "full")[-1] == "--full"
    assert "--quick" not in argv("fast", "default") and "--full" not in argv("fast", "default")
    # a script without --full defaults to the issue-sized shapes: the moderate default runs its --quick
    assert argv("nofull", "default")[-1] == "--quick" and "--quick" not in argv("nofull", "full")
    assert "--threads" not in argv("fast", "default")
    out = tmp_path / "d.json"
    assert runner.main(["--root", str(fake_root), "--only", "fast", "--json", str(out), "--no-roofline",
                        "--no-charts"]) == 0
    assert json.loads(out.read_text())["rows"][0]["setting"] == "default"
    with pytest.raises(SystemExit, match="bench_nope"):
        runner.main(["--root", str(fake_root), "--only", "nope"])


def test_compare_rows_and_argv_strip():
    here = [{"bench": "gae", "shape": "a", "name": "cpp", "median_ms": 2.0},
            {"bench": "gae", "shape": "a", "name": "new", "median_ms": 1.0}]
    base = [{"bench": "gae", "shape": "a", "name": "cpp", "median_ms": 3.0}]
    (row,) = runner.compare_rows(here, base)
    assert row["speedup"] == 1.5 and row["base_ms"] == 3.0
    assert runner._strip(["--quick", "--compare", "HEAD~1", "--json=x", "--no-charts", "--only", "gae"],
                         ("--compare", "--json"), ("--no-charts",)) == ["--quick", "--only", "gae"]


def test_roofline_numbers_are_positive():
    roof = runner.roofline("cpu", 0.05, copy_bytes=1 << 24, matmul_n=256)
    assert roof["copy_gbps"] > 0 and roof["matmul_tflops"] > 0
    rows = runner.add_roofline([{"gbps": roof["copy_gbps"] / 2}, {"tflops": roof["matmul_tflops"]}], roof)
    assert rows[0]["of_copy_bw"] == pytest.approx(0.5) and rows[1]["of_matmul"] == pytest.approx(1.0)


def test_benchmarks_are_collected_by_pytest_benchmark():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "benchmarks"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "benchmarks/bench_gae.py::" in out.stdout


def test_report_rewrites_only_the_results_section(fake_root, tmp_path):
    from benchmarks import report

    results = tmp_path / "results"
    for size in ("quick", "default", "quick"):  # the later quick run must not replace the default one
        flag = ["--quick", "--no-charts"] if size == "quick" else []
        runner.main(["--root", str(fake_root), "--only", "fast", "--no-roofline", *flag,
                     "--json", str(results / f"suite-cpu-{size}-{len(os.listdir(tmp_path))}.json")])
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nkeep me\n\n{report.START}\nold\n{report.END}\n\ntail\n")
    assert report.main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert report.main(["--results", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nkeep me\n\n") and text.endswith(f"{report.END}\n\ntail\n")
    body = text.split(report.START)[1].split(report.END)[0]
    assert "| fast | 8x8 | fused |" in body and "default sizes" in body and "quick sizes" not in body
    assert "python -m benchmarks" in body and "GPU: not measured yet" in body
    assert "![fast](results/suite-cpu-default-" in body
    assert report.main(["--results", str(results), "--readme", str(readme), "--check"]) == 0
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="results:start"):
        report.main(["--results", str(results), "--readme", str(readme)])


@pytest.mark.skipif("triton" not in __import__("compactionrl_fast").available_backends(__import__("torch").device("cpu")),
                    reason="needs the Triton interpreter")
def test_bench_gae_gpu_plan_rows_run_under_the_interpreter(monkeypatch):
    """`bench_gae.py --gpu-plans` (gpu_check's gae_plans stage) times the Triton default plan and the look-back
    plan, code that otherwise runs only on a GPU: here both run on CPU tensors (Triton interpreted), the
    look-back row really launches the look-back kernel, and both agree with the C++ backend."""
    import types

    import torch

    from benchmarks import bench_gae as B
    from compactionrl_fast.kernels import gae as kgae

    monkeypatch.setattr(B, "available", lambda device: ["cpp", "triton", "torch"])
    launched = []
    real = kgae._gae_lookback_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(kgae, "_gae_lookback_kernel", Spy())
    b = B.make_batch(5, 700, 0, True)
    rows = B.formulations(b, types.SimpleNamespace(type="cuda"), oracle=False, loops=False, plans=True)
    fns = {name: fn for name, fn, _, _ in rows}
    assert {"triton", "triton recipe", "triton lookback"} <= set(fns), sorted(fns)
    want = fns["cpp"]()
    assert not launched
    for name in ("triton", "triton lookback"):
        got = fns[name]()
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert len(launched) == 1
