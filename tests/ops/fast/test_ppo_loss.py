"""compactionrl_fast.ops.ppo_loss's Python entry on the cpp and torch backends, fast: loss, metrics and
gradient against the float64 reference (its autograd) for every reduction, layout, clip, dual clip and
truncated importance weight; the arguments handed to the op; every argument check with its name; the fake
impl and the registration. Triton/CUDA: tests/ops/test_ppo_loss.py."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops import ppo_loss as ops_ppo
from compactionrl_fast.reference import losses as ref
from tests.ops.fast._record import RecordOps
from tests.utils import SHAPE_TABLE, packed_batch

BACKENDS = ("cpp", "torch")
REDS = ("token-mean", "segment-mean", "rollout-mean", "sum")


def _inputs(name="four_segments", seed=0, dtype=torch.float32):
    b = packed_batch(SHAPE_TABLE[name], seed=seed)
    T = b["loss_mask"].numel()
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(T, generator=g, dtype=torch.float64) * 0.6  # ratios 0.2-5: every clip binds
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    roll = old + torch.randn(T, generator=g, dtype=torch.float64) * 0.5
    return dict(logprobs=lp.to(dtype), old_logprobs=old.to(dtype), advantages=adv.to(dtype),
                loss_mask=b["loss_mask"], rollout_logprobs=roll.to(dtype), cu_seqlens=b["cu_seqlens"],
                cu_segments=b["cu_segments"])


def _compare(backend, inp, scale=1.0, **kw):
    """Loss, metrics and d loss / d logprobs of `backend` against the reference, and the reference's loss."""
    lp_ref = inp["logprobs"].detach().double().requires_grad_()
    args = {k: v for k, v in inp.items() if k != "logprobs"}
    loss_r, m_r = ref.ppo_policy_loss(lp_ref, **args, **kw)
    (loss_r * scale).backward()
    lp = inp["logprobs"].detach().clone().requires_grad_()
    loss, m = crf.ppo_policy_loss(lp, **args, backend=backend, **kw)
    (loss * scale).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), loss_r, rtol=1e-5, atol=1e-6)
    assert set(m) == set(ops_ppo.METRICS)
    for k in ops_ppo.METRICS:
        assert m[k].dtype == torch.float32 and m[k].shape == () and not m[k].requires_grad, k
        torch.testing.assert_close(m[k].double(), m_r[k], rtol=1e-5, atol=1e-6, msg=k)
    assert lp.grad.dtype == lp.dtype
    tol = 1e-2 if lp.dtype == torch.bfloat16 else 1e-4  # bf16: the gradient is rounded to 8 bits
    torch.testing.assert_close(lp.grad.double(), lp_ref.grad, rtol=tol, atol=1e-6)
    return loss_r


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDS)
def test_reductions_match_reference(backend, reduction):
    _compare(backend, _inputs(), reduction=reduction)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [
    dict(clip_low=0.1, clip_high=0.3),
    dict(clip_low=0.3, clip_high=0.05, dual_clip=2.0),
    dict(dual_clip=1.5, tis_cap=1.2, reduction="segment-mean"),
    dict(tis_cap=0.9, reduction="rollout-mean", denominator=4.0),
    dict(clip_low=1.0, clip_high=0.0, reduction="token-mean", denominator=torch.tensor([50])),
])
def test_options_match_reference(backend, kw):
    inp = _inputs(seed=1)
    if "tis_cap" not in kw:
        inp["rollout_logprobs"] = None
    _compare(backend, inp, scale=-2.5, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_option_changes_the_loss(backend):
    # the inputs make every option bind, so a dropped option cannot pass the comparisons above
    inp = _inputs(seed=1)
    args = {k: v for k, v in inp.items() if k != "rollout_logprobs"}
    base = crf.ppo_policy_loss(**args, backend=backend)[0]
    for kw in (dict(clip_low=0.1), dict(clip_high=0.1), dict(dual_clip=1.5), dict(reduction="segment-mean"),
               dict(reduction="rollout-mean"), dict(denominator=3.0), dict(rollout_logprobs=inp["rollout_logprobs"]),
               dict(rollout_logprobs=inp["rollout_logprobs"], tis_cap=0.5)):
        other = crf.ppo_policy_loss(**{**args, **kw}, backend=backend)[0]
        assert not torch.allclose(other, base), kw
    m = crf.ppo_policy_loss(**args, dual_clip=1.5, backend=backend)[1]
    assert 0 < float(m["dual_clip_fraction"]) and 0 < float(m["clip_fraction"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["no_segments", "no_seqlens"])
def test_layout_defaults(backend, layout):
    inp = _inputs()
    inp["cu_segments"] = None
    if layout == "no_seqlens":
        inp["cu_seqlens"] = None
    _compare(backend, inp, reduction="rollout-mean" if layout == "no_segments" else "segment-mean")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtypes_and_strides(backend, dtype):
    inp = _inputs(dtype=dtype)
    T = inp["loss_mask"].numel()
    for k in ("old_logprobs", "advantages", "rollout_logprobs"):  # strided views
        wide = torch.zeros(T, 2, dtype=dtype)
        wide[:, 1] = inp[k]
        inp[k] = wide[:, 1]
    mask = torch.zeros(T, 2, dtype=torch.bool)
    mask[:, 0] = inp["loss_mask"]
    inp["loss_mask"] = mask[:, 0]
    cu = torch.zeros(inp["cu_seqlens"].numel(), 3, dtype=inp["cu_seqlens"].dtype)
    cu[:, 2] = inp["cu_seqlens"]
    inp["cu_seqlens"] = cu[:, 2]
    _compare(backend, inp, tis_cap=2.0, reduction="segment-mean", dual_clip=3.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_trainable(backend):
    inp = _inputs()
    inp["loss_mask"] = torch.zeros_like(inp["loss_mask"])
    assert float(_compare(backend, inp).detach()) == 0.0


# ---------------------------------------------------------------- what the op receives


def test_op_arguments():
    inp = _inputs()
    lp = inp["logprobs"].clone().requires_grad_()
    args = {k: v for k, v in inp.items() if k not in ("logprobs", "rollout_logprobs")}
    with RecordOps() as rec:
        crf.ppo_policy_loss(lp, **args, clip_low=0.1, clip_high=0.3, backend="cpp")
    a = rec.args("ppo_policy_loss")
    assert a[4] is None and a[5] is not None
    assert (a[7], a[8], a[9], a[10], a[11]) == (0.1, 0.3, ops_ppo.NO_DUAL_CLIP, float("inf"), True)
    assert ops_ppo.NO_DUAL_CLIP == torch.finfo(torch.float32).max
    assert a[6].dtype == torch.float64 and a[6].shape == (inp["cu_seqlens"].numel() - 1,)
    with RecordOps() as rec:
        crf.ppo_policy_loss(lp, **args, dual_clip=2, tis_cap=3, rollout_logprobs=inp["rollout_logprobs"],
                            backend="cpp")
    a = rec.args("ppo_policy_loss")
    assert a[4] is not None and (a[9], a[10], a[11]) == (2.0, 3.0, True)
    assert type(a[9]) is float and type(a[10]) is float
    with RecordOps() as rec:
        crf.ppo_policy_loss(lp.detach(), **args, backend="cpp")
    assert rec.args("ppo_policy_loss")[11] is False
    with RecordOps() as rec, torch.no_grad():
        crf.ppo_policy_loss(lp, **args, backend="cpp")
    assert rec.args("ppo_policy_loss")[11] is False
    with RecordOps() as rec:
        crf.ppo_policy_loss(lp, **{**args, "cu_seqlens": None, "cu_segments": None}, backend="cpp")
    assert rec.args("ppo_policy_loss")[5] is None


def test_default_backend_is_cpp_on_cpu():
    inp = _inputs()
    with RecordOps() as rec:
        loss, _ = crf.ppo_policy_loss(**inp)
    assert [f for f, _ in rec.calls] == ["compactionrl_fast.segment_weights.default",
                                         "compactionrl_fast.ppo_policy_loss.default"]
    torch.testing.assert_close(loss.double(), ref.ppo_policy_loss(**inp)[0], rtol=1e-5, atol=1e-6)


# the interpreter's numpy warns when the no-dual-clip sentinel -c*A (c = float32 max) overflows to inf, as intended
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("reduction", ["rollout-mean", "sum"])
def test_triton_backend_runs_the_triton_ops(reduction):
    # routing only (8 tokens under the interpreter); the kernels: tests/ops/test_ppo_loss.py
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    lp, old, adv = (torch.randn(8, generator=g) for _ in range(3))
    mask, cu, seg = torch.rand(8, generator=g) < 0.7, torch.tensor([0, 3, 8]), torch.tensor([0, 2])
    with RecordOps() as rec:
        loss, _ = crf.ppo_policy_loss(lp, old, adv, mask, cu_seqlens=cu, cu_segments=seg, reduction=reduction,
                                      backend="triton")
    assert [f for f, _ in rec.calls] == ["compactionrl_fast.segment_weights_triton.default",
                                         "compactionrl_fast.ppo_policy_loss_triton.default"]
    want = ref.ppo_policy_loss(lp, old, adv, mask, cu_seqlens=cu, cu_segments=seg, reduction=reduction)[0]
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)


def test_torch_backend_runs_no_op():
    inp = _inputs()
    with RecordOps() as rec:
        crf.ppo_policy_loss(**inp, backend="torch")
    assert rec.calls == []


# ---------------------------------------------------------------- argument checks


def _call(**over):
    T = 4
    kw = dict(logprobs=torch.zeros(T), old_logprobs=torch.zeros(T), advantages=torch.zeros(T),
              loss_mask=torch.ones(T, dtype=torch.bool), backend="cpp")
    kw.update(over)
    return crf.ppo_policy_loss(**kw)


@pytest.mark.parametrize("over, err, match", [
    (dict(loss_mask=torch.ones(4)), TypeError, "^loss_mask"),
    (dict(loss_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "^loss_mask"),
    (dict(logprobs=torch.zeros(3)), ValueError, "^logprobs"),
    (dict(old_logprobs=torch.zeros(4, dtype=torch.int32)), TypeError, "^old_logprobs"),
    (dict(advantages=torch.zeros(4, 1)), ValueError, "^advantages"),
    (dict(advantages=torch.zeros(4, device="meta")), ValueError, "^advantages"),
    (dict(rollout_logprobs=torch.zeros(5)), ValueError, "^rollout_logprobs must have 4 elements"),
    (dict(rollout_logprobs=torch.zeros(4, dtype=torch.int64)), TypeError, "^rollout_logprobs must have dtype"),
    (dict(rollout_logprobs=torch.zeros(4, 1)), ValueError, "^rollout_logprobs must be 1-D"),
    (dict(rollout_logprobs=torch.zeros(4, device="meta")), ValueError, "^rollout_logprobs is on meta"),
    (dict(logprobs=torch.zeros(4, device="meta")), ValueError, "^logprobs is on meta"),
    (dict(old_logprobs=torch.zeros(4, device="meta")), ValueError, "^old_logprobs is on meta"),
    (dict(clip_low=1.5), ValueError, "^clip_low"),
    (dict(clip_low=-0.1), ValueError, "^clip_low"),
    (dict(clip_high=-0.1), ValueError, "^clip_high"),
    (dict(clip_high="0.2"), TypeError, "^clip_high"),
    (dict(dual_clip=1.0), ValueError, "^dual_clip must be > 1, got 1.0"),
    (dict(dual_clip=0.5), ValueError, r"^dual_clip must be in \[1.0, inf\], got 0.5"),
    (dict(tis_cap=2.0), ValueError, r"^tis_cap needs rollout_logprobs \(the inference engine's log-probs\)"),
    (dict(tis_cap=0.0, rollout_logprobs=torch.zeros(4)), ValueError, "^tis_cap must be > 0, got 0.0"),
    (dict(tis_cap=-1.0, rollout_logprobs=torch.zeros(4)), ValueError, r"^tis_cap must be in \[0.0, inf\], got -1.0"),
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


def test_boundary_values_accepted():
    # clip_low 0 and 1, clip_high 0, a dual clip just above 1, a tiny TIS cap
    for kw in (dict(clip_low=0.0), dict(clip_low=1.0, clip_high=0.0), dict(dual_clip=1.0001),
               dict(tis_cap=1e-6, rollout_logprobs=torch.zeros(4))):
        loss, _ = _call(**kw)
        assert float(loss) == 0.0


# ---------------------------------------------------------------- fake impl and registration


def test_fake_impl():
    lp = torch.zeros(6, dtype=torch.float32)
    loss, m, g = ops_ppo._fake(lp, lp, lp, None, None, None, None, 0.2, 0.2, 1.0, 1.0, True)
    assert loss.shape == () and m.shape == (len(ops_ppo.METRICS),) and g.shape == (6,)
    assert ops_ppo._fake(lp, lp, lp, None, None, None, None, 0.2, 0.2, 1.0, 1.0, False)[2].shape == (0,)


def test_register():
    # the Triton op and (where built) the C++ op are registered with `_fake`: FakeTensorMode runs it
    from torch._subclasses.fake_tensor import FakeTensorMode

    names = [n for n in ("ppo_policy_loss_triton", "ppo_policy_loss") if hasattr(torch.ops.compactionrl_fast, n)]
    assert names[0] == "ppo_policy_loss_triton"
    with FakeTensorMode():
        lp, mask, scale = torch.zeros(6), torch.ones(6, dtype=torch.bool), torch.ones(1, dtype=torch.float64)
        for n in names:
            loss, m, g = getattr(torch.ops.compactionrl_fast, n)(lp, lp, lp, mask, None, None, scale, 0.2, 0.2, 1.0,
                                                                 1.0, True)
            assert loss.shape == () and m.shape == (len(ops_ppo.METRICS),) and g.shape == (6,)

