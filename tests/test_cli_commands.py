"""Each command of `compactionrl_fast.app.cli` hands its arguments to the function that does the work: the demo,
the ablations, the runner, the plots, the benchmarks (replaced here by recorders, so nothing trains), in this
process. tests/test_cli.py checks the help texts and the runs themselves."""
import dataclasses
import os
import sys

import pytest

from compactionrl_fast.app import ablations, cli, demo, plots, runner
from compactionrl_fast.train.config import TrainConfig


def _record(monkeypatch, module, name, result=None):
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return result

    monkeypatch.setattr(module, name, fake)
    return calls


def test_demo_defaults(monkeypatch):
    calls = _record(monkeypatch, demo, "run")
    assert cli.main(["demo"]) == 0
    [(args, kw)] = calls
    assert args == (demo.demo_config(),)
    assert kw == dict(seeds=[0], ablation_seeds=[0], eval_rollouts=demo.demo_config().eval_rollouts, out_dir=None,
                      name="demo_cpu", argv=["demo"], record=False, workers="auto")


def test_demo_options_and_config_flags(monkeypatch, tmp_path):
    calls = _record(monkeypatch, demo, "run")
    argv = ["--seeds", "3", "4", "--ablation-seeds", "4", "5", "--out", str(tmp_path), "--name", "n", "--record",
            "--workers", "2", "--set", "steps=7", "--set", "eval_rollouts=9"]
    assert cli.main(["demo", *argv]) == 0
    [(args, kw)] = calls
    assert args == (dataclasses.replace(demo.demo_config(), steps=7, eval_rollouts=9),)
    assert kw == dict(seeds=[3, 4], ablation_seeds=[4, 5], eval_rollouts=9, out_dir=str(tmp_path), name="n",
                      argv=["demo", *argv], record=True, workers=2)
    calls.clear()
    assert cli.main(["demo", "--seeds", "3", "4"]) == 0  # the ablation runs on the first seed only
    assert calls[0][1]["ablation_seeds"] == [3]
    calls.clear()
    assert cli.main(["demo", "--seeds", "3", "--ablation-seeds", "3", "--no-ablation"]) == 0
    assert calls[0][1]["ablation_seeds"] == []


def test_ablations_defaults_and_options(monkeypatch):
    calls = _record(monkeypatch, ablations, "run")
    assert cli.main(["ablations"]) == 0
    [(args, kw)] = calls
    assert args == (demo.demo_config(run_dir="runs/ablations"),)
    assert kw == dict(seeds=[0, 1, 2], variants=list(ablations.VARIANTS), name="ablations", argv=["ablations"],
                      workers="auto")
    calls.clear()
    variant = list(ablations.VARIANTS)[-1]
    argv = ["--seeds", "5", "--variants", variant, "--name", "x", "--workers", "3", "--set", "steps=2"]
    assert cli.main(["ablations", *argv]) == 0
    [(args, kw)] = calls
    assert args == (demo.demo_config(run_dir="runs/ablations", steps=2),)
    assert kw == dict(seeds=[5], variants=[variant], name="x", argv=["ablations", *argv], workers=3)
    with pytest.raises(SystemExit) as e:
        cli.main(["ablations", "--variants", "no-such-variant"])
    assert e.value.code == 2


def test_train_resumes_unless_told(monkeypatch):
    calls = _record(monkeypatch, runner, "train")
    assert cli.main(["train"]) == 0
    assert cli.main(["train", "--no-resume", "--set", "steps=3"]) == 0
    assert calls == [((TrainConfig(),), dict(resume=True)),
                     ((dataclasses.replace(TrainConfig(), steps=3),), dict(resume=False))]


@pytest.mark.parametrize("command,module,name,base", [("demo", demo, "run", demo.demo_config()),
                                                      ("ablations", ablations, "run", demo.demo_config()),
                                                      ("train", runner, "train", TrainConfig())])
def test_help_config_runs_nothing(monkeypatch, capsys, command, module, name, base):
    calls = _record(monkeypatch, module, name)
    assert cli.main([command, "--help-config"]) == 0
    assert calls == []
    assert capsys.readouterr().out == cli.config_reference(base) + "\n"


@pytest.mark.parametrize("command", ["demo", "ablations"])
def test_workers_take_auto_or_a_positive_int(monkeypatch, capsys, command):
    calls = _record(monkeypatch, demo if command == "demo" else ablations, "run")
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(SystemExit) as e:
            cli.main([command, "--workers", bad])
        assert e.value.code == 2
        assert f"expected an int >= 1 or 'auto', got {bad!r}" in capsys.readouterr().err
    assert calls == []
    assert cli.main([command, "--workers", "auto"]) == 0 and calls[-1][1]["workers"] == "auto"
    assert cli.main([command, "--workers", "1"]) == 0 and calls[-1][1]["workers"] == 1


def test_plot_prints_each_file(monkeypatch, capsys, tmp_path):
    calls = _record(monkeypatch, plots, "plot_run", result=["a.png", "b.png"])
    assert cli.main(["plot", str(tmp_path)]) == 0
    assert cli.main(["plot", str(tmp_path), "--out", "o"]) == 0
    assert calls == [((str(tmp_path), None), {}), ((str(tmp_path), "o"), {})]
    assert capsys.readouterr().out == "a.png\nb.png\n" * 2


def test_bench_runs_the_checkout_benchmarks(monkeypatch):
    calls = _record(monkeypatch, cli.subprocess, "call", result=5)
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    assert cli.main(["bench", "--quick"]) == 5  # the benchmarks' exit status
    [(args, kw)] = calls
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert args == ([sys.executable, "-m", "benchmarks", "--quick"],)
    assert kw["env"]["PYTHONPATH"] == os.pathsep.join([root, "elsewhere"])
    monkeypatch.delenv("PYTHONPATH")
    assert cli.main(["bench"]) == 5 and calls[-1][1]["env"]["PYTHONPATH"] == root


def test_bench_outside_a_checkout(monkeypatch, capsys, tmp_path):
    calls = _record(monkeypatch, cli.subprocess, "call", result=0)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "pkg" / "app" / "cli.py"))  # no benchmarks/ above it
    assert cli.main(["bench"]) == 2
    assert calls == [] and "not installed with the package" in capsys.readouterr().err


@pytest.mark.parametrize("argv,code", [([], 2), (["-h"], 0), (["--help"], 0), (["nope"], 2)])
def test_main_without_a_command_prints_the_commands(capsys, argv, code):
    assert cli.main(argv) == code
    assert capsys.readouterr().out == cli.__doc__ + "\n"


def test_main_reads_sys_argv(monkeypatch):
    calls = _record(monkeypatch, runner, "train")
    monkeypatch.setattr(sys, "argv", ["compactionrl-fast", "train", "--no-resume"])
    assert cli.main() == 0 and calls[0][1] == dict(resume=False)
