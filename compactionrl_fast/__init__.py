"""compactionrl-fast: fused ops, a compaction rollout runtime and a PPO trainer for CompactionRL.

`import compactionrl_fast` loads the ops only; the rollout runtime, the built-in task, the trainer and the
integrations load on first use of one of their names (so a trainer that only wants the kernels pays no
transformers import). The public API is listed in `__all__`; see docs/ and the README.
"""
import importlib

from . import ops
from .ops import *  # noqa: F401,F403  (the public ops: compactionrl_fast/ops/__init__.py's __all__, one list)
from .ops._dispatch import available as available_backends

__version__ = "0.1.0"

# name -> submodule that defines it, imported on first access
_LAZY = {
    "PackedBatch": "packing", "pack": "packing",
    "Rollout": "rollout", "RolloutConfig": "rollout", "Segment": "rollout", "TransformersEngine": "rollout",
    "VLLMEngine": "rollout", "arun_rollouts": "rollout", "run_rollouts": "rollout",
    "Call": "rollout", "rollout_from_calls": "rollout", "calls_from_rollout": "rollout",
    "ServerEngine": "rollout", "run_episodes": "rollout", "arun_episodes": "rollout",
    "MemoryEnv": "envs", "ScriptedExpert": "envs", "expert_rollouts": "envs", "memory_config": "envs",
    "memory_tokenizer": "envs",
}
_SUBMODULES = ("packing", "rollout", "envs", "train", "integrations", "reference", "app")

__all__ = list(ops.__all__) + ["available_backends", "__version__"] + list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
