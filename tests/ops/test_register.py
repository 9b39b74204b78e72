"""`register_op`, the one way an op's kernel becomes a torch op: a Python impl with its fake and autograd, an
impl wrapped by a decorator from another module (string annotations), a C++ op the build lacks, `has_cpp_op`.
Each test registers ops of its own names: a custom op cannot be registered twice in one process."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from compactionrl_fast.ops import _dispatch
from compactionrl_fast.ops._register import has_cpp_op, register_op

_ids = itertools.count()


def _name():
    return f"test_register_{next(_ids)}"


def _scale(x: Tensor, k: float) -> Tensor:
    return x * (2.0 * k)


def _backward(ctx, g):
    return g * (2.0 * ctx.k), None


def _setup(ctx, inputs, output):
    ctx.k = inputs[1]


def test_a_python_impl_becomes_an_op_with_its_fake_and_autograd():
    name, fakes = _name(), []

    def fake(x, k):
        fakes.append(k)
        return torch.empty_like(x)

    assert register_op(name, fake, _scale, backward=_backward, setup_context=_setup) is True
    op = getattr(torch.ops.compactionrl_fast, name)
    x = torch.arange(3.0, requires_grad=True)
    y = op(x, 1.5)
    assert torch.equal(y.detach(), torch.tensor([0.0, 3.0, 6.0])) and fakes == []
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))
    with FakeTensorMode() as mode:
        out = op(mode.from_tensor(torch.ones(4)), 0.5)
    assert out.shape == (4,) and fakes == [0.5]  # shapes came from the fake, not from the kernel


def test_without_a_backward_the_op_has_no_gradient():
    name = _name()
    assert register_op(name, lambda x, k: torch.empty_like(x), _scale)
    y = getattr(torch.ops.compactionrl_fast, name)(torch.ones(2, requires_grad=True), 1.0)
    with pytest.raises(RuntimeError):
        y.sum().backward()


def test_an_impl_wrapped_in_another_module_keeps_its_annotations():
    """Under `from __future__ import annotations` the annotations are strings; torch would evaluate them in the
    wrapper's module, which has no `Tensor` (as with mutmut's trampolines or a profiling decorator)."""
    ns = {"functools": functools}
    exec("def wrap(fn):\n    @functools.wraps(fn)\n    def w(*a, **k):\n        return fn(*a, **k)\n    return w", ns)

    def scale(x: Tensor, k: float) -> Tensor:
        return x * k

    name = _name()
    assert register_op(name, lambda x, k: torch.empty_like(x), ns["wrap"](scale))
    assert torch.equal(getattr(torch.ops.compactionrl_fast, name)(torch.ones(2), 3.0), torch.full((2,), 3.0))


def test_a_cpp_op_the_build_lacks_is_skipped():
    name = _name()
    assert register_op(name, lambda x: x) is False
    assert not hasattr(torch.ops.compactionrl_fast, name)


def test_has_cpp_op(monkeypatch):
    assert not has_cpp_op("no_such_op")
    if _dispatch.cpp_ext() is None:
        pytest.skip("the C++ extension is not built")
    assert has_cpp_op("segment_gae")
    monkeypatch.setattr(_dispatch, "cpp_ext", lambda: None)  # a build without the extension
    assert not has_cpp_op("segment_gae")
