"""The outer loop (train/loop.py) on a stand-in step: what it passes on, accumulates, logs and checks.

The real steps run in test_fit.py, test_sync.py and test_trainer.py; here rollouts, packing and the step are
replaced by recorders, so the loop's own bookkeeping is checked number by number.
"""
from types import SimpleNamespace

import pytest
import torch

from compactionrl_fast.train import loop, trainer
from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.sync import SamplerMismatchError

from .test_trainer import _FakeWorld


class _Harness:
    """fit() with recorders for the rollouts, the micro-batches, the step, the weight pushes and the log."""

    def __init__(self, monkeypatch, gaps=None, **cfg):
        self.cfg = TrainConfig(**{"steps": 3, "value_pretrain_steps": 1, "rollouts_per_step": 4, "log_every": 1,
                                  "checkpoint_every": 0, "gap_every": 0, **cfg})
        self.gaps = gaps or {}  # step -> the step's sampler gap metric
        self.calls, self.logged, self.pushes, self.checks = [], [], [], []
        self.engine = SimpleNamespace(name="engine")
        self.state = SimpleNamespace(cfg=self.cfg, actor=torch.nn.Linear(1, 1), step=0, group="g")
        monkeypatch.setattr(loop, "_rollouts_fn", lambda engine: self.rollouts)
        monkeypatch.setattr(loop, "micro_batches", self.micro_batches)
        monkeypatch.setattr(trainer, "train_step", self.train_step)
        monkeypatch.setattr(loop, "push_weights", lambda engine, actor: self.pushes.append(engine) or 1.5)
        real = loop.check_sampler
        monkeypatch.setattr(loop, "check_sampler",
                            lambda *a, **k: self.checks.append((a, k)) or real(*a, **k))

    def rollouts(self, engine, envs, tokenizer, rcfg, seeds, chat=None):
        return [_rollout(1.0) for _ in seeds]

    def micro_batches(self, rollouts, cfg, pack, device):
        self.device = device
        return ["mb"], [[0]]

    def train_step(self, state, batches, *, update_actor, advantage_gap, minibatches, measure_sampler_gap):
        it = state.step
        assert it == len(self.calls) < self.cfg.value_pretrain_steps + self.cfg.steps, "steps out of order"
        self.calls.append({"update_actor": update_actor, "measure_sampler_gap": measure_sampler_gap,
                           "advantage_gap": advantage_gap})
        out = {}
        if it in self.gaps:
            out["sampler/logp_absdiff_max"] = self.gaps[it]
        return out

    def fit(self, **kw):
        log = SimpleNamespace(log=lambda it, m: self.logged.append((it, dict(m))))
        return loop.fit(self.state, engine=self.engine, make_envs=lambda n: [None] * n, tokenizer=None,
                        rollout_cfg=_RolloutCfg(), pack=None, run_dir="unused", log=log, **kw)


def _rollout(reward, compactions=1):
    return SimpleNamespace(reward=reward, success=reward > 0, compactions=compactions, truncated=False,
                           finish_reason="answer", turns=[0, 1], summary_lengths=[3] * compactions, info={},
                           segments=[])


class _RolloutCfg:
    def replace(self, **kw):
        return self


def test_fit_passes_the_actor_device_and_steps_once_per_iteration(monkeypatch):
    h = _Harness(monkeypatch)
    state = h.fit()
    assert state.step == 4 and h.device == torch.device("cpu")
    assert [c["update_actor"] for c in h.calls] == [False, True, True, True]
    assert [c["measure_sampler_gap"] for c in h.calls] == [True, False, False, False]  # the first step only
    assert [it for it, _ in h.logged] == [0, 1, 2, 3]
    assert [m["actor_step"] for _, m in h.logged] == [0, 1, 2, 3]
    assert [m["phase"] for _, m in h.logged] == ["value_pretrain", "ppo", "ppo", "ppo"]


def test_fit_adds_the_first_push_to_the_first_step(monkeypatch):
    """The push at the start of RL is counted in the first step's sync time, with that step's own push."""
    h = _Harness(monkeypatch, value_pretrain_steps=0, steps=2)
    h.fit()
    assert len(h.pushes) == 3  # the start, then after each actor update
    assert [m["time/weight_sync_s"] for _, m in h.logged] == [3.0, 1.5]


def test_fit_logs_a_bad_gap_between_log_steps_then_raises(monkeypatch):
    h = _Harness(monkeypatch, log_every=100, sampler_logp_tol=0.25, gaps={1: 0.25, 2: 0.5})
    with pytest.raises(SamplerMismatchError, match="step 2"):
        h.fit()
    assert [it for it, _ in h.logged] == [0, 2]  # step 1's gap equals the tolerance: within it, not logged
    assert h.logged[1][1]["sampler/logp_absdiff_max"] == 0.5
    (gap, tol, step, engine), kw = h.checks[-1]
    assert (gap, tol, step, engine, kw) == (0.5, 0.25, 2, h.engine, {"actor": h.state.actor})
    assert [c[0][0] for c in h.checks] == [None, 0.25, 0.5]


def test_fit_takes_the_largest_gap_over_ranks(monkeypatch):
    """With 2 ranks the gap is all-reduced (the fake world: the other rank's is this one's + 1) and averaged
    rollout metrics are logged."""
    w = _FakeWorld(monkeypatch)
    h = _Harness(monkeypatch, gaps={0: 0.5}, steps=1, value_pretrain_steps=0, sampler_logp_tol=None)
    h.fit()
    (it, m), = h.logged
    assert m["sampler/logp_absdiff_max"] == 1.5 and ("g" in [c[3] for c in w.calls])
    assert m["success"] == (1.0 + 2.0) / 2  # this rank's 1.0 plus the fake other rank's
    # the compaction/... vocabulary of the facts gathered over the ranks (the fake: this rank's twice)
    assert ("object", "cpu", 2, "g") in w.calls and m["compaction/finish_reason/answer"] == 1.0


def test_rollouts_fn_picks_episodes_for_an_async_engine():
    from compactionrl_fast.rollout.episodes import run_episodes
    from compactionrl_fast.rollout.loop import run_rollouts

    assert loop._rollouts_fn(SimpleNamespace(async_episodes=True)) is run_episodes
    assert loop._rollouts_fn(SimpleNamespace(async_episodes=False)) is run_rollouts
    assert loop._rollouts_fn(SimpleNamespace()) is run_rollouts


def test_evaluate_in_one_process_returns_its_own_metrics(monkeypatch):
    """One process: the metrics of all n held-out rollouts, run in chunks."""
    from compactionrl_fast.rollout import loop as rloop
    from compactionrl_fast.train.log import rollout_metrics

    def fake(engine, envs, tokenizer, cfg, seeds, chat=None):
        return [_rollout(0.1 * (s % 3), compactions=s % 2) for s in seeds]
    monkeypatch.setattr(rloop, "run_rollouts", fake)
    m, out = loop.evaluate(None, lambda n: [None] * n, None, _RolloutCfg(), 7, temperature=1.0, chunk=3)
    assert len(out) == 7 and m == rollout_metrics(out)
    assert sorted(r.reward for r in out) == sorted(0.1 * (s % 3) for s in range(loop.EVAL_SEED_BASE,
                                                                               loop.EVAL_SEED_BASE + 7))
