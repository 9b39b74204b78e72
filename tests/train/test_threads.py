"""threads="auto": the tuner probes each thread count, keeps the fastest, and the count does not change results."""
import time

import pytest
import torch

from compactionrl_fast.train.threads import ThreadTuner, make_tuner, maybe_step


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


def test_one_and_two_threads_give_bitwise_equal_passes():
    """What makes "auto" safe for reproducibility: the demo model's forward and backward at 1 and 2 threads."""
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
    for a, c in zip(out[1], out[2]):
        assert torch.equal(a, c)
