"""The `verl.plugins` entry point of compactionrl-fast (pyproject.toml): `import verl` imports this module in
every process (driver, TaskRunner, workers), which registers

- the advantage estimator `compaction_gae` and the policy loss `compaction` (adapter.py),
- the agent loop `compaction_agent` (agent_loop.py),
- the V1 trainer mode `compaction_sync` (trainer.py).

verl swallows an exception raised by a plug-in (it logs it at DEBUG), so each part is registered on its
own and what failed is kept in `ERRORS` (part name -> message); `REGISTERED` lists what succeeded.
`VERL_USE_EXTERNAL_PLUGINS=none` (or a list without "compactionrl_fast") turns the plug-in off.
"""
from __future__ import annotations

REGISTERED: list = []
ERRORS: dict = {}


def _ops():
    from . import adapter

    if not adapter.register():
        raise ImportError("verl.trainer.ppo.core_algos is not importable")


def _agent_loop():
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry, register

    from .agent_loop import AGENT_NAME, CompactionAgentLoop

    if _agent_loop_registry.get(AGENT_NAME, {}).get("_target_") is None:
        register(AGENT_NAME)(CompactionAgentLoop)


def _trainer():
    from verl.trainer.ppo.v1 import register_trainer

    from .trainer import TRAINER_MODE, CompactionSyncTrainer

    register_trainer(TRAINER_MODE)(CompactionSyncTrainer)


def register():
    """Register every part that imports; returns REGISTERED. Safe to call again."""
    for name, fn in (("ops", _ops), ("agent_loop", _agent_loop), ("trainer", _trainer)):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- one missing optional part (e.g. TransferQueue) keeps the others
            ERRORS[name] = f"{type(e).__name__}: {e}"
        else:
            ERRORS.pop(name, None)
            if name not in REGISTERED:
                REGISTERED.append(name)
    return REGISTERED


register()
