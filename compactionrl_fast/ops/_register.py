"""The one way an op's kernels become torch ops: `register_op`.

Every backend kernel of an op is a `compactionrl_fast::<name>` custom op with a fake implementation (shapes
and dtypes only: torch.compile and FakeTensorMode run it instead of the kernel, which keeps tracing free of
graph breaks and host syncs) and, when it is differentiable, an autograd formula. A C++ op takes its schema
and kernels from csrc/ (csrc/schemas.cpp); a Python one (a Triton launcher, or a torch implementation) is
defined here from its type-annotated function. Either way the public function calls
`torch.ops.compactionrl_fast.<name>` and nothing else.

The one exception is `linear_logprobs_loss`, a torch.autograd.Function: it takes a Python callable, which
an op schema cannot carry.
"""
from __future__ import annotations

import inspect
import typing

import torch

from . import _dispatch

NAMESPACE = "compactionrl_fast"


def has_cpp_op(name: str) -> bool:
    """Whether the built extension defines `name` (a stale build may lack a new op)."""
    return _dispatch.cpp_ext() is not None and hasattr(torch.ops.compactionrl_fast, name)


def register_op(name, fake, impl=None, *, backward=None, setup_context=None):
    """Register `compactionrl_fast::<name>`: the op itself from `impl` (None: a C++ op from csrc/, skipped
    when the extension is not built or lacks it), its `fake` implementation, and with `backward` its
    autograd formula (`torch.library.register_autograd`'s backward and setup_context). Returns whether the
    op was registered."""
    qualname = f"{NAMESPACE}::{name}"
    if impl is not None:
        # the schema is inferred from the annotations; resolved here, in the module that wrote them (under
        # `from __future__ import annotations` torch evaluates them in the globals of a decorator's wrapper)
        inspect.unwrap(impl).__annotations__ = typing.get_type_hints(impl)
        torch.library.custom_op(qualname, impl, mutates_args=())
    elif not has_cpp_op(name):
        return False
    torch.library.register_fake(qualname, fake)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context)
    return True


def loss_backward(name: str, n_inputs: int):
    """The backward of a fused loss op `name`: d input-0 = the saved gradient * d_loss."""
    none = (None,) * (n_inputs - 1)

    def backward(ctx, d_loss, d_metrics, d_grad):
        # The saved buffer becomes the input's gradient (fwd+bwd allocate one [T] buffer in all). It is
        # handed out once: a second backward through the same graph (retain_graph=True) would have to
        # scale the buffer the first one returned, so it is refused instead.
        if getattr(ctx, "grad_handed_out", False):
            raise RuntimeError(f"{name}: a second backward through the same loss is not supported (the first "
                               "backward handed out its gradient buffer); compute the loss again, or use "
                               "backend='torch'")
        ctx.grad_handed_out = True
        (grad,) = ctx.saved_tensors
        if type(d_loss) is torch.Tensor and d_loss.device.type == "cpu" and not torch.compiler.is_compiling() \
                and d_loss.item() == 1.0:
            return (grad,) + none  # loss.backward() in eager mode on CPU: skip a pass over [T] (no sync there)
        return (grad.mul_(d_loss),) + none

    return backward


def _loss_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zero [T] gradient for the unused `grad` output
    ctx.save_for_backward(output[2])


def loss_autograd(name: str, n_inputs: int) -> dict:
    """`register_op`'s autograd arguments for a fused loss op `name` returning (loss [], metrics [k],
    grad [T] or [0]), whose kernel already wrote d loss / d input-0 into `grad` during the forward pass
    (the other `n_inputs - 1` inputs get no gradient)."""
    return {"backward": loss_backward(f"{NAMESPACE}::{name}", n_inputs), "setup_context": _loss_setup_context}
