"""compactionrl_fast.ops._reduction: the weights of every reduction and denominator against the
reference's token weights (C++ op, the torch formulation, the fallbacks) and the backends against each other
(the Triton kernel under the interpreter), the layout and denominator checks
with the argument named, the global counts (a faked process group), and the shared loss-op autograd
(`loss_backward`, `register_op` with `loss_autograd`) called directly. Triton/CUDA paths: tests/ops/test_ppo_loss.py and
test_value_loss.py."""
import types

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.kernels import modes
from compactionrl_fast.ops import _dispatch, _register
from compactionrl_fast.ops import _reduction as red
from compactionrl_fast.ops import _validate
from compactionrl_fast.reference import losses as ref
from tests.utils import RecordOps, SHAPE_TABLE, packed_batch

REDS = ("token-mean", "segment-mean", "rollout-mean", "sum")


def _batch(name="four_segments", index_dtype=torch.int64):
    b = packed_batch(SHAPE_TABLE[name], seed=5, index_dtype=index_dtype)
    return b["loss_mask"], b["cu_seqlens"], b["cu_segments"]


def _per_token(w_seg, mask, cu):
    """[S] segment weights -> [T] token weights (0 where the mask is False)."""
    if cu is None:
        return torch.where(mask, w_seg[0], 0.0)
    lens = cu.long().diff()
    return torch.where(mask, torch.repeat_interleave(w_seg, lens), 0.0)


@pytest.mark.parametrize("fn", ["op", "torch", "fallback"])
@pytest.mark.parametrize("reduction", REDS)
@pytest.mark.parametrize("layout", ["full", "no_segments", "no_seqlens"])
@pytest.mark.parametrize("den", [None, 7.0, 0.0, "tensor", "tensor0"])
def test_weights_match_reference(monkeypatch, fn, reduction, layout, den):
    if reduction == "sum" and den is not None:
        return
    mask, cu, seg = _batch("empty_segments" if layout == "full" and den == 7.0 else "four_segments")
    if layout != "full":
        seg = None
    if layout == "no_seqlens":
        cu = None
    d = {"tensor": torch.tensor([3.0], dtype=torch.float64), "tensor0": torch.tensor(0)}.get(den, den)
    if fn == "fallback":  # no C++ op: the torch formulation through segment_weights
        monkeypatch.setattr(_dispatch, "cpp_ext", lambda: None)
    f = red.segment_weights_torch if fn == "torch" else red.segment_weights
    with RecordOps() as ops:
        w = f(mask, cu, seg, reduction, d)
    assert w.dtype == torch.float64 and w.shape == ((1,) if cu is None else (cu.numel() - 1,))
    dv = None if d is None else float(d.reshape(())) if isinstance(d, torch.Tensor) else d
    want = ref.token_weights(mask, cu, seg, reduction, dv)
    torch.testing.assert_close(_per_token(w, mask, cu), want, rtol=1e-6, atol=0)  # the reference rounds 1/D to float32
    assert ops.ops["compactionrl_fast.segment_weights.default"] == (fn == "op"), ops.ops
    if fn == "fallback":
        assert not any(k.startswith("compactionrl_fast.") for k in ops.ops), ops.ops


@pytest.mark.parametrize("fn", ["op", "torch"])
@pytest.mark.parametrize("reduction", REDS[:3])
def test_negative_or_nan_tensor_denominator_gives_nan(fn, reduction):
    mask, cu, seg = _batch()
    f = red.segment_weights_torch if fn == "torch" else red.segment_weights
    for d in (torch.tensor(-2.0), torch.tensor(float("nan"))):
        assert torch.isnan(f(mask, cu, seg, reduction, d)).all()
    assert (f(mask, cu, seg, reduction, torch.tensor(0.0)) == 0).all()


