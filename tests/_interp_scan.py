"""A vectorised `tl.associative_scan` for the Triton interpreter (test helper).

The interpreter (triton 3.9) evaluates a scan with a user combine function one element at a time in
Python (~200 us per element on the CI machine), which makes kernels built on scans untestable beyond a
few thousand tokens. `install()` replaces that loop with a log-step (Hillis-Steele) scan: log2(n) calls
of the same combine function on whole arrays. `tl.associative_scan` requires an associative combine
function and a GPU evaluates it as a tree too, so only the rounding order changes; tests/ops/test_gae.py
checks the result against the interpreter's own loop.

Simple combine functions (arithmetic, `|`, `&`, `tl.where`, `tl.maximum`, `tl.minimum`, `tl.cast`) are
evaluated on the numpy arrays directly; any other function goes through the interpreter's tensor semantics.
"""
from __future__ import annotations

import types

import numpy as np

_original = None


class _Unsupported(Exception):
    pass


class _NumpyLang:
    """The part of `triton.language` that elementwise combine functions use, on numpy arrays."""

    where = staticmethod(np.where)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)

    @staticmethod
    def cast(x, dtype):  # in a numpy combine, `dtype` is an operand's numpy dtype
        return np.asarray(x).astype(dtype)

    def __getattr__(self, name):
        raise _Unsupported(name)


def _numpy_version(fn):
    import triton.language as tl

    g = {k: (_NumpyLang() if v is tl or v is tl.core else v) for k, v in fn.__globals__.items()}
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


def _log_step(combine, data, ax):
    """Inclusive scan of the tuple of arrays `data` along `ax`: log2(n) calls of combine(lhs..., rhs...)."""
    n = data[0].shape[ax]
    keep = [slice(None)] * data[0].ndim
    d = 1
    while d < n:
        # combine(x[i - d], x[i]) for every i >= d; the whole array is combined with a rolled copy
        # (block shapes must stay powers of two) and the first d, wrapped, results are dropped
        with np.errstate(all="ignore"):
            out = combine([np.roll(x, d, axis=ax) for x in data], data)
        keep[ax] = slice(d, n)
        new = [x.copy() for x in data]
        for x, o in zip(new, out):
            x[tuple(keep)] = np.broadcast_to(o, x.shape)[tuple(keep)]
        data, d = new, 2 * d
    return data


def _vectorised_scan(self, input):
    data = [np.array(a.handle.data) for a in input]
    dtypes = [a.dtype for a in input]

    def numpy_combine(lhs, rhs):
        out = _numpy_version(self.combine_fn.fn)(*lhs, *rhs)
        return [np.asarray(o) for o in (out if isinstance(out, tuple) else (out,))]

    def tensor_combine(lhs, rhs):
        out = self.combine_fn.fn(*[self.to_tensor(x, t) for x, t in zip(lhs, dtypes)],
                                 *[self.to_tensor(x, t) for x, t in zip(rhs, dtypes)])
        return [o.handle.data if hasattr(o, "handle") else o for o in (out if isinstance(out, tuple) else (out,))]

    try:
        data = _log_step(numpy_combine, data, self.axis)
    except _Unsupported:
        data = _log_step(tensor_combine, data, self.axis)
    return [self.to_tensor(x, t) for x, t in zip(data, dtypes)]


def install():
    """Use the vectorised scan in the interpreter (idempotent)."""
    global _original
    from triton.runtime import interpreter

    if _original is None:
        _original = interpreter.ScanOps.generic_scan
        interpreter.ScanOps.generic_scan = _vectorised_scan


def original():
    """The interpreter's own element-by-element scan (to check this one against it)."""
    from triton.runtime import interpreter

    return _original or interpreter.ScanOps.generic_scan
