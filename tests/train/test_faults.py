"""Fault test: kill -9 a tiny CPU training run at seeded random points (checkpoint and SFT writes included),
restart it with no manual cleanup, and check that the final state equals an uninterrupted run bitwise."""
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from compactionrl_fast.train import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# runner.train (`python -m compactionrl_fast train`) on the tiny task (SFT 2 steps, 1 value pre-training step, 2 PPO steps, a checkpoint after
# every step), without the plots (matplotlib would dominate the time and plots are not state)
# every restart of the killed run installs the kill switch (tests/train/_kill_hook.py) when given one:
# argv[2] = k kills at the k-th atomic write of the process, NAME at the first write of NAME
DRIVER = """
import sys
from compactionrl_fast.app import plots, runner
from tests.train._tiny import tiny_train_config
if len(sys.argv) > 2:
    from tests.train._kill_hook import install
    install(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
plots.plot_run = lambda *a, **k: []
runner.train(tiny_train_config(sys.argv[1], checkpoint_every=1, threads=1))
"""


def _start(run_dir, kill_at_write=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    at = [] if kill_at_write is None else [str(kill_at_write)]
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(run_dir), *at], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _finish(p, timeout=300):
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err.decode(errors="replace")


def _final_state(run_dir):
    data = checkpoint.read(os.path.join(run_dir, checkpoint.NAME))
    with open(os.path.join(run_dir, "actor", "model.safetensors"), "rb") as f:
        return data, f.read()


def _assert_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_kill_9_anywhere_then_restart_equals_an_uninterrupted_run(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref = _start(ref_dir)
    rng = random.Random(1234)
    # kills inside a write: sft_actor.pt, the first checkpoint, a later one, at a random time, then inside
    # the export of the Hugging Face actor directory (each process counts its writes from 1: config.json,
    # [sft_actor.pt], a checkpoint after each step, the final checkpoint, actor/)
    plan = [("write", 2), ("write", 3), ("write", rng.randint(3, 5)), ("time", rng.uniform(3.0, 6.0)),
            ("write", "actor")]
    for kind, at in plan:
        p = _start(run_dir, kill_at_write=at if kind == "write" else None)
        if kind == "time":
            try:
                p.wait(timeout=at)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        rc, err = _finish(p)
        # a write hook always fires (every restart writes again); the timed kill may land after the end
        assert rc == -signal.SIGKILL or (kind == "time" and rc == 0), (kind, at, rc, err[-3000:])
    rc, err = _finish(_start(run_dir))  # the last restart runs to the end
    assert rc == 0, err[-3000:]
    rc, err = _finish(ref)
    assert rc == 0, err[-3000:]

    (a, a_weights), (b, b_weights) = _final_state(ref_dir), _final_state(run_dir)
    assert a["step"] == b["step"] == 3
    _assert_equal(a["models"], b["models"], "models")
    _assert_equal(a["optimizers"], b["optimizers"], "optimizers")
    assert a_weights == b_weights  # the exported Hugging Face actor
    # no temporary file is left, and the resumed log holds each step once
    left = [os.path.join(d, f) for d, dirs, files in os.walk(run_dir) for f in files + dirs if ".tmp-" in f]
    assert left == []
    rows = checkpoint_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]


def checkpoint_rows(run_dir):
    from compactionrl_fast.train.log import read_rows

    return read_rows(os.path.join(run_dir, "metrics.jsonl"))