def test_weights_for_a_batch_with_nothing_trainable_are_zero():
    mask, cu, seg = torch.zeros(6, dtype=torch.bool), torch.tensor([0, 3, 6]), torch.tensor([0, 1, 2])
    for reduction in REDS[:3]:
        for f in (red.segment_weights, red.segment_weights_torch):
            assert f(mask, cu, seg, reduction).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("reduction", ["segment-mean", "rollout-mean"])
def test_units_with_one_trainable_token(reduction):
    # a unit with exactly one trainable token counts in D; without offsets the batch is one unit
    mask = torch.tensor([False, True, False, False, True, True])
    cu, seg = torch.tensor([0, 3, 6]), torch.tensor([0, 1, 2])
    for f in (red.segment_weights, red.segment_weights_torch):
        torch.testing.assert_close(_per_token(f(mask, cu, seg, reduction), mask, cu),
                                   ref.token_weights(mask, cu, seg, reduction), rtol=1e-6, atol=0)
        one = torch.tensor([False, True, False])
        assert f(one, None, None, reduction).tolist() == [1.0]
    assert crf.global_denominator(reduction, mask, cu_seqlens=cu, cu_segments=seg) == 2
    assert crf.global_denominator(reduction, torch.zeros(3, dtype=torch.bool)) == 0
    assert crf.global_denominator(reduction, torch.tensor([False, True])) == 1


def test_rollout_mean_with_an_empty_rollout():
    # rollout 1 has no segment: the repeat of the rollout ids must give it none
    mask = torch.tensor([True, True, False, True, True, True])
    cu, seg = torch.tensor([0, 2, 3, 6]), torch.tensor([0, 1, 1, 3])
    want = ref.token_weights(mask, cu, seg, "rollout-mean")
    for f in (red.segment_weights, red.segment_weights_torch):
        torch.testing.assert_close(_per_token(f(mask, cu, seg, "rollout-mean"), mask, cu), want)


@pytest.mark.parametrize("reduction, den", [("segment-mean", None), ("rollout-mean", torch.tensor(5.0)),
                                            ("token-mean", 4.0)])
def test_triton_backend_uses_the_triton_op(reduction, den):
    # routing only (a small batch under the interpreter); the kernels: tests/ops/test_ppo_loss.py
    pytest.importorskip("triton")
    mask, cu, seg = _batch()
    with RecordOps() as ops:
        w = red.segment_weights(mask, cu, seg, reduction, den, backend="triton")
    assert ops.ops["compactionrl_fast.segment_weights_triton.default"] == 1, ops.ops
    dv = None if den is None else float(den)
    torch.testing.assert_close(_per_token(w, mask, cu), ref.token_weights(mask, cu, seg, reduction, dv), rtol=1e-6,
                               atol=0)


def test_weights_fake():
    m = torch.ones(9, dtype=torch.bool)
    w = red._segment_weights_fake(m, torch.zeros(4, dtype=torch.int32), None, 1, -1.0, None)
    assert w.shape == (3,) and w.dtype == torch.float64
    assert red._segment_weights_fake(m, None, None, 0, -1.0, None).shape == (1,)


@pytest.mark.parametrize("reduction", ["token-mean", "segment-mean", "rollout-mean", "sum"])
@pytest.mark.parametrize("den", [None, 0.0, 37.0, "tensor", "negative"])
@pytest.mark.parametrize("layout", ["packed", "one segment", "no rollouts"])
def test_segment_weights_backends_agree(reduction, den, layout):
    """The per-segment reduction weights: C++ (CPU) and the Triton kernel (interpreter) against the torch
    formulation, on layouts with empty and untrainable segments."""
    from compactionrl_fast.ops import _reduction as red
    from tests.utils import SHAPE_TABLE, packed_batch

    if den is not None and reduction == "sum":
        pytest.skip("no denominator with 'sum'")
    b = packed_batch(SHAPE_TABLE["empty_segments"] + SHAPE_TABLE["no_trainable"] + SHAPE_TABLE["four_segments"],
                     index_dtype=torch.int64)
    cu = None if layout == "one segment" else b["cu_seqlens"]
    cs = b["cu_segments"] if layout == "packed" else None
    d = {"tensor": torch.tensor(41.0), "negative": torch.tensor(-2.0)}.get(den, den)
    want = red.segment_weights_torch(b["loss_mask"], cu, cs, reduction, d)
    got = [red.segment_weights(b["loss_mask"], cu, cs, reduction, d)]
    if "triton" in _dispatch.available(torch.device("cpu")):
        from compactionrl_fast.kernels.segments import segment_weights as launch

        counts = red.segment_counts(b["loss_mask"], cu) if cu is not None else torch.count_nonzero(b["loss_mask"]).reshape(1)
        got.append(launch(counts, cs, modes.REDUCTION[reduction], d))
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-15, atol=0, equal_nan=True)
    if den == "negative":
        assert want.isnan().all()


