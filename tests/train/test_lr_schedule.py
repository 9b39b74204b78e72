"""The actor's learning-rate schedule (`lr_schedule`, `lr_end_ratio`): the formula, the lr that each actor
optimiser step of `fit` uses (resume included), the critic's staying constant, and config validation."""
import math

import pytest
import torch

from compactionrl_fast.app import runner
from compactionrl_fast.train import log
from compactionrl_fast.train.checks import ConfigError
from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.model import critic_from_actor
from compactionrl_fast.train.loop import fit
from compactionrl_fast.train.trainer import actor_lr_at, make_state

from ._tiny import tiny_train_config


def test_actor_lr_at_formula():
    # steps=4: x = 0, 1/4, 2/4, 3/4 at updates 0..3
    c = TrainConfig(steps=4, actor_lr=0.5, lr_schedule="linear")
    assert [actor_lr_at(c, k) for k in range(4)] == [0.5, 0.375, 0.25, 0.125]
    c = TrainConfig(steps=4, actor_lr=2.0, lr_schedule="linear", lr_end_ratio=0.5)
    assert [actor_lr_at(c, k) for k in range(4)] == [2.0, 1.75, 1.5, 1.25]
    c = TrainConfig(steps=4, actor_lr=1.0, lr_schedule="cosine", lr_end_ratio=0.2)
    want = [0.2 + 0.8 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]
    assert [actor_lr_at(c, k) for k in range(4)] == pytest.approx(want, rel=1e-12, abs=0)
    assert actor_lr_at(c, 2) == pytest.approx(0.6, rel=1e-12)  # halfway: the mean of start and end
    # past the end (a run extended after its schedule ended) it stays at the end value
    assert actor_lr_at(c, 9) == pytest.approx(0.2, rel=1e-12)
    c = TrainConfig(steps=1, actor_lr=1.0, lr_schedule="linear", lr_end_ratio=0.25)  # one update: x = 0, then 1
    assert [actor_lr_at(c, k) for k in range(2)] == [1.0, 0.25]
    c = TrainConfig(steps=4, actor_lr=0.3, lr_end_ratio=0.1)  # constant ignores the end ratio
    assert [actor_lr_at(c, k) for k in range(6)] == [0.3] * 6


@pytest.mark.parametrize("bad", [dict(lr_schedule="exp"), dict(lr_schedule=None), dict(lr_end_ratio=1.5),
                                 dict(lr_end_ratio=-0.1), dict(lr_end_ratio=float("nan"))])
def test_bad_schedule_names_the_field(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        TrainConfig(**bad)


def _fit_lrs(tmp, steps, state=None, **kw):
    """Run fit (1 value pre-training step, 2 actor mini-batches); return (state, [(actor lr, critic lr) at every
    actor optimiser step], [critic lr at every critic optimiser step])."""
    cfg = tiny_train_config(tmp / "run", steps=steps, rollouts_per_step=4, ppo_minibatches=2, **kw)
    tok, make_envs, rcfg = runner.task(cfg)
    if state is None:
        actor = runner.build(cfg, tok)
        state = make_state(cfg, actor, critic_from_actor(actor))
    else:
        state.cfg = cfg
    from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine

    seen_actor, seen_critic = [], []
    real_a, real_c = state.opt_actor.step, state.opt_critic.step
    state.opt_actor.step = lambda *a, **k: (seen_actor.append(state.opt_actor.param_groups[0]["lr"]),
                                            real_a(*a, **k))[1]
    state.opt_critic.step = lambda *a, **k: (seen_critic.append(state.opt_critic.param_groups[0]["lr"]),
                                             real_c(*a, **k))[1]
    try:
        fit(state, engine=TransformersEngine(state.actor, pad_token_id=tok.pad_token_id), make_envs=make_envs,
            tokenizer=tok, rollout_cfg=rcfg, pack=runner.packer(cfg), run_dir=cfg.run_dir)
    finally:
        state.opt_actor.step, state.opt_critic.step = real_a, real_c
    return state, seen_actor, seen_critic


@pytest.mark.parametrize("schedule,end", [("linear", 0.0), ("cosine", 0.1)])
def test_fit_uses_the_scheduled_lr_each_actor_update(tmp_path, schedule, end):
    state, lrs, critic_lrs = _fit_lrs(tmp_path, 3, lr_schedule=schedule, lr_end_ratio=end, actor_lr=1e-3)
    cfg = state.cfg
    want = [actor_lr_at(cfg, k) for k in range(3) for _ in range(2)]  # 2 mini-batches: 2 optimiser steps each
    assert lrs == want
    assert len(set(lrs)) == 3 and lrs[0] == 1e-3 and lrs[-1] < 1e-3 * (end + 0.8)
    assert critic_lrs == [cfg.critic_lr] * len(critic_lrs) and len(critic_lrs) == 2 * 4  # 2 updates, 4 iterations
    rows = log.read_rows(f"{cfg.run_dir}/metrics.jsonl")
    assert [r.get("actor/lr") for r in rows] == [None] + want[::2]  # value pre-training logs no actor lr


def test_resumed_run_continues_the_schedule(tmp_path):
    # 2 of 4 updates, then the same state continued to 4: the lrs of updates 2 and 3 of the 4-step schedule
    state, first, _ = _fit_lrs(tmp_path, 4, lr_schedule="linear", actor_lr=1e-3)
    assert first == [actor_lr_at(state.cfg, k) for k in range(4) for _ in range(2)]
    state.step = 3  # 1 pre-training step + 2 actor updates done
    _, rest, _ = _fit_lrs(tmp_path, 4, state=state, lr_schedule="linear", actor_lr=1e-3)
    assert rest == first[4:]


def test_constant_keeps_the_optimiser_lr_bitwise(tmp_path):
    # "constant" (the default) sets exactly the lr Adam was built with: the same arithmetic as before the
    # schedule existed; a decaying schedule trains different weights from the same start
    state, lrs, _ = _fit_lrs(tmp_path / "c", 2, actor_lr=3e-4)
    assert state.cfg.lr_schedule == "constant" and lrs == [3e-4] * 4
    lin, _, _ = _fit_lrs(tmp_path / "l", 2, actor_lr=3e-4, lr_schedule="linear")
    diff = [not torch.equal(a, b) for a, b in zip(state.actor.state_dict().values(), lin.actor.state_dict().values())]
    assert any(diff)
