"""Count the host reads of device data that a piece of code makes (each one a host sync on CUDA).

A read is: a tensor's value on the host (`.item()`, `float()`, `int()`, `bool()`, `.tolist()`: one per call),
a copy from the device to the host, or an op whose output size depends on the data (`nonzero`, boolean
indexing, `masked_select`, `unique`, `repeat_interleave` without `output_size`).

Under FakeTensorMode every read gets a stand-in value (1, 1.0, False so that no check fires, an all-True
selection), so the code runs to its end and the count is that of the whole run. With device="cuda" the
reads of fake "cuda" tensors count. With device="cpu" (a CPU-only torch refuses fake CUDA tensors at its
Python methods' device guards) the reads of fake tensors marked with `on_device`, and of everything computed
from them, count. Reads under torch.optim (Adam's step counters: host tensors on every device) never count.
Outside FakeTensorMode every read of any tensor counts and gets its true value.
"""
from __future__ import annotations

import collections
import contextlib
import traceback
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_DYNAMIC = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
            aten.unique_dim.default}


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def _all_true(mask):
    """Positions of every element of a 1-d mask: the stand-in for its nonzero() under fake tensors."""
    return torch.arange(mask.numel(), device=mask.device)


class HostReads(TorchDispatchMode):
    """`with HostReads() as r:` ...; `r.count`, and `r.sites` (a Counter of the code lines that read)."""

    def __init__(self, device="cuda"):
        super().__init__()
        self.device, self._derived = device, {}  # id -> weakref (a WeakSet would compare tensors with ==)
        self.count, self.sites, self._quiet = 0, collections.Counter(), 0

    # ------------------------------------------------------------------ what counts
    def on_device(self, tensors) -> None:
        """Mark fake CPU tensors as device data (`device="cpu"`): they, and what is computed from them, count."""
        for t in tensors:
            self._mark(t)

    def _mark(self, t) -> None:
        self._derived[id(t)] = weakref.ref(t)

    def _is_device(self, t) -> bool:
        r = self._derived.get(id(t))
        return r is not None and r() is t

    def _counts(self, t) -> bool:
        if any("torch/optim/" in fr.filename for fr in traceback.extract_stack()[-12:]):
            return False  # Adam's step counters: host tensors on every device
        if not _is_fake(t):
            return True
        return t.device.type == "cuda" or (self.device == "cpu" and self._is_device(t))

    def _propagate(self, args, kwargs, out):
        """Outputs of an op with an input computed from device data are device data."""
        ins = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if any(self._is_device(x) for x in ins):
            for y in torch.utils._pytree.tree_leaves(out):
                if isinstance(y, torch.Tensor):
                    self._mark(y)
        return out

    def _record(self, t, what: str) -> None:
        if self._quiet or not self._counts(t):
            return
        self.count += 1
        for fr in reversed(traceback.extract_stack()[:-2]):
            if "compactionrl_fast" in fr.filename and "_host_reads" not in fr.filename:
                self.sites[f"{fr.filename.split('compactionrl_fast/')[-1]}:{fr.lineno} {what}"] += 1
                break
        else:
            self.sites[f"(outside the package) {what}"] += 1

    # ------------------------------------------------------------------ ops
    def __torch_dispatch__(self, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        return self._propagate(args, kwargs, self._dispatch(func, args, kwargs))

    def _dispatch(self, func, args, kwargs):
        if func is aten._local_scalar_dense.default:
            t = args[0]
            self._record(t, "item")
            if _is_fake(t):
                return False if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
            return func(*args, **kwargs)
        if func in _DYNAMIC:
            self._record(args[0], func.__name__)
            if _is_fake(args[0]):
                if func is aten.nonzero.default:
                    x = args[0]
                    return torch.stack([torch.arange(x.numel(), device=x.device)] * max(x.dim(), 1), 1)
                return args[0].reshape(-1) if func is aten.masked_select.default else func(*args, **kwargs)
            return func(*args, **kwargs)
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and len(args) == 1:
            self._record(args[0], "repeat_interleave")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            idx = args[1]
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in idx):
                self._record(args[0], "boolean index")
                if _is_fake(args[0]):
                    idx = [_all_true(i) if i is not None and i.dtype in (torch.bool, torch.uint8) else i for i in idx]
                    return func(args[0], idx, *args[2:], **kwargs)
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[0] if func is aten._to_copy.default else args[1]
            dst_dev = kwargs.get("device") if func is aten._to_copy.default else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst_dev is not None \
                    and torch.device(dst_dev).type == "cpu":
                self._record(src, "copy to host")
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ Python-level reads
    def __enter__(self):
        self._patches = contextlib.ExitStack()
        names = ("__float__", "__int__", "__index__", "tolist", "nonzero")
        orig = {name: getattr(torch.Tensor, name) for name in names}
        fake_tolist = FakeTensor.__dict__["tolist"]
        mode = self

        def scalar(cast):
            def read(t):
                return cast(t.item())  # one dispatch of _local_scalar_dense (no device guard under fake mode)
            return read

        def tolist(t):
            mode._record(t, "tolist")
            mode._quiet += 1
            try:
                return fake_tolist(t) if _is_fake(t) else orig["tolist"](t)
            finally:
                mode._quiet -= 1

        def nonzero(t, *, as_tuple=False):  # the method's device guard would refuse a fake CUDA tensor
            out = aten.nonzero.default(t)
            return out.unbind(1) if as_tuple else out

        for name, fn in (("__float__", scalar(float)), ("__int__", scalar(int)), ("__index__", scalar(int)),
                         ("tolist", tolist), ("nonzero", nonzero)):
            setattr(torch.Tensor, name, fn)
            self._patches.callback(setattr, torch.Tensor, name, orig[name])
        FakeTensor.tolist = tolist  # FakeTensor defines its own
        self._patches.callback(setattr, FakeTensor, "tolist", fake_tolist)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()