# ---------------------------------------------------------------- counts


@pytest.mark.parametrize("cu", [[0, 3, 3, 7, 10], [0, 2, 12], [0, -3, 10], [0, 0], [0]])
def test_segment_counts(monkeypatch, cu):
    # the torch path clamps out-of-range offsets to [0, T]
    mask = torch.tensor([True, False, True, True, False, True, True, True, False, True])
    cu = torch.tensor(cu)
    c = cu.clamp(0, 10).tolist()  # a negative offset must not wrap around
    want = [int(mask[a:b].sum()) for a, b in zip(c[:-1], c[1:])]
    if cu[-1] == 10 and bool((cu.diff() >= 0).all()):  # the C++ op refuses other offsets on CPU
        with RecordOps() as ops:
            got = red.segment_counts(mask, cu)
        assert got.dtype == torch.int64 and got.tolist() == want
        assert ops.ops["compactionrl_fast.segment_counts.default"] == 1
    monkeypatch.setattr(_dispatch, "cpp_ext", lambda: None)  # no C++ op: the torch formulation
    with RecordOps() as ops:
        got = red.segment_counts(mask, cu.int())
    assert got.tolist() == want and not any(k.startswith("compactionrl_fast.") for k in ops.ops)


def test_segment_counts_long_runs():
    """The C++ count adds 8 mask bytes at a time in byte lanes, 255 words per round: all-trainable runs past
    one and two rounds, unaligned starts and ends, tails under 8 bytes, empty segments."""
    T = 3 * 255 * 8 + 37
    g = torch.Generator().manual_seed(0)
    for mask in (torch.ones(T, dtype=torch.bool), torch.rand(T, generator=g) < 0.7):
        cu = torch.tensor([0, 3, 3, 2043, 2044, 6100, 6109, T])  # [2044, 6100): 507 words, 2 rounds
        want = [int(mask[a:b].sum()) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        assert red.segment_counts(mask, cu).tolist() == want


@pytest.mark.parametrize("reduction", REDS[:3])
@pytest.mark.parametrize("layout", ["full", "no_segments", "no_seqlens"])
@pytest.mark.parametrize("name", ["empty_segments", "four_segments", "no_trainable"])
def test_global_denominator(reduction, layout, name):
    mask, cu, seg = _batch(name)
    if layout != "full":
        seg = None
    if layout == "no_seqlens":
        cu = None
    if reduction == "token-mean":
        want = int(mask.sum())
    else:
        cu_ = torch.tensor([0, mask.numel()]) if cu is None else cu
        seg_ = torch.arange(cu_.numel()) if seg is None else seg
        segs = list(zip(cu_.tolist()[:-1], cu_.tolist()[1:]))
        if reduction == "segment-mean":
            units = segs
        else:
            units = [(segs[a][0], segs[b - 1][1]) if b > a else (0, 0) for a, b in zip(seg_.tolist()[:-1],
                                                                                      seg_.tolist()[1:])]
        want = sum(1 for a, b in units if mask[a:b].any())
    got = crf.global_denominator(reduction, mask, cu_seqlens=cu, cu_segments=seg)
    assert type(got) is int and got == want
    t = crf.global_denominator(reduction, mask, cu_seqlens=cu, cu_segments=seg, as_tensor=True)
    assert t.dtype == torch.int64 and t.shape == () and int(t) == want


def test_global_counts_all_reduce_over_the_group(monkeypatch):
    calls = []

    def all_reduce(t, group=None):
        calls.append(group)
        t += 100

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    mask = torch.tensor([True, False, True])
    assert crf.global_token_count(mask, group="g") == 102
    assert int(crf.global_token_count(mask, "h", as_tensor=True)) == 102
    assert crf.global_denominator("segment-mean", mask, cu_seqlens=torch.tensor([0, 1, 3]), group="k") == 102
    assert calls == ["g", "h", "k"]


def test_global_token_count_local():
    mask = torch.tensor([True, False, True, True])
    assert type(crf.global_token_count(mask)) is int and crf.global_token_count(mask) == 3
    t = crf.global_token_count(mask, as_tensor=True)
    assert t.shape == () and t.dtype == torch.int64 and int(t) == 3


def test_global_denominator_refusals():
    mask = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="^reduction"):
        crf.global_denominator("sum", mask)
    with pytest.raises(TypeError, match="^loss_mask must have dtype"):
        crf.global_denominator("token-mean", torch.ones(3))
    with pytest.raises(ValueError, match="^loss_mask must be 1-D"):
        crf.global_denominator("token-mean", torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^loss_mask is on the meta device, which holds no values: a Python int "
                                         r"count needs real data \(pass as_tensor=True for a meta tensor\)$"):
        crf.global_denominator("token-mean", mask.to("meta"))
    with pytest.raises(ValueError, match="^cu_seqlens"):
        crf.global_denominator("segment-mean", mask, cu_seqlens=torch.tensor([0, 2]))
    t = crf.global_denominator("token-mean", mask.to("meta"), as_tensor=True)
    assert t.device.type == "meta" and t.shape == ()


