"""The verl plug-in's options: the `algorithm.compaction_gae` keys (segment_gae's arguments and the adapter's
flags) and the trainer mode's `critic_target`, each checked up front with the full key in the error."""
from __future__ import annotations

import torch

from ...ops.gae import _check_numbers
from .._common import CRITIC_TARGETS, cfg_get

ADV_ESTIMATOR = "compaction_gae"
POLICY_LOSS = "compaction"
GAE_DEFAULTS = dict(lam="adaptive", cross_segment="paper", lam_critic=1.0, adaptive_alpha=1.5,
                    adaptive_length="rollout")


def gae_options(config):
    """segment_gae keyword arguments and adapter flags from verl's `algorithm` config.

    Raises ValueError naming the full key (`algorithm.compaction_gae.lam`, ...) for a bad value."""
    sub = cfg_get(config, ADV_ESTIMATOR) or {}
    kw = {k: cfg_get(sub, k, v) for k, v in GAE_DEFAULTS.items()}
    kw["gamma"] = cfg_get(config, "gamma", 1.0)
    if isinstance(kw["lam"], (int, float)) and not isinstance(kw["lam"], bool):
        kw["lam"] = float(kw["lam"])
    try:
        _check_numbers(0, torch.device("cpu"), **kw)
    except (TypeError, ValueError) as e:  # the op's message starts with the argument's name (longest match)
        arg = max((k for k in kw if str(e).startswith(k)), key=len, default="*")
        key = "algorithm.gamma" if arg == "gamma" else f"algorithm.{ADV_ESTIMATOR}.{arg}"
        raise ValueError(f"{key}: {e}") from None
    kw["gamma"] = float(kw["gamma"])
    flags = dict(whiten=bool(cfg_get(sub, "whiten", False)),
                 rollout_id_key=cfg_get(sub, "rollout_id_key", "rollout_id"),
                 group_by_uid=bool(cfg_get(sub, "group_by_uid", True)))
    return kw, flags


def compaction_options(config):
    """segment_gae keyword arguments and flags from verl's `algorithm` config (the `compaction_gae` keys
    of gae_options, plus `critic_target`: "local" (default) or "corrected")."""
    kw, flags = gae_options(config)
    target = cfg_get(cfg_get(config, ADV_ESTIMATOR) or {}, "critic_target", "local")
    if target not in CRITIC_TARGETS:
        raise ValueError(f"algorithm.{ADV_ESTIMATOR}.critic_target must be one of {CRITIC_TARGETS}, got {target!r}")
    flags["critic_target"] = target
    return kw, flags


def rollout_overrides(rcfg, prefix="+compaction.rollout."):
    """Hydra overrides for the `compaction.rollout` fields of `rcfg` (a RolloutConfig) that differ from the
    defaults: what a launch must pass for the agent loop to roll out as `rcfg` does. Text fields are quoted (a
    resume template's braces would read as a Hydra dict)."""
    import dataclasses

    from ...rollout.config import RolloutConfig

    out, default = [], RolloutConfig()
    for f in dataclasses.fields(rcfg):
        v = getattr(rcfg, f.name)
        if v == getattr(default, f.name):
            continue
        if isinstance(v, str):
            if "'" in v:
                raise ValueError(f"compaction.rollout.{f.name}: {v!r} has a quote, which a Hydra override cannot carry")
            v = f"'{v}'"
        elif isinstance(v, (tuple, list)):
            v = "[" + ",".join(map(str, v)) + "]"
        elif v is None:
            v = "null"
        out.append(f"{prefix}{f.name}={v}")
    return out
