"""Config: the paper's defaults, the demo's overrides, YAML < flags < --set, clear errors."""
import argparse
import re

import pytest

from compactionrl_fast.app.demo import demo_config
from compactionrl_fast.train.checks import ConfigError
from compactionrl_fast.train.config import ModelConfig, SFTConfig, TrainConfig
from compactionrl_fast.train.config_load import add_arguments, from_args, update


def test_paper_defaults():
    c = TrainConfig()
    assert (c.group_size, c.value_pretrain_steps, c.critic_updates_per_step) == (1, 50, 2)
    assert (c.actor_lr, c.critic_lr, c.gamma, c.lam, c.lam_critic) == (2e-6, 3e-6, 1.0, "adaptive", 1.0)
    assert (c.cross_segment, c.loss_reduction, c.clip_low, c.clip_high) == ("paper", "token-mean", 0.2, 0.28)
    assert c.rollouts_per_step == 128 and c.train_summary_tokens


def test_demo_overrides():
    c = demo_config(steps=7)
    assert (c.actor_lr, c.critic_lr, c.value_pretrain_steps, c.rollouts_per_step, c.steps) == (6e-4, 1e-3, 10, 64, 7)
    assert (c.lr_schedule, c.lr_end_ratio) == ("cosine", 0.1)
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
    with pytest.raises(ValueError, match="unknown config key 'sft.nope'"):
        update(TrainConfig(), {"sft.nope": 1})


def _parse(argv, base=None):
    base = base or TrainConfig()
    p = argparse.ArgumentParser()
    add_arguments(p, base)
    return from_args(p.parse_args(argv), base)


BAD = {  # --set value -> a word of the reason
    "steps": ("abc", "integer"), "actor_lr": ("fast", "finite number"), "group_size": ("0", "integer >= 1"),
    "log_every": ("0", "integer >= 1"), "adam_betas": ("0.9", "two numbers"), "model.dtype": ("float16", "NaN"),
    "max_grad_norm": ("-1", r"None or a finite number in \(0"), "ppo_epochs": ("0", "integer >= 1"),
    "device": ("tpu", "one of"), "train_summary_tokens": ("maybe", "true or false"), "sft.lr": ("-0.1", "finite"),
    "clip_low": ("1.5", r"\[0, 1\]"), "dual_clip": ("1", r"\(1,"), "lam": ("1.5", "adaptive"),
    "threads": ("two", "auto"), "model.hidden_size": ("2.5", "integer"), "gamma": ("nan", "finite"),
    "rollout.budget": ("abc", "budget"), "cross_segment": ("both", "one of"), "temperature": ("0", r"\(0"),
}


def test_one_error_lists_every_bad_field():
    argv = [x for k, (v, _) in BAD.items() for x in ("--set", f"{k}={v}")]
    with pytest.raises(ConfigError) as e:
        _parse(argv)
    assert len(e.value.problems) == len(BAD), e.value.problems
    for key, (value, why) in BAD.items():
        head = "rollout=" if key.startswith("rollout.") else key + "="
        lines = [ln for ln in e.value.problems if ln.startswith(head)]
        assert len(lines) == 1 and re.search(why, lines[0]), (key, e.value.problems)


@pytest.mark.parametrize("key,value", [("steps", "-1"), ("steps", "2.5"), ("ppo_minibatches", "0"), ("seed", "-3"),
                                       ("adam_eps", "0"), ("value_clip", "-0.2"), ("sft.expert_drop_p", "2"),
                                       ("group_size", "3"), ("model.num_heads", "3"), ("eval_rollouts", "0"),
                                       ("progress", "1")])
def test_each_bad_value_is_named(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        _parse(["--set", f"{key}={value}"])


def test_flags_and_constructors_are_validated_too():
    with pytest.raises(ConfigError, match="steps='abc'"):
        _parse(["--steps", "abc"])
    with pytest.raises(ConfigError, match="max_grad_norm=-1.0"):
        TrainConfig(max_grad_norm=-1.0)
    with pytest.raises(ConfigError, match="dtype='float16'"):
        ModelConfig(dtype="float16")
    with pytest.raises(ConfigError, match="warmup_steps=-1"):
        SFTConfig(warmup_steps=-1)
    with pytest.raises(ConfigError, match=r"adam_betas=\(0.9, 1.0\)"):
        update(TrainConfig(), {"adam_betas": [0.9, 1.0]})
    with pytest.raises(ConfigError, match="env=.*plain data"):  # YAML reads 2024-01-01 as a date
        _parse(["--set", "env.start=2024-01-01"])


def test_good_values_parse():
    c = _parse(["--actor-lr", "1e-4", "--set", "adam_betas=[0.9, 0.95]", "--set", "max_grad_norm=null",
                "--set", "threads=auto", "--set", "lam=0.95", "--set", "model.dtype=bfloat16", "--steps", "0"])
    assert (c.actor_lr, c.adam_betas, c.max_grad_norm, c.threads, c.lam, c.model.dtype, c.steps) == \
        (1e-4, (0.9, 0.95), None, "auto", 0.95, "bfloat16", 0)
    # checked once at the end: a section valid only after a later flag is fine
    assert _parse(["--set", "model.num_heads=3", "--set", "model.hidden_size=48"]).model.hidden_size == 48


def test_bad_config_fails_before_any_training(tmp_path):
    from compactionrl_fast.app import cli

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="steps='abc'"):
        cli.main(["train", "--run-dir", str(run), "--set", "steps=abc", "--set", "sft.steps=2"])
    assert not run.exists()


def test_a_config_changed_after_it_was_built_is_checked_by_the_trainer():
    from compactionrl_fast.train.trainer import make_state

    from ._tiny import tiny_models

    cfg = TrainConfig()
    cfg.ppo_epochs, cfg.max_grad_norm = 0, -1.0
    with pytest.raises(ConfigError, match=r"(?s)ppo_epochs=0.*max_grad_norm=-1.0"):
        make_state(cfg, *tiny_models())
