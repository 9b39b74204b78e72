"""Where a config's values come from (train/config_load.py): mappings, YAML, CLI flags; every problem named."""
import argparse

import pytest

from compactionrl_fast.train.checks import ConfigError
from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.config_load import _coerce, add_arguments, from_args, load_yaml, update


def _problems(values, base=None):
    with pytest.raises(ConfigError) as info:
        update(base or TrainConfig(), values)
    return info.value.problems


def test_update_names_every_bad_key_exactly():
    known = sorted(f for f in vars(TrainConfig()))
    assert _problems([1]) == ["config: expected a mapping of field names, got list"]
    assert _problems({"sft": 3, "env": 4, "nope": 1, "ppo_epochs.x": 2}) == [
        "config key 'sft' is a section; give a mapping or a dotted key",
        "config key 'env' is a mapping; give a mapping or a dotted key",
        f"unknown config key 'nope'; known: {known}",
        "config key 'ppo_epochs.x': ppo_epochs is not a section",
    ]
    assert _problems({"sft": [1]}) == ["config key 'sft' is a section; give a mapping or a dotted key"]
    assert _problems({"sft.lr.x": 1})[0] == "config key 'sft.lr.x': lr is not a section"
    assert _problems({"sft": {"model": {"a": 1}}})[0].startswith("unknown config key 'sft.model'; known: [")


def test_update_dashes_sections_and_mappings():
    cfg = update(TrainConfig(env={"x": 1.0, "keep": "k"}), {"ppo-epochs": 2, "sft.lr": "1e-4", "env.x": "2",
                                                            "env.n": "[1, 2]", "model": {"hidden_size": 32}})
    assert cfg.ppo_epochs == 2 and cfg.sft.lr == 1e-4 and cfg.model.hidden_size == 32
    assert cfg.env == {"x": 2.0, "keep": "k", "n": [1, 2]} and type(cfg.env["x"]) is float  # the default's type
    assert update(TrainConfig(), {"env": {"a": 1}}).env == {"a": 1}


def test_coerce():
    assert _coerce("1e-4", 0.1) == 1e-4 and _coerce("3", 0.5) == 3.0 and type(_coerce("3", 0.5)) is float
    assert _coerce("true", 0.5) is True  # a bool stays a bool (validation names the field)
    assert _coerce("", "x") == "" and _coerce("[0.9, 0.99]", (0.9, 0.999)) == (0.9, 0.99)
    assert _coerce("{a: [", None) == "{a: ["  # not YAML: kept as the string
    assert _coerce("null", 1) is None and _coerce(3, 0.5) == 3.0


def test_load_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("")
    assert load_yaml(str(p)) == {}
    p.write_text("- 1\n")
    with pytest.raises(ValueError, match=r"c\.yaml: a config file must hold a mapping"):
        load_yaml(str(p))


def _parser():
    p = argparse.ArgumentParser()
    add_arguments(p, TrainConfig())
    return p, {a.dest: a for a in p._actions}


def test_add_arguments_flags_help_and_placeholders():
    p, acts = _parser()
    assert acts["config"].help == "YAML file with config fields (applied before the flags)"
    s = acts["set"]
    assert s.default == [] and s.metavar == "KEY=VALUE" and s.help.startswith("any field, dotted for sections")
    assert s.help.endswith("(all keys: --help-config or docs/config.md); VALUE is read as YAML")
    e = acts["cfg_ppo_epochs"]
    assert e.option_strings == ["--ppo-epochs"] and e.default is None and e.metavar == "INT"
    assert e.help == "passes of actor updates over each batch (default: 1)"
    assert acts["cfg_lr_schedule"].metavar == "{constant,linear,cosine}"  # the check's choices
    assert acts["cfg_max_grad_norm"].metavar == "{FLOAT,null}"  # its own placeholder
    assert acts["cfg_actor_lr"].metavar == "FLOAT" and acts["cfg_run_dir"].metavar == "STR"
    assert "cfg_sft" not in acts and "cfg_env" not in acts  # sections and mappings: --set only
    args = p.parse_args([])
    assert args.set == [] and args.cfg_ppo_epochs is None and args.config is None


def test_metavar_of_a_field_without_a_default():
    from dataclasses import fields

    from compactionrl_fast.train.config import ModelConfig
    from compactionrl_fast.train.config_load import _metavar

    f = next(f for f in fields(ModelConfig) if f.name == "pretrained")
    assert _metavar(f, None) == "VALUE"


def test_from_args_layers_and_collects_every_problem(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("ppo_epochs: 2\nsteps: 5\nsft: {lr: 0.5}\n")
    p, _ = _parser()
    args = p.parse_args(["--config", str(cfg_file), "--steps", "7", "--set", "steps=9", "--set", "sft.steps=3",
                         "--set", "gamma=a=b"])
    with pytest.raises(ConfigError) as info:
        from_args(args, TrainConfig())
    assert info.value.problems == ["gamma='a=b': must be a finite number in [0, 1]"]  # split at the first '='
    args = p.parse_args(["--config", str(cfg_file), "--steps", "7", "--set", "steps=9", "--set", "sft.steps=3"])
    cfg = from_args(args, TrainConfig())
    assert (cfg.ppo_epochs, cfg.steps, cfg.sft.lr, cfg.sft.steps) == (2, 9, 0.5, 3)
    cfg_file.write_text("nope: 1\n")
    args = p.parse_args(["--config", str(cfg_file), "--set", "noeq", "--set", "also", "--set", "zz=1"])
    with pytest.raises(ConfigError) as info:
        from_args(args, TrainConfig())
    probs = info.value.problems
    assert probs[0].startswith("unknown config key 'nope'")
    assert probs[1:3] == ["--set expects KEY=VALUE, got 'noeq'", "--set expects KEY=VALUE, got 'also'"]
    assert probs[3].startswith("unknown config key 'zz'") and len(probs) == 4
    assert from_args(argparse.Namespace(), TrainConfig()) == TrainConfig()  # no config, flags or --set