# ---------------------------------------------------------------- layout and denominator checks


def test_check_layout_accepts():
    mask = torch.ones(4, dtype=torch.bool)
    assert _validate.check_layout(mask, None, None) is None
    assert _validate.check_layout(mask, torch.tensor([0, 2, 4]), None) is None
    seg = _validate.check_layout(mask, torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 2]))
    assert seg.dtype == torch.int32 and seg.tolist() == [0, 1, 2]


@pytest.mark.parametrize("cu, seg, err, match", [
    (None, torch.tensor([0, 1]), ValueError, "^cu_segments needs cu_seqlens"),
    (torch.tensor([0.0, 4.0]), None, TypeError, "^cu_seqlens"),
    (torch.tensor([0, 3]), None, ValueError, r"^cu_seqlens\[-1\] must equal T=4, got 3"),
    (torch.tensor([], dtype=torch.int64), None, ValueError, "^cu_seqlens must have at least one element"),
    (torch.tensor([0, 4]), torch.tensor([0.0, 1.0]), TypeError, "^cu_segments"),
    (torch.tensor([0, 4]), torch.tensor([0, 2]), ValueError, r"^cu_segments\[-1\] must equal S \(number of "
                                                              r"segments\)=1, got 2"),
    (torch.tensor([0, 4]), torch.tensor([[0, 1]]), ValueError, "^cu_segments"),
])
def test_check_layout_refuses(cu, seg, err, match):
    with pytest.raises(err, match=match):
        _validate.check_layout(torch.ones(4, dtype=torch.bool), cu, seg)


