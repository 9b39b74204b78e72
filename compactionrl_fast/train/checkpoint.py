"""Checkpoints: models, optimisers, every RNG stream and the step, written atomically.

Resuming from a checkpoint and taking the next step gives bitwise the same weights on CPU as never
having stopped: the rollout seeds are a function of (seed, step, rank) and the sampling RNG is restored.
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch

NAME = "checkpoint.pt"


def rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: str, *, models: dict, optimizers: dict, step: int, extra: dict | None = None,
         name: str = NAME) -> str:
    """Write run_dir/name (via a temporary file and a rename, so a crash never leaves half a file)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, name)
    payload = {
        "step": step,
        "models": {k: m.state_dict() for k, m in models.items()},
        "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
        "rng": rng_state(),
        "extra": extra or {},
    }
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def exists(run_dir: str, name: str = NAME) -> bool:
    return os.path.isfile(os.path.join(run_dir, name))


def load(run_dir: str, *, models: dict, optimizers: dict, name: str = NAME, restore_rng: bool = True) -> dict:
    """Load into `models`/`optimizers` in place; restore RNGs; return {"step", "extra"}."""
    payload = torch.load(os.path.join(run_dir, name), map_location="cpu", weights_only=False)
    for k, m in models.items():
        m.load_state_dict(payload["models"][k])
    for k, o in optimizers.items():
        o.load_state_dict(payload["optimizers"][k])
    if restore_rng:
        set_rng_state(payload["rng"])
    return {"step": payload["step"], "extra": payload["extra"]}
