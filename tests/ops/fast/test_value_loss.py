"""compactionrl_fast.ops.value_loss's Python entry on the cpp and torch backends, fast: loss, metrics and
gradient against the float64 reference (its autograd) for every reduction, layout and clip; the arguments
handed to the op; every argument check with its name; the fake impl and the registration.
Triton/CUDA: tests/ops/test_value_loss.py."""
import importlib

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.reference import losses as ref
from tests.ops.fast._record import RecordOps
from tests.utils import SHAPE_TABLE, packed_batch

ops_vl = importlib.import_module("compactionrl_fast.ops.value_loss")  # the package exports the function
BACKENDS = ("cpp", "torch")
REDS = ("token-mean", "segment-mean", "rollout-mean", "sum")


def _inputs(name="four_segments", seed=0, dtype=torch.float32):
    b = packed_batch(SHAPE_TABLE[name], seed=seed)
    T = b["loss_mask"].numel()
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(T, generator=g, dtype=torch.float64)
    v = old + torch.randn(T, generator=g, dtype=torch.float64) * 0.5  # |v - old| both sides of the clips
    ret = torch.randn(T, generator=g, dtype=torch.float64) * 2
    return dict(values=v.to(dtype), old_values=old.to(dtype), returns=ret.to(dtype), loss_mask=b["loss_mask"],
                cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"])


def _compare(backend, inp, scale=1.0, **kw):
    v_ref = inp["values"].detach().double().requires_grad_()
    args = {k: v for k, v in inp.items() if k != "values"}
    loss_r, m_r = ref.value_loss(v_ref, **args, **kw)
    (loss_r * scale).backward()
    v = inp["values"].detach().clone().requires_grad_()
    loss, m = crf.value_loss(v, **args, backend=backend, **kw)
    (loss * scale).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), loss_r.detach(), rtol=1e-5, atol=1e-6)
    assert set(m) == set(ops_vl.METRICS)
    for k in ops_vl.METRICS:
        assert m[k].dtype == torch.float32 and m[k].shape == () and not m[k].requires_grad, k
        torch.testing.assert_close(m[k].double(), m_r[k], rtol=1e-5, atol=1e-5, msg=k)
    assert v.grad.dtype == v.dtype
    tol = 1e-2 if v.dtype == torch.bfloat16 else 1e-4  # bf16: the gradient is rounded to 8 bits
    torch.testing.assert_close(v.grad.double(), v_ref.grad, rtol=tol, atol=1e-6)
    return loss_r.detach()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_reductions_match_reference(backend, reduction, clip):
    _compare(backend, _inputs(), clip=clip, reduction=reduction)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [
    dict(clip=0.0),
    dict(clip=0.3, reduction="segment-mean", denominator=3),
    dict(clip=1, reduction="rollout-mean", denominator=torch.tensor(2.0)),
    dict(reduction="token-mean", denominator=500.0),
])
def test_options_match_reference(backend, kw):
    _compare(backend, _inputs(seed=2), scale=-1.5, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_option_changes_the_loss(backend):
    inp = _inputs(seed=2)
    base, m0 = crf.value_loss(**inp, backend=backend)
    for kw in (dict(clip=0.1), dict(reduction="segment-mean"), dict(reduction="rollout-mean"), dict(reduction="sum"),
               dict(denominator=3.0)):
        assert not torch.allclose(crf.value_loss(**inp, backend=backend, **kw)[0], base), kw
    m = crf.value_loss(**inp, clip=0.1, backend=backend)[1]
    assert float(m0["clip_fraction"]) == 0.0 < float(m["clip_fraction"]) < 1.0
    assert float(m["explained_variance"]) != 0.0 and float(m["value_mean"]) != 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["no_segments", "no_seqlens"])
def test_layout_defaults(backend, layout):
    inp = _inputs()
    inp["cu_segments"] = None
    if layout == "no_seqlens":
        inp["cu_seqlens"] = None
    _compare(backend, inp, clip=0.2, reduction="rollout-mean" if layout == "no_segments" else "segment-mean")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtypes_and_strides(backend, dtype):
    inp = _inputs(dtype=dtype)
    T = inp["loss_mask"].numel()
    for k in ("old_values", "returns"):
        wide = torch.zeros(T, 2, dtype=dtype)
        wide[:, 1] = inp[k]
        inp[k] = wide[:, 1]
    mask = torch.zeros(T, 2, dtype=torch.bool)
    mask[:, 0] = inp["loss_mask"]
    inp["loss_mask"] = mask[:, 0]
    cu = torch.zeros(inp["cu_seqlens"].numel(), 3, dtype=inp["cu_seqlens"].dtype)
    cu[:, 2] = inp["cu_seqlens"]
    inp["cu_seqlens"] = cu[:, 2]
    _compare(backend, inp, clip=0.2, reduction="segment-mean")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_trainable(backend):
    inp = _inputs()
    inp["loss_mask"] = torch.zeros_like(inp["loss_mask"])
    assert float(_compare(backend, inp)) == 0.0


