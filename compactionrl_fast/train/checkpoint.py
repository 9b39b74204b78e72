"""Checkpoints: models, optimisers, every RNG stream and the step, written atomically and checksummed.

Resuming from a checkpoint and taking the next step gives bitwise the same weights on CPU as never
having stopped, at a fixed thread count on one machine (torch's matmuls round by CPU and threads): the rollout seeds are a function of (seed, step, rank) and the sampling RNG is restored.

A checkpoint holds plain data only (dicts, lists, tuples, str, numbers, None, tensors) and is loaded with
`torch.load(weights_only=True)`, so a crafted file cannot run code. A SHA-256 over every value (tensor
bytes, dtypes, shapes and the plain data) is stored with it; a file whose content does not match, a
truncated file and a file torch cannot read all raise `CorruptCheckpointError` naming the file.
"""
from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import torch

from . import atomic

NAME = "checkpoint.pt"
FORMAT = 2  # 1: pickled (weights_only=False), no checksum
_PLAIN = (str, int, float, bool, type(None))


class CorruptCheckpointError(ValueError):
    """A checkpoint file that is truncated, corrupt, unsafe or fails its checksum."""


def rng_state() -> dict:
    """Every RNG stream as plain data (numpy's key array as an int64 tensor)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x):
    """random.setstate wants tuples all the way down."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _digest(obj, h, where="payload") -> None:
    """Feed `obj` into hash `h`, refusing anything that is not plain data."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)};".encode())
        for k in obj:
            if not isinstance(k, _PLAIN):
                raise TypeError(f"checkpoint {where}: key {k!r} is not plain data (str/int/float/bool/None)")
            h.update(f"K{type(k).__name__}:{k!r};".encode())
            _digest(obj[k], h, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)};".encode())
        for i, v in enumerate(obj):
            _digest(v, h, f"{where}[{i}]")
    elif isinstance(obj, _PLAIN):
        h.update(f"S{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(f"checkpoint {where}: {type(obj).__name__} is not plain data "
                        "(dicts, lists, tuples, str, numbers, None and tensors only)")


def _plain(obj):
    """A copy of user data with numpy/bool-like scalars as Python builtins (torch.load(weights_only=True)
    refuses numpy scalars, which pass isinstance(x, float))."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj) if type(obj) in (list, tuple) else tuple(_plain(v) for v in obj)
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, np.generic) and obj.ndim == 0 and np.issubdtype(obj.dtype, np.number):
        return obj.item()
    for t in (int, float, str):
        if isinstance(obj, t) and type(obj) is not t:
            return t(obj)
    return obj


def checksum(obj) -> str:
    h = hashlib.sha256()
    _digest(obj, h)
    return h.hexdigest()


def write(path: str, data: dict) -> str:
    """Save dict `data` (plain data and tensors) to `path` atomically, with its checksum."""
    return atomic.torch_save({"format": FORMAT, "data": data, "sha256": checksum(data)}, path)


def read(path: str) -> dict:
    """The `data` of a file written by `write`; CorruptCheckpointError (naming the file) if it is damaged."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path}")
    if os.path.getsize(path) == 0:
        raise CorruptCheckpointError(f"checkpoint file {path} is empty (0 bytes): a write was interrupted; "
                                     "delete it to start over")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- truncated zip, flipped bytes, or unsafe pickled objects
        raise CorruptCheckpointError(f"checkpoint file {path} cannot be read safely (truncated, corrupt, or "
                                     f"holding objects other than plain data): {type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''}") from e
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT and "sha256" in payload):
        raise CorruptCheckpointError(f"checkpoint file {path} is not a compactionrl_fast checkpoint of format "
                                     f"{FORMAT} (no checksum)")
    try:
        ok = checksum(payload["data"]) == payload["sha256"]
    except TypeError as e:
        raise CorruptCheckpointError(f"checkpoint file {path}: {e}") from e
    if not ok:
        raise CorruptCheckpointError(f"checkpoint file {path} fails its checksum: its content changed after "
                                     "it was written (disk or copy corruption)")
    return payload["data"]


def save(run_dir: str, *, models: dict, optimizers: dict, step: int, extra: dict | None = None,
         name: str = NAME) -> str:
    """Write run_dir/name atomically (a crash leaves the previous checkpoint, never half a file).

    `extra` must be plain data (dicts, lists, tuples, str, numbers, None, tensors): TypeError otherwise.
    """
    payload = {
        "step": int(step),
        "models": {k: m.state_dict() for k, m in models.items()},
        "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
        "rng": rng_state(),
        "extra": _plain(extra or {}),
    }
    return write(os.path.join(run_dir, name), payload)


def exists(run_dir: str, name: str = NAME) -> bool:
    return os.path.isfile(os.path.join(run_dir, name))


def load(run_dir: str, *, models: dict, optimizers: dict, name: str = NAME, restore_rng: bool = True) -> dict:
    """Load into `models`/`optimizers` in place; restore RNGs; return {"step", "extra"}."""
    path = os.path.join(run_dir, name)
    payload = read(path)
    missing = [f"models.{k}" for k in models if k not in payload["models"]]
    missing += [f"optimizers.{k}" for k in optimizers if k not in payload["optimizers"]]
    if missing:
        raise ValueError(f"checkpoint file {path} lacks {missing}")
    for k, m in models.items():
        m.load_state_dict(payload["models"][k])
    for k, o in optimizers.items():
        o.load_state_dict(payload["optimizers"][k])
    if restore_rng:
        set_rng_state(payload["rng"])
    return {"step": payload["step"], "extra": payload["extra"]}


def save_state_dict(state_dict: dict, path: str) -> str:
    """A model's state dict alone (the demo's SFT weights), atomically and checksummed."""
    return write(path, {"state_dict": dict(state_dict)})


def load_state_dict(path: str) -> dict:
    return read(path)["state_dict"]