def test_check_layout_on_the_meta_device():
    # no values read: bad offsets pass, empty offset vectors and the dtype/shape/device checks still refuse
    mask = torch.ones(4, dtype=torch.bool, device="meta")
    cu = torch.tensor([0, 9], device="meta")
    assert _validate.check_layout(mask, cu, torch.tensor([0, 5], dtype=torch.int32, device="meta")).dtype == torch.int64
    with pytest.raises(ValueError, match=r"^cu_seqlens must have at least one element \(offsets \[S\+1\]\)"):
        _validate.check_layout(mask, torch.zeros(0, dtype=torch.int64, device="meta"), None)
    with pytest.raises(ValueError, match=r"^cu_segments must have at least one element \(offsets \[R\+1\]\)"):
        _validate.check_layout(mask, cu, torch.zeros(0, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="^cu_seqlens is on cpu"):
        _validate.check_layout(mask, torch.tensor([0, 4]), None)
    with pytest.raises(ValueError, match="^cu_segments is on cpu"):
        _validate.check_layout(mask, cu, torch.tensor([0, 1]))


def test_check_layout_without_value_checks(monkeypatch):
    # COMPACTIONRL_FAST_CHECKS=0: offsets are not read, but dtype/shape/device and emptiness are still checked
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "0")
    mask = torch.ones(4, dtype=torch.bool)
    assert _validate.check_layout(mask, torch.tensor([0, 9]), torch.tensor([0, 5])).tolist() == [0, 5]
    assert _validate.check_layout(torch.ones(0, dtype=torch.bool), torch.tensor([0]), torch.tensor([0])).tolist() == [0]
    meta = torch.device("meta")
    for cu, seg, err, match in [
        (torch.tensor([0.0, 4.0]), None, TypeError, "^cu_seqlens must have dtype"),
        (torch.tensor([[0, 4]]), None, ValueError, "^cu_seqlens must be 1-D"),
        (torch.tensor([0, 4], device=meta), None, ValueError, "^cu_seqlens is on meta"),
        (torch.tensor([0, 4]), torch.tensor([0.0, 1.0]), TypeError, "^cu_segments must have dtype"),
        (torch.tensor([0, 4]), torch.tensor([[0, 1]]), ValueError, "^cu_segments must be 1-D"),
        (torch.tensor([0, 4]), torch.tensor([0, 1], device=meta), ValueError, "^cu_segments is on meta"),
        (torch.zeros(0, dtype=torch.int64), None, ValueError, r"^cu_seqlens must have at least one element \(offsets "
                                                              r"\[S\+1\]\)$"),
        (torch.tensor([0, 4]), torch.zeros(0, dtype=torch.int64), ValueError, r"^cu_segments must have at least one "
                                                                              r"element \(offsets \[R\+1\]\)$"),
    ]:
        with pytest.raises(err, match=match):
            _validate.check_layout(mask, cu, seg)


def test_check_denominator_accepts():
    assert _validate.check_denominator(None, "sum") is None
    assert _validate.check_denominator(None, "token-mean") is None
    assert _validate.check_denominator(3, "token-mean") == 3.0 and type(_validate.check_denominator(3, "token-mean")) is float
    assert _validate.check_denominator(0.0, "segment-mean") == 0.0
    t = torch.tensor([[5]])
    out = _validate.check_denominator(t, "rollout-mean", torch.device("cpu"))
    assert out.shape == () and int(out) == 5
    assert _validate.check_denominator(torch.tensor(0.0), "token-mean").shape == ()
    meta = torch.tensor(-1.0, device="meta")  # not readable: passes, the loss shows it
    assert _validate.check_denominator(meta, "token-mean", torch.device("meta")).device.type == "meta"


