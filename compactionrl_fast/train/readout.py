"""A step's metrics stay on the device until its end, then are read on the host at once.

`read(tree)` replaces every tensor in nested dicts, lists and tuples by its value (a float, or a list for
a tensor with dimensions) with one device-to-host read per device; `Means` averages per-micro-batch
metrics after that read, as Python floats, in a fixed order.
"""
from __future__ import annotations

import math

import torch


def read(tree):
    """`tree` with its tensors read on the host: one concatenated copy per device (one sync on CUDA)."""
    leaves = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(tree)
    values = {}
    for dev in dict.fromkeys(t.device for t in leaves):
        ts = [t for t in leaves if t.device == dev]
        flat = torch.cat([t.detach().double().reshape(-1) for t in ts]).tolist()  # the read
        o = 0
        for t in ts:
            values[id(t)] = flat[o] if t.dim() == 0 else flat[o:o + t.numel()]
            o += t.numel()

    def fill(x):
        if isinstance(x, torch.Tensor):
            return values[id(x)]
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x

    return fill(tree)


class Means:
    """Weighted means of per-micro-batch metric dicts ((metrics, weight) rows); a non-finite value is left out
    of its key's mean."""

    def __init__(self, rows=None):
        self.rows = [] if rows is None else rows

    def add(self, metrics: dict, weight: float) -> None:
        self.rows.append((metrics, weight))

    def result(self, prefix: str = "") -> dict:
        """The means; of read rows (`read(rows)`), or of host numbers only."""
        sums, weights = {}, {}
        for metrics, w in self.rows:
            for k, v in metrics.items():
                v = float(v)
                if math.isfinite(v):
                    sums[k] = sums.get(k, 0.0) + v * w
                    weights[k] = weights.get(k, 0.0) + w
        return {prefix + k: sums[k] / weights[k] for k in sums if weights[k] > 0}