def test_op_arguments():
    inp = _inputs()
    v = inp["values"].clone().requires_grad_()
    args = {k: x for k, x in inp.items() if k != "values"}
    with RecordOps() as rec:
        crf.value_loss(v, **args, backend="cpp")
    a = rec.args("value_loss")
    assert a[4] is not None and a[5].dtype == torch.float64 and (a[6], a[7]) == (-1.0, True)
    with RecordOps() as rec:
        crf.value_loss(v, **args, clip=1, backend="cpp")
    a = rec.args("value_loss")
    assert a[6] == 1.0 and type(a[6]) is float
    with RecordOps() as rec:
        crf.value_loss(v.detach(), **args, backend="cpp")
    assert rec.args("value_loss")[7] is False
    with RecordOps() as rec, torch.no_grad():
        crf.value_loss(v, **args, backend="cpp")
    assert rec.args("value_loss")[7] is False
    with RecordOps() as rec:
        crf.value_loss(v, **{**args, "cu_seqlens": None, "cu_segments": None}, backend="cpp")
    assert rec.args("value_loss")[4] is None
    with RecordOps() as rec:
        crf.value_loss(v, **args, backend="torch")
    assert rec.calls == []


def test_default_backend_is_cpp_on_cpu():
    inp = _inputs()
    with RecordOps() as rec:
        loss, _ = crf.value_loss(**inp, clip=0.2)
    assert [f for f, _ in rec.calls] == ["compactionrl_fast.segment_weights.default",
                                         "compactionrl_fast.value_loss.default"]
    torch.testing.assert_close(loss.double(), ref.value_loss(**inp, clip=0.2)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["rollout-mean", "sum"])
def test_triton_backend_runs_the_triton_ops(reduction):
    # routing only (8 tokens under the interpreter); the kernels: tests/ops/test_value_loss.py
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(8, generator=g) for _ in range(3))
    mask, cu, seg = torch.rand(8, generator=g) < 0.7, torch.tensor([0, 3, 8]), torch.tensor([0, 2])
    kw = dict(cu_seqlens=cu, cu_segments=seg, reduction=reduction, clip=0.3)
    with RecordOps() as rec:
        loss, _ = crf.value_loss(v, old, ret, mask, backend="triton", **kw)
    assert [f for f, _ in rec.calls] == ["compactionrl_fast.segment_weights_triton.default",
                                         "compactionrl_fast.value_loss_triton.default"]
    torch.testing.assert_close(loss.double(), ref.value_loss(v, old, ret, mask, **kw)[0], rtol=1e-5, atol=1e-6)


def _call(**over):
    T = 4
    kw = dict(values=torch.zeros(T), old_values=torch.zeros(T), returns=torch.zeros(T),
              loss_mask=torch.ones(T, dtype=torch.bool), backend="cpp")
    kw.update(over)
    return crf.value_loss(**kw)


@pytest.mark.parametrize("over, err, match", [
    (dict(loss_mask=torch.ones(4)), TypeError, "^loss_mask"),
    (dict(loss_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "^loss_mask"),
    (dict(values=torch.zeros(3)), ValueError, "^values"),
    (dict(old_values=torch.zeros(4, dtype=torch.int32)), TypeError, "^old_values"),
    (dict(returns=torch.zeros(4, 1)), ValueError, "^returns"),
    (dict(returns=torch.zeros(4, device="meta")), ValueError, "^returns is on meta"),
    (dict(values=torch.zeros(4, device="meta")), ValueError, "^values is on meta"),
    (dict(old_values=torch.zeros(4, device="meta")), ValueError, "^old_values is on meta"),
    (dict(old_values=torch.zeros(5)), ValueError, "^old_values must have 4 elements"),
    (dict(clip=-0.1), ValueError, "^clip"),
    (dict(clip="0.2"), TypeError, "^clip"),
    (dict(reduction="mean"), ValueError, "^reduction"),
    (dict(reduction="sum", denominator=2.0), ValueError, "^denominator"),
    (dict(denominator=-2.0), ValueError, "^denominator"),
    (dict(cu_seqlens=torch.tensor([0, 3])), ValueError, "^cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 4]), cu_segments=torch.tensor([0, 2])), ValueError, "^cu_segments"),
    (dict(backend="fast"), ValueError, "^backend"),
])
def test_refused_naming_the_argument(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


def test_fake_impl():
    v = torch.zeros(6)
    loss, m, g = ops_vl._fake(v, v, v, None, None, None, -1.0, True)
    assert loss.shape == () and m.shape == (len(ops_vl.METRICS),) and g.shape == (6,)
    assert ops_vl._fake(v, v, v, None, None, None, -1.0, False)[2].shape == (0,)


def test_register():
    # the Triton op and (where built) the C++ op are registered with `_fake`: FakeTensorMode runs it
    from torch._subclasses.fake_tensor import FakeTensorMode

    names = [n for n in ("value_loss_triton", "value_loss") if hasattr(torch.ops.compactionrl_fast, n)]
    assert names[0] == "value_loss_triton"
    with FakeTensorMode():
        v, mask, scale = torch.zeros(6), torch.ones(6, dtype=torch.bool), torch.ones(1, dtype=torch.float64)
        for n in names:
            loss, m, g = getattr(torch.ops.compactionrl_fast, n)(v, v, v, mask, None, scale, -1.0, True)
            assert loss.shape == () and m.shape == (len(ops_vl.METRICS),) and g.shape == (6,)
