"""threads="auto": the tuner probes each thread count and keeps the fastest; what the count changes in the numbers
(the last bits by default, nothing in MKL's strict CNR mode)."""
import os
import subprocess
import sys
import time

import pytest
import torch

from compactionrl_fast.train.threads import SharedThreads, ThreadTuner, make_tuner, maybe_step


def _run(tuner, cost, steps):
    """Run `steps` fake steps whose duration is cost[threads]; return the thread count of each."""
    seen = []
    for _ in range(steps):
        with tuner.step() as n:
            assert torch.get_num_threads() == n
            time.sleep(cost[n])
        seen.append(n)
    return seen


def test_tuner_probes_each_choice_then_keeps_the_fastest():
    tuner = ThreadTuner(choices=(1, 2), probe=2, period_s=3600)
    assert _run(tuner, {1: 0.03, 2: 0.001}, 7) == [1, 1, 2, 2, 2, 2, 2]
    assert tuner.best == 2 and len(tuner.history) == 1
    tuner = ThreadTuner(choices=(1, 2), probe=1, period_s=3600)
    assert _run(tuner, {1: 0.001, 2: 0.03}, 4) == [1, 2, 1, 1]


def test_tuner_probes_again_after_the_period():
    tuner = ThreadTuner(choices=(1, 2), probe=1, period_s=0.0)
    seen = _run(tuner, {1: 0.001, 2: 0.02}, 6)
    assert seen == [1, 2, 1, 2, 1, 2]  # a probing window every step: both counts, every time
    assert len(tuner.history) == 3 and all(best == 1 for _, _, best in tuner.history)


def test_fixed_and_invalid_settings():
    n = torch.get_num_threads()
    try:
        assert make_tuner(1) is None and torch.get_num_threads() == 1
        assert make_tuner(0) is None and torch.get_num_threads() == 1  # 0 leaves it
        assert isinstance(make_tuner("auto"), ThreadTuner)
        with maybe_step(None) as k:
            assert k == 1
        for bad in (-1, "two", 1.5, True):
            with pytest.raises(ValueError, match="threads"):
                make_tuner(bad)
        with pytest.raises(ValueError, match="thread choices"):
            ThreadTuner(choices=(0, 2))
    finally:
        torch.set_num_threads(n)


def _pass_differences() -> list:
    """|1 thread - 2 threads| / max |2 threads| of the demo model's packed forward and backward, per tensor."""
    from compactionrl_fast.envs.memory import MemoryEnv, ScriptedExpert, memory_config, memory_tokenizer
    from compactionrl_fast.packing import pack
    from compactionrl_fast.rollout.loop import run_rollouts
    from compactionrl_fast.train.config import ModelConfig
    from compactionrl_fast.train.model import build_actor, packed_hidden

    tok = memory_tokenizer()
    torch.manual_seed(0)
    actor = build_actor(ModelConfig(), len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    b = pack(run_rollouts(ScriptedExpert(0.6), [MemoryEnv() for _ in range(4)], tok, memory_config(), range(4)),
             prefix_sharing=True)
    out = {}
    n = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            actor.zero_grad()
            h = packed_hidden(actor, b.input_ids, b.position_ids, b.cu_attn)
            (h.square().sum() + actor.lm_head(h).logsumexp(-1).sum()).backward()
            out[threads] = [h.detach()] + [p.grad.clone() for p in actor.parameters()]
    finally:
        torch.set_num_threads(n)
    return [((a - c).abs().max() / c.abs().max()).item() for a, c in zip(out[1], out[2])]


def test_shared_threads_follow_the_value_before_each_step():
    import multiprocessing

    before = torch.get_num_threads()
    value = multiprocessing.get_context("spawn").Value("i", 1)
    shared = SharedThreads(value)
    try:
        with maybe_step(shared) as n:
            assert n == torch.get_num_threads() == 1
        value.value = 2
        with shared.step() as n:
            assert n == torch.get_num_threads() == 2
        value.value = 0  # never below one thread
        with shared.step() as n:
            assert n == 1
    finally:
        torch.set_num_threads(before)


def _short_job(*, progress, position, tuner):
    return ("short", [tuner is None])


def _last_job(*, progress, position, tuner):
    """Steps until the parent hands this job every core (or 60 s pass); -> the thread count of each step."""
    seen, end = [], time.time() + 60
    while time.time() < end:
        with maybe_step(tuner) as n:
            seen.append(n)
        if tuner is None or n == (os.cpu_count() or 1):
            break
        time.sleep(0.02)
    return ("last", seen)


@pytest.mark.parametrize("threads", ["auto", 1])
def test_demo_workers_hand_the_freed_cores_to_the_job_left_running(threads):
    """With threads "auto" the demo's worker pool shares the cores among the jobs still running: once the short
    job ends, the one left takes them all (a 2-core machine: 1 thread, then 2); a fixed count stays fixed."""
    from compactionrl_fast.app import demo
    from compactionrl_fast.train.config import TrainConfig

    cfg = TrainConfig(threads=threads, device="cpu")
    out = dict(demo._run_jobs([(_last_job, ()), (_short_job, ())], 2, cfg, {"progress": False}))
    cores = os.cpu_count() or 1
    if threads == "auto":
        assert out["short"] == [False] and out["last"][-1] == cores
        assert set(out["last"]) <= {max(1, cores // 2), cores}
    else:
        assert out == {"short": [True], "last": [1]}


def test_one_and_two_threads_give_passes_equal_to_float32_rounding():
    """MKL's GEMMs split their sums by the thread count, so by default 1 and 2 threads differ in the last bits:
    measured 2.8e-7 of a tensor's largest element (2-3 float32 ulps); allowed: 1e-5 (~100 ulps)."""
    diffs = _pass_differences()
    assert max(diffs) <= 1e-5, diffs


def test_one_and_two_threads_give_bitwise_equal_passes_in_mkl_strict_cnr_mode():
    """What makes "auto" reproducible: with MKL_CBWR=AVX2,STRICT (set before the process starts) MKL's GEMMs
    sum in an order that does not depend on the thread count, and the demo model's passes are bitwise equal."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "MKL_CBWR": "AVX2,STRICT",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    code = "from tests.train.test_threads import _pass_differences as d; r = d(); assert max(r) == 0, r"
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