@pytest.mark.parametrize("den, reduction, device, err, match", [
    (2.0, "sum", None, ValueError, "^denominator has no meaning with reduction='sum'"),
    (torch.tensor(2.0), "sum", None, ValueError, "^denominator has no meaning"),
    (torch.tensor([1.0, 2.0]), "token-mean", None, ValueError,
     r"^denominator must be a number or a one-element tensor, got shape \(2,\)"),
    (torch.tensor(1.0), "token-mean", torch.device("meta"), ValueError, "^denominator is on cpu, expected meta"),
    (torch.tensor(True), "token-mean", None, TypeError, "^denominator must be a real number tensor, got torch.bool"),
    (torch.tensor(1 + 1j), "token-mean", None, TypeError, "^denominator must be a real number tensor"),
    (torch.tensor(-1.0), "token-mean", None, ValueError, r"^denominator must be a finite number >= 0, got -1.0"),
    (torch.tensor(float("nan")), "segment-mean", None, ValueError, "^denominator must be a finite number >= 0"),
    (torch.tensor(float("inf")), "segment-mean", None, ValueError, "^denominator must be a finite number >= 0"),
    (-1.0, "token-mean", None, ValueError, "^denominator"),
    ("3", "token-mean", None, TypeError, "^denominator"),
])
def test_check_denominator_refuses(den, reduction, device, err, match):
    with pytest.raises(err, match=match):
        _validate.check_denominator(den, reduction, device)


def test_inverse_denominator():
    assert red._inverse_denominator(0.0) == 0.0 and red._inverse_denominator(4.0) == 0.25
    got = red._inverse_denominator(torch.tensor([4.0, 0.0, -1.0, float("nan")], dtype=torch.float32))
    assert got.dtype == torch.float64
    assert got[:2].tolist() == [0.25, 0.0] and got[2:].isnan().all()
    assert red._inverse_denominator(torch.tensor(0.5)).item() == 2.0
    inv = red._inverse(torch.tensor([0, 4, 3]))
    assert inv.dtype == torch.float64 and inv.tolist() == [0.0, 0.25, 1 / 3]


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert _dispatch.resolve_backend("torch", cpu) == "torch"
    assert _dispatch.resolve_backend("auto", cpu, op="segment_gae") == "cpp"
    assert _dispatch.resolve_backend("auto", cpu, op="linear_logprobs") == "torch-tuned"  # the op's own order
    with pytest.raises(ValueError, match="^backend"):
        _dispatch.resolve_backend("cuda", cpu, op="ppo_policy_loss")


# ---------------------------------------------------------------- the shared autograd of the loss ops


class _Ctx:
    def __init__(self, grad):
        self.saved_tensors = (grad,)


def test_loss_backward_hands_out_the_saved_gradient_once():
    bwd = _register.loss_backward("my::op", 4)
    g = torch.tensor([1.0, -2.0])
    ctx = _Ctx(g)
    with RecordOps() as ops:  # d_loss = 1 on CPU: no pass over the buffer
        out = bwd(ctx, torch.tensor(1.0), None, None)
    assert "aten.mul_.Tensor" not in ops.ops, ops.ops
    assert len(out) == 4 and out[0] is g and out[1:] == (None, None, None)
    assert g.tolist() == [1.0, -2.0]
    with pytest.raises(RuntimeError, match=r"^my::op: a second backward through the same loss is not supported \(the "
                                           r"first backward handed out its gradient buffer\); compute the loss "
                                           r"again, or use backend='torch'$"):
        bwd(ctx, torch.tensor(1.0), None, None)


@pytest.mark.parametrize("d_loss", [torch.tensor(3.0), torch.tensor(-0.5), torch.tensor(1.0, device="meta")])
def test_loss_backward_scales_by_the_incoming_gradient(d_loss):
    bwd = _register.loss_backward("my::op", 2)
    g = torch.tensor([1.0, -2.0], device=d_loss.device)
    out = bwd(_Ctx(g), d_loss, None, None)
    assert len(out) == 2 and out[1] is None
    if d_loss.device.type == "cpu":
        assert out[0].tolist() == [float(d_loss), -2 * float(d_loss)]
    else:
        assert out[0] is g


