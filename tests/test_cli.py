"""The command line's help: allowed values in every option, every config key documented (and
docs/config.md in step with the dataclasses), `bench` from outside the checkout.

`python -m tests.test_cli --update` rewrites the generated table of docs/config.md."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from compactionrl_fast.app import cli
from compactionrl_fast.train.config import HELP, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_MD = os.path.join(ROOT, "docs", "config.md")


def _help(command, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


@pytest.mark.parametrize("command", ["train", "demo", "ablations"])
def test_help_lists_allowed_values(command, capsys):
    out = _help(command, capsys)
    for text in ("paper | none | stitched", "token-mean | segment-mean | rollout-mean | sum", "'adaptive'",
                 "0 keeps torch's default", "--help-config", "rollout | segment"):
        assert text in out, text


def test_every_config_key_has_help():
    keys = [k for k, *_ in cli.config_rows()]
    assert len(keys) == len(set(keys))
    missing = [k for k, _, _, _, h in cli.config_rows() if not h]
    assert not missing, f"config keys without help in train/config.py HELP: {missing}"
    # every dataclass field is listed, and HELP names no field that does not exist
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    sections = ("model", "sft", "vllm", "server")
    fields |= {f"{s}.{f.name}" for s in sections for f in dataclasses.fields(getattr(TrainConfig(), s))}
    assert fields - set(sections) <= set(keys)
    assert set(HELP) <= set(keys)


def test_help_config_prints_every_key(capsys):
    assert cli.main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    for k, *_ in cli.config_rows():
        assert f"\n{k} " in out, k


def replace_block(text: str, tag: str, body: str) -> str:
    """`text` with the lines between `<!-- TAG:start -->` and `<!-- TAG:end -->` replaced by `body`."""
    start, end = f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no {start} ... {end} block in the text")
    return text[:i + len(start)] + "\n" + body.strip("\n") + "\n" + text[j:]


def _config_md(text: str) -> str:
    return replace_block(text, "config", cli.config_reference(markdown=True))


def test_docs_config_table_is_current():
    text = open(CONFIG_MD).read()
    assert _config_md(text) == text, "docs/config.md is out of date: python -m tests.test_cli --update"


def test_bench_runs_from_another_directory(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "compactionrl_fast", "bench", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout and "benchmarks" in p.stdout


def test_unknown_command_lists_commands(capsys):
    assert cli.main(["nope"]) == 2
    out = capsys.readouterr().out
    assert all(c in out for c in cli.COMMANDS)


def test_console_script_and_main_module_point_at_the_cli():
    """pyproject's `compactionrl-fast` script and `python -m compactionrl_fast` both run app/cli.py's main."""
    import importlib

    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["compactionrl-fast"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main
    out = subprocess.run([sys.executable, "-m", "compactionrl_fast", "nope"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and all(c in out.stdout for c in cli.COMMANDS)


def test_demo_writes_under_run_dir_and_record_writes_results_only(tmp_path, monkeypatch):
    import torch

    from compactionrl_fast.app import demo

    from .train._tiny import tiny_train_config

    # a stand-in checkout: a README, benchmarks/results/
    root = tmp_path / "checkout"
    (root / "benchmarks" / "results").mkdir(parents=True)
    readme = "intro\n<!-- demo:start -->\nold numbers\n<!-- demo:end -->\nrest\n"
    (root / "README.md").write_text(readme)
    monkeypatch.setattr(demo, "_checkout_root", lambda: str(root))
    # the jobs in this process at 1 thread (what is checked here is where the files go; worker processes are
    # started by the demo tests: tests/test_demo_golden.py, and tests/train/test_smoke.py compares both ways):
    # at torch's default threads a tiny model's steps wait on each other's threads when the machine is busy
    cfg = tiny_train_config(tmp_path / "runs", threads=1)
    threads = torch.get_num_threads()
    try:
        res = demo.run(cfg, seeds=[0], ablation_seeds=[], eval_rollouts=4, argv=["demo", "--tiny"], record=True,
                       workers=1)
    finally:
        torch.set_num_threads(threads)
    for ext in ("json", "md", "png"):  # under the run dir, and recorded
        assert (tmp_path / "runs" / f"demo_cpu.{ext}").is_file()
        assert (root / "benchmarks" / "results" / f"demo_cpu.{ext}").is_file()
    assert (tmp_path / "runs" / "seed0" / "sft" / "plots" / "sft.png").is_file()
    assert (root / "README.md").read_text() == readme  # --record leaves the README alone
    md = (root / "benchmarks" / "results" / "demo_cpu.md").read_text()
    assert f"git `{res['machine']['git']}`" in md and "torch " in md and "| 0 |" in md
    assert "Targets: " in md and "![training success and summary recall](demo_cpu.png)" in md
    assert res["versions"]["packages"]["torch"] and res["versions"]["python"]


def test_record_needs_a_checkout_with_results_folder(tmp_path, monkeypatch):
    from compactionrl_fast.app import demo

    monkeypatch.setattr(demo, "__file__", str(tmp_path / "pkg" / "app" / "demo.py"))  # no benchmarks/results/ there
    with pytest.raises(ValueError, match="source checkout"):
        demo._checkout_root()


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        print(__doc__)
        raise SystemExit(2)
    text = open(CONFIG_MD).read()
    with open(CONFIG_MD, "w") as f:
        f.write(_config_md(text))
    print(f"wrote {CONFIG_MD}")
