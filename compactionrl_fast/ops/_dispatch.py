"""Backend discovery and choice: the one place where an op's backend is picked.

`TABLE` (filled from the ops' specs: ops/_registry.py) lists each op's backends, fastest first per device
type, and the custom op that runs each; `available` filters them by what is built and importable;
`resolve_backend` (what every op calls) applies the table, the COMPACTIONRL_FAST_BACKEND override and the
few per-op rules (`_op_rule`), and `custom_op` gives the chosen backend's custom op. CUDA tensors: triton >
cuda > torch. CPU tensors: cpp > torch. "torch" is the naive reference (compactionrl_fast.reference,
float64) for every public op; a tuned PyTorch path has its own name, "torch-tuned" (value_head,
linear_logprobs, place_final_rewards). The Triton kernels run on CPU tensors only under the Triton
interpreter (TRITON_INTERPRET=1, set before triton is imported); that is how they are tested without a GPU.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "cuda", "cpp", "torch-tuned", "torch")


@functools.lru_cache(None)
def cpp_ext():
    """The compiled extension `compactionrl_fast._C`, or None if it was not built."""
    try:
        return importlib.import_module("compactionrl_fast._C")
    except ImportError:
        return None


def has_cuda_ext() -> bool:
    ext = cpp_ext()
    return bool(ext is not None and getattr(ext, "WITH_CUDA", 0))


# found without importing triton (imports stay lazy); a plain constant, so torch.compile reads it without tracing
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def has_triton() -> bool:
    return _HAS_TRITON


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> list[str]:
    """Backends usable for tensors on `device`, fastest first."""
    out = []
    if device.type == "cuda":
        if has_triton():
            out.append("triton")
        if has_cuda_ext():
            out.append("cuda")
    else:
        if cpp_ext() is not None:
            out.append("cpp")
        if has_triton() and triton_interpret():
            out.append("triton")
    out += ["torch-tuned", "torch"]  # plain PyTorch: always there
    return out


# One table: each op's backends, fastest first per device type ("cuda", "cpu"), and the custom op
# (torch.ops.compactionrl_fast.<name>) that runs each backend ("ops"). A backend missing from "ops" is run in
# Python by the op itself: "torch", the reference, everywhere. `available` filters the orders by what is built
# and importable; `resolve` is the one place that picks. The rows come from the ops' specs (`OpSpec`, declared
# next to each op and added here by `ops/_registry.declare`): {op: {"cuda": (...), "cpu": (...), "ops": {...}}}.
TABLE: dict = {}


def has_backend(op: str, backend) -> bool:
    """Whether TABLE lists `backend` for `op` on some device type ("auto": always)."""
    return backend == "auto" or backend in TABLE[op]["cuda"] + TABLE[op]["cpu"]


def custom_op(op: str, backend: str):
    """The custom op that runs `op` on `backend` (a TABLE row's "ops" entry), or None: the op runs that
    backend in Python (the reference)."""
    name = TABLE[op]["ops"].get(backend)
    return None if name is None else getattr(torch.ops.compactionrl_fast, name)


def default_backend() -> str:
    """COMPACTIONRL_FAST_BACKEND: the backend "auto" means, where the op has it for the device ("auto")."""
    b = os.environ.get("COMPACTIONRL_FAST_BACKEND", "auto").strip().lower() or "auto"
    if b not in BACKENDS:
        raise ValueError(f"COMPACTIONRL_FAST_BACKEND must be one of {BACKENDS}, got {b!r}")
    return b


def resolve(backend: str, device: torch.device, op: str | None = None) -> str:
    """Map `backend` to a concrete backend for `device`, or raise a ValueError that says why not.

    `op` (a TABLE key) gives the op's own order (without it, every available backend). "auto" takes the
    COMPACTIONRL_FAST_BACKEND override when the op has that backend for the device, else the first
    available backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    built = available(device)
    order = TABLE[op]["cuda" if device.type == "cuda" else "cpu"] if op is not None else built
    avail = [b for b in order if b in built]
    if backend == "auto":
        override = default_backend()
        return override if override in avail else avail[0]
    if backend in avail:
        return backend
    why = {
        "triton": "the triton backend needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
        "triton is imported" if has_triton() else "triton is not installed",
        "cuda": "the cuda backend needs CUDA tensors and an extension built with CUDA "
        "(see COMPACTIONRL_FAST_BUILD_CUDA in the README)",
        "cpp": "the cpp backend needs CPU tensors and the compiled extension compactionrl_fast._C "
        "(pip install --no-build-isolation -e .)",
        "torch-tuned": "",
        "torch": "",
    }[backend]
    if backend not in order:
        why = f"this op has no {backend} backend"
    raise ValueError(f"backend={backend!r} is not available for {device.type} tensors: {why}")


def _op_rule(op, asked, b, device_type, dtype, placed):
    """The per-op exceptions to the table, given the backend `b` that `resolve` picked for `asked`."""
    if op == "value_head" and asked == "auto" and device_type == "cpu":
        # float32: BLAS gemv beats the C++ loop; half precision: the C++ loop (no float32 copy). The Triton
        # interpreter is for tests only.
        return "cpp" if b == "cpp" and dtype != torch.float32 else "torch-tuned"
    if op == "linear_logprobs" and b == "triton" and device_type != "cuda" and dtype != torch.float32:
        raise ValueError("backend='triton' on CPU tensors (the Triton interpreter) supports float32 only: the "
                         "interpreter's bf16/fp16 arithmetic is unreliable; use backend='torch-tuned'")
    if op in ("ppo_policy_loss", "value_loss") and dtype == torch.float64 and b in ("triton", "cuda"):
        # rounding float64 inputs to float32 would change the answer (1e300 becomes inf): an error, not a number
        raise ValueError(f"{op}: float64 inputs are computed in float64 only by backend='cpp' (CPU tensors) and "
                         f"backend='torch' (the reference); the {b} kernels read float32: pass float32 tensors "
                         "(.float(); values past float32's range become inf) or backend='torch'")
    if op == "segment_gae" and b == "cuda" and placed:
        if asked == "cuda":
            raise ValueError("seg_start (placed segments) is not supported by the cuda backend: use backend='triton'")
        return "triton"
    if op == "segment_weights" and b == "cuda" and not has_triton():  # the cuda loss kernels' weights: Triton's
        return "torch"
    return b


def _resolve(backend: str, device_type: str, op) -> str:
    return resolve(backend, torch.device(device_type), op)


# torch._dynamo.assume_constant_result(_resolve), without importing torch._dynamo (about half of the package's
# import time): the decorator only sets this flag, which dynamo reads when it meets the call (tests/ops/
# test_compile.py checks both that the decorator still sets it and that compiled ops do not break the graph)
_resolve._dynamo_marked_constant = True


def resolve_backend(backend, device, op=None, *, dtype=None, placed=False):
    """`resolve` (seen by torch.compile as a constant: it imports modules and reads the environment, which
    dynamo will not trace), then the op's rule (`dtype`: its main input's; `placed`: segment_gae's seg_start
    given)."""
    return _op_rule(op, backend, _resolve(backend, device.type, op), device.type, dtype, placed)