def test_loss_backward_scales_a_tensor_subclass_gradient():
    # not a plain CPU tensor: no .item() shortcut, the gradient is scaled
    class Sub(torch.Tensor):
        pass

    g = torch.tensor([1.0, -2.0])
    with RecordOps() as ops:
        out = _register.loss_backward("my::op", 1)(_Ctx(g), torch.tensor(1.0).as_subclass(Sub), None, None)
    assert out[0].tolist() == [1.0, -2.0] and len(out) == 1
    assert ops.ops["aten.mul_.Tensor"] == 1, ops.ops


def test_register_loss_op(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.library, "register_fake", lambda name, fake: calls.setdefault("fake", (name, fake)))

    def reg_autograd(name, backward, setup_context):
        calls["autograd"] = (name, backward, setup_context)

    monkeypatch.setattr(torch.library, "register_autograd", reg_autograd)
    monkeypatch.setattr(_register, "has_cpp_op", lambda name: True)
    fake = object()
    _register.register_op("loss", fake, **_register.loss_autograd("loss", 3))
    assert calls["fake"] == ("compactionrl_fast::loss", fake)
    name, backward, setup = calls["autograd"]
    assert name == "compactionrl_fast::loss"
    ctx = types.SimpleNamespace()
    ctx.set_materialize_grads = lambda v: setattr(ctx, "materialize", v)
    ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
    grad = torch.tensor([2.0])
    setup(ctx, (), (torch.tensor(0.0), torch.zeros(5), grad))
    assert ctx.materialize is False and ctx.saved_tensors[0] is grad and len(ctx.saved_tensors) == 1
    out = backward(ctx, torch.tensor(2.0), None, None)
    assert len(out) == 3 and out[0].tolist() == [4.0]
    with pytest.raises(RuntimeError, match="^compactionrl_fast::loss"):
        backward(ctx, torch.tensor(2.0), None, None)


@pytest.mark.parametrize("reduction, denominator", [(r, d) for r in ("token-mean", "segment-mean", "rollout-mean")
                                                     for d in (None, 4.0, "tensor")] + [("sum", None)])
def test_torch_weights_make_every_buffer_on_the_input_device(reduction, denominator):
    """The torch formulation off the CPU (meta tensors stand in for another device): no CPU buffer, no host
    read (a repeat_interleave without its output size would need one)."""
    from compactionrl_fast.ops._reduction import segment_counts, segment_weights_torch, unit_counts

    mask = torch.empty(9, dtype=torch.bool, device="meta")
    cu, seg = torch.empty(4, dtype=torch.int64, device="meta"), torch.empty(3, dtype=torch.int64, device="meta")
    den = torch.empty((), device="meta") if denominator == "tensor" else denominator
    w = segment_weights_torch(mask, cu, seg, reduction, den)
    assert w.device.type == "meta" and w.shape == (3,) and w.dtype == torch.float64
    n, d = unit_counts(mask, cu, seg, reduction)
    assert n.device.type == d.device.type == "meta" and n.shape == (3,)
    assert segment_counts(mask, cu).device.type == "meta"


def test_cuda_tensors_take_the_triton_ops():
    """On CUDA (fake tensors here) the counts and the weights are the Triton ops' (one call each)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compactionrl_fast.ops._reduction import segment_counts, segment_weights

    if not _dispatch.has_triton():
        pytest.skip("needs triton")
    with FakeTensorMode():
        mask = torch.ones(9, dtype=torch.bool, device="cuda")
        cu, seg = torch.tensor([0, 3, 6, 9], device="cuda"), torch.tensor([0, 2, 3], device="cuda")
        rec = RecordOps()
        with rec:
            n = segment_counts(mask, cu)
            w = segment_weights(mask, cu, seg, "segment-mean")
        assert n.shape == (3,) and n.dtype == torch.int64 and w.shape == (3,) and w.dtype == torch.float64
    assert [f for f, _ in rec.calls] == ["compactionrl_fast.segment_counts_triton.default",
                                         "compactionrl_fast.segment_weights_triton.default"]
    assert rec.args("segment_counts_triton")[0] is mask and rec.args("segment_counts_triton")[1] is cu
