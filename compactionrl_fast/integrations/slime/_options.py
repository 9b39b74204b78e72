"""Options of the slime integration, read from slime's `args` namespace.

slime copies every key of the YAML file named by `--custom-config-path` onto `args` (slime/utils/arguments.py),
so the options below are plain YAML keys there; `--gamma` and `--kl-coef` are slime's own flags. An option
that is absent takes the default shown in docs/slime.md.
"""
from __future__ import annotations

import importlib

from .._common import CRITIC_TARGETS, number

GAE_KEYS = dict(compaction_lam="adaptive", compaction_cross_segment="paper", compaction_lam_critic=1.0,
                compaction_adaptive_alpha=1.5, compaction_adaptive_length="rollout")
UNTRAINABLE = ("error", "allow")


def get(args, key, default=None):
    """args.key, or `default` when slime's namespace has no such attribute (or it is None)."""
    v = getattr(args, key, None)
    return default if v is None else v


def _choice(key, v, choices):
    if v not in choices:
        raise ValueError(f"{key} (slime --custom-config-path YAML key) must be one of {choices}, got {v!r}")
    return v


def _number(key, v, unit=False):
    """float(v) (in [0, 1] if unit); ValueError naming the key otherwise."""
    try:
        x = number(key, v)
    except TypeError as e:
        raise ValueError(f"{e} ({key}: slime flag or --custom-config-path YAML key)") from None
    if unit and not 0.0 <= x <= 1.0:
        raise ValueError(f"{key} must be in [0, 1], got {v!r}")
    return x


def advantage_options(args) -> dict:
    """segment_gae keywords plus kl_coef, critic_target, reward_mode and untrainable, validated."""
    if getattr(args, "partial_rollout", False):
        raise ValueError("--partial-rollout is not supported with compactionrl_fast.integrations.slime: a partial "
                         "rollout's segments would be trained in different steps, and the cross-segment factor "
                         "needs every segment of a rollout in one batch; drop --partial-rollout")
    lam = get(args, "compaction_lam", GAE_KEYS["compaction_lam"])
    if lam == "lambd":  # slime's own --lambd
        lam = _number("--lambd", get(args, "lambd", 1.0), unit=True)
    elif lam != "adaptive":
        if isinstance(lam, str):
            raise ValueError(f"compaction_lam (slime --custom-config-path YAML key) must be 'adaptive', 'lambd' or "
                             f"a number in [0, 1], got {lam!r}")
        lam = _number("compaction_lam", lam, unit=True)
    lam_critic = getattr(args, "compaction_lam_critic", GAE_KEYS["compaction_lam_critic"])
    cross = _choice("compaction_cross_segment", get(args, "compaction_cross_segment", "paper"),
                    ("paper", "none", "stitched"))
    kw = dict(gamma=_number("--gamma", get(args, "gamma", 1.0), unit=True), lam=lam, cross_segment=cross,
              lam_critic=None if lam_critic is None else _number("compaction_lam_critic", lam_critic, unit=True),
              adaptive_alpha=_number("compaction_adaptive_alpha", get(args, "compaction_adaptive_alpha", 1.5)),
              adaptive_length=_choice("compaction_adaptive_length", get(args, "compaction_adaptive_length",
                                                                        "rollout"), ("rollout", "segment")))
    if not kw["adaptive_alpha"] > 0:
        raise ValueError(f"compaction_adaptive_alpha must be > 0, got {kw['adaptive_alpha']!r}")
    default_mode = "stitched" if cross == "stitched" else "paper"
    extra = dict(kl_coef=_number("--kl-coef", get(args, "kl_coef", 0.0)),
                 critic_target=_choice("compaction_critic_target", get(args, "compaction_critic_target", "local"),
                                       CRITIC_TARGETS),
                 reward_mode=_choice("compaction_reward_mode", get(args, "compaction_reward_mode", default_mode),
                                     ("paper", "stitched")),
                 untrainable=_choice("compaction_untrainable", get(args, "compaction_untrainable", "error"),
                                     UNTRAINABLE))
    return kw, extra


def load_object(path: str, key: str):
    """The object a dotted path `pkg.module.name` (slime's convention) or `pkg.module:name` names."""
    if not isinstance(path, str) or not path:
        raise TypeError(f"{key} must be a dotted path 'package.module.name', got {path!r}")
    mod, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod or not name:
        raise ValueError(f"{key} must be a dotted path 'package.module.name', got {path!r}")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}={path!r} cannot be loaded: {type(e).__name__}: {e}") from e
