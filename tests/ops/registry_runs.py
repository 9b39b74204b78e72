"""Running a registered op (compactionrl_fast/ops/_registry.py) on its spec's cases: what the cross-op tests
(tests/test_cuda_backends.py, test_host_sync.py, test_compile.py, test_registry.py) and the ops snapshot share."""
from __future__ import annotations

import torch

from compactionrl_fast.ops._registry import SPECS, public_specs  # noqa: F401  (re-exported for the tests)


def tensors(x):
    """The tensors of an op's output (tuples, dicts by key, None left out), in a fixed order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in tensors(x[k])]
    if isinstance(x, (tuple, list)):
        return [t for e in x for t in tensors(e)]
    return []


def prepare(spec, kwargs, device=None, dtype=None):
    """A copy of a case's arguments (on `device`; floating tensors in `dtype`), those in `spec.grads` fresh
    leaves that require grad; returns (arguments, leaves)."""
    out, leaves = {}, []
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().to(device or v.device, copy=True)
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            if k in spec.grads:
                v.requires_grad_()
                leaves.append(v)
        out[k] = v
    return out, leaves


def run(spec, kwargs, backend, *, device=None, dtype=None, fn=None):
    """`spec.fn` (or `fn`) on a copy of `kwargs` with `backend`, then a backward of a fixed weighted sum of its
    differentiable outputs: (output tensors, gradients of the `spec.grads` leaves)."""
    args, leaves = prepare(spec, kwargs, device, dtype)
    out = tensors((fn or spec.fn)(**args, backend=backend))
    diff = [t for t in out if t.requires_grad]
    if leaves and diff:
        s = sum((t.float() * torch.linspace(-1, 1, t.numel(), device=t.device).reshape(t.shape)).sum() for t in diff)
        grads = torch.autograd.grad(s, leaves, allow_unused=True)
    else:
        grads = []
    return [t.detach() for t in out], [g for g in grads if g is not None]

