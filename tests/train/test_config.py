"""Config: the paper's defaults, the demo's overrides, YAML < flags < --set, clear errors."""
import argparse

import pytest

from compactionrl_fast.train.config import TrainConfig, add_arguments, demo_config, from_args, update


def test_paper_defaults():
    c = TrainConfig()
    assert (c.group_size, c.value_pretrain_steps, c.critic_updates_per_step) == (1, 50, 2)
    assert (c.actor_lr, c.critic_lr, c.gamma, c.lam, c.lam_critic) == (2e-6, 3e-6, 1.0, "adaptive", 1.0)
    assert (c.cross_segment, c.loss_reduction, c.clip_low, c.clip_high) == ("paper", "token-mean", 0.2, 0.28)
    assert c.rollouts_per_step == 128 and c.train_summary_tokens


def test_demo_overrides():
    c = demo_config(steps=7)
    assert (c.actor_lr, c.critic_lr, c.value_pretrain_steps, c.rollouts_per_step, c.steps) == (3e-4, 1e-3, 10, 64, 7)
    assert c.sft.steps > 0 and c.train_summary_tokens


def test_yaml_then_flags_then_set(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("actor_lr: 1.0e-5\nsteps: 3\nsft:\n  steps: 9\nenv:\n  n_digits: 4\n")
    p = argparse.ArgumentParser()
    add_arguments(p, TrainConfig())
    args = p.parse_args(["--config", str(y), "--steps", "5", "--set", "sft.lr=0.01", "--set", "env.n_fillers=3",
                         "--set", "lam=0.95", "--cross-segment", "stitched"])
    c = from_args(args, TrainConfig())
    assert (c.actor_lr, c.steps, c.sft.steps, c.sft.lr, c.lam, c.cross_segment) == (1e-5, 5, 9, 0.01, 0.95, "stitched")
    assert c.env == {"n_digits": 4, "n_fillers": 3}


def test_unknown_key_is_an_error():
    with pytest.raises(ValueError, match="unknown config key 'actor_lrr'"):
        update(TrainConfig(), {"actor_lrr": 1.0})
    with pytest.raises(ValueError, match="unknown config key 'nope'"):
        update(TrainConfig(), {"sft.nope": 1})
