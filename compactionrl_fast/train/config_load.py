"""Where a config's values come from: a mapping (`update`, dotted keys for sections), a YAML file, CLI flags
(`add_arguments` / `from_args`), and back to plain data (`to_dict`, `dumps`). Every result is validated
once, all bad fields in one ConfigError (train/config.py holds the fields, their checks and help)."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
from typing import Any

from . import checks as c
from .config import TrainConfig, problems


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


_EXP_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")  # "1e-4": YAML 1.1 reads it as a string


def _coerce(value, default):
    """Parse a CLI/YAML value to the type of the field's default where it is clear."""
    if isinstance(value, str):
        import yaml

        if _EXP_FLOAT.match(value.strip()):
            value = float(value)
        else:
            try:
                value = yaml.safe_load(value) if value != "" else value
            except yaml.YAMLError:
                pass  # kept as the string; validation names the field
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _apply(cfg, values: dict, found: list, prefix: str = ""):
    """A copy of dataclass `cfg` with `values` applied, without validation; unknown keys go to `found`."""
    out = copy.copy(cfg)
    if not isinstance(values, dict):
        found.append(f"{prefix or 'config'}: expected a mapping of field names, got {type(values).__name__}")
        return out
    for key, value in values.items():
        head, _, rest = str(key).replace("-", "_").partition(".")
        names = {f.name for f in dataclasses.fields(out)}
        if head not in names:
            found.append(f"unknown config key {prefix + str(key)!r}; known: {sorted(names)}")
            continue
        cur = getattr(out, head)
        if dataclasses.is_dataclass(cur):
            sub = value if not rest else {rest: value}
            if not isinstance(sub, dict):
                found.append(f"config key {prefix + str(key)!r} is a section; give a mapping or a dotted key")
                continue
            setattr(out, head, _apply(cur, sub, found, prefix + head + "."))
        elif isinstance(cur, dict):
            new = dict(cur)
            if rest:
                new[rest] = _coerce(value, new.get(rest))
            elif isinstance(value, dict):
                new.update(value)
            else:
                found.append(f"config key {prefix + str(key)!r} is a mapping; give a mapping or a dotted key")
                continue
            setattr(out, head, new)
        else:
            if rest:
                found.append(f"config key {prefix + str(key)!r}: {head} is not a section")
                continue
            setattr(out, head, _coerce(value, cur))
    return out


def update(cfg, values: dict):
    """Return a copy of dataclass `cfg` with `values` applied; keys may be dotted ("sft.lr").

    Raises ConfigError (a ValueError) listing every unknown key and every bad field at once."""
    found = []
    out = _apply(cfg, values, found)
    c.raise_problems(found + problems(out))
    return out


def load_yaml(path: str) -> dict:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must hold a mapping")
    return data


def add_arguments(parser: argparse.ArgumentParser, base) -> None:
    """`--config FILE`, `--set KEY=VALUE` (repeatable) and a flag per top-level scalar field."""
    parser.add_argument("--config", help="YAML file with config fields (applied before the flags)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any field, dotted for sections: --set sft.steps=500 --set env.n_digits=8 "
                             "(all keys: --help-config or docs/config.md); VALUE is read as YAML")
    for f in dataclasses.fields(base):
        default = getattr(base, f.name)
        if dataclasses.is_dataclass(default) or isinstance(default, (dict, tuple)):
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), dest="cfg_" + f.name, default=None,
                            metavar=_metavar(f, default), help=f"{f.metadata['help']} (default: {default})")


def from_args(args: argparse.Namespace, base):
    """Defaults < YAML file < flags < --set, validated once at the end (ConfigError lists every bad field)."""
    found = []
    cfg = base
    if getattr(args, "config", None):
        cfg = _apply(cfg, load_yaml(args.config), found)
    flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    cfg = _apply(cfg, flags, found)
    sets = {}
    for item in getattr(args, "set", None) or []:
        key, eq, value = item.partition("=")
        if not eq:
            found.append(f"--set expects KEY=VALUE, got {item!r}")
            continue
        sets[key.strip()] = value
    cfg = _apply(cfg, sets, found)
    c.raise_problems(found + problems(cfg))
    return cfg


def dumps(cfg) -> str:
    return json.dumps(to_dict(cfg), indent=1, default=str)


def from_dict(data: dict, base: Any = None):
    return update(base if base is not None else TrainConfig(), data)

def _metavar(f, default) -> str:
    """The CLI placeholder of field `f`: its own, its check's choices, or its default's type."""
    choices = getattr(f.metadata["check"], "choices", None)
    if f.metadata["metavar"] or choices:
        return f.metadata["metavar"] or "{" + ",".join(choices) + "}"
    return type(default).__name__.upper() if default is not None else "VALUE"
