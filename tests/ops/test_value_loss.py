"""value_loss: reference by hand and vs the common trainers' clipped value loss; every backend vs the
float64 reference (loss, gradient, metrics) on packed batches, every reduction with and without a
denominator, clipped and unclipped; fully-masked and empty batches; determinism; bad inputs. Then the Python
entry on the cpp and torch backends, fast: loss, metrics and gradient against the float64 reference (its
autograd) for every reduction, layout and clip; the arguments handed to the op; every argument check with its
name; the fake impl and the registration."""
import importlib

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import losses as ref
from tests.ops import _losses_cuda_host as host
from tests.utils import RecordOps, SHAPE_TABLE, packed_batch, random_case

# numpy warns on the inf/NaN the interpreter computes in masked-out lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
BACKENDS = [b for b in ("cpp", "triton", "cuda") if b in available(torch.device("cpu"))]
REDUCTIONS = ["token-mean", "segment-mean", "rollout-mean", "sum"]


# Above every block/thread-split threshold (see tests/ops/test_ppo_loss.py): 3 C++ blocks of 8,192 tokens,
# 22 Triton programs; segments across block boundaries.
OVER_BLOCKS = [[(9000, "rand"), (7000, "rand"), (3, "all"), (0, "rand"), (5000, "rand")], [(1200, "all")]]
THREADS = (1, 2, 3)


def value_inputs(T, seed, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    ret = torch.randn(T, generator=g) + offset
    old = ret + 0.5 * torch.randn(T, generator=g)
    return dict(values=old + 0.4 * torch.randn(T, generator=g), old_values=old, returns=ret)


def run_backend(backend, b, x, **kw):
    v = x["values"].clone().double().requires_grad_() if backend is None else x["values"].clone().requires_grad_()
    fn = ref.value_loss if backend is None else crf.value_loss
    extra = {} if backend is None else {"backend": backend}
    loss, m = fn(v, x["old_values"], x["returns"], b["loss_mask"], cu_seqlens=b["cu_seqlens"],
                 cu_segments=b["cu_segments"], **kw, **extra)
    loss.backward()
    return loss, m, v.grad


def check_against_reference(backend, b, x, **kw):
    loss, m, grad = run_backend(backend, b, x, **kw)
    rl, rm, rg = run_backend(None, b, x, **kw)
    assert loss.dtype == torch.float32 and loss.shape == () and not grad.isnan().any()
    l_tok = ref.value_token_losses(x["values"], x["old_values"], x["returns"], clip=kw.get("clip"))[0]
    w = ref.token_weights(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], kw.get("reduction", "token-mean"),
                          kw.get("denominator"))
    scale = float((w * l_tok.abs()).sum())
    assert abs(loss.item() - rl.item()) <= 2e-6 * scale + 1e-30, (backend, kw, loss.item(), rl.item())
    torch.testing.assert_close(grad.double(), rg, rtol=1e-6, atol=1e-30, msg=lambda s: f"{backend} {kw}: {s}")
    assert (grad[~b["loss_mask"]] == 0).all()
    torch.testing.assert_close(m["clip_fraction"].double(), rm["clip_fraction"], rtol=1e-6, atol=0)
    torch.testing.assert_close(m["value_mean"].double(), rm["value_mean"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["explained_variance"].double(), rm["explained_variance"], rtol=1e-5, atol=1e-6)


def test_reference_hand_computed():
    v = torch.tensor([1.0, 2.0, 0.0, 5.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.0, 2.5, 0.5, 0.0], dtype=torch.float64)
    ret = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    # clip 0.2: token 0: v_clip = 0.2, (1)^2 vs (0.2)^2 -> unclipped, grad 1; token 1: v_clip = 2.3,
    # 4 vs 5.29 -> clipped 5.29, grad 0; token 2: v_clip = 0.3, 1 vs 0.49 -> unclipped, grad -1
    loss, m = ref.value_loss(v, old, ret, mask, clip=0.2)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor((0.5 * 1 + 0.5 * 5.29 + 0.5 * 1) / 3, dtype=torch.float64))
    torch.testing.assert_close(v.grad, torch.tensor([1 / 3, 0, -1 / 3, 0], dtype=torch.float64))
    assert float(m["clip_fraction"]) == pytest.approx(1 / 3) and float(m["value_mean"]) == 1.0
    r, e = ret[:3], (ret - v.detach())[:3]
    torch.testing.assert_close(m["explained_variance"], 1 - e.var(unbiased=False) / r.var(unbiased=False))


def test_reference_matches_common_trainer_clipped_value_loss():
    """The trainers' form 0.5 * max((v-R)^2, (old + clamp(v-old) - R)^2) and token-mean / seq-mean."""
    g = torch.Generator().manual_seed(0)
    B, L = 5, 40
    mask = torch.rand(B, L, generator=g) < 0.7
    mask[:, 0] = True
    ret, old = torch.randn(B, L, generator=g, dtype=torch.float64), torch.randn(B, L, generator=g, dtype=torch.float64)
    v = old + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    v_clip = old + torch.clamp(v - old, -0.2, 0.2)
    loss_mat = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    cu = torch.arange(B + 1) * L
    tm, _ = ref.value_loss(v.flatten(), old.flatten(), ret.flatten(), mask.flatten(), clip=0.2, cu_seqlens=cu)
    sm, _ = ref.value_loss(v.flatten(), old.flatten(), ret.flatten(), mask.flatten(), clip=0.2, cu_seqlens=cu,
                           reduction="segment-mean")
    torch.testing.assert_close(tm, ref.padded_token_mean(loss_mat, mask))
    torch.testing.assert_close(sm, ref.padded_seq_mean_token_mean(loss_mat, mask))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SHAPE_TABLE))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_backend_matches_reference_shape_table(backend, case, index_dtype):
    b = packed_batch(SHAPE_TABLE[case], seed=len(case) + 1, index_dtype=index_dtype)
    x = value_inputs(b["loss_mask"].numel(), seed=len(case))
    n = int(b["loss_mask"].sum())
    for red in REDUCTIONS:  # clipped without a denominator, unclipped with one
        check_against_reference(backend, b, x, clip=0.2, reduction=red)
        if red != "sum":
            check_against_reference(backend, b, x, reduction=red, denominator=2 * n + 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_backend_matches_reference_random(backend, seed):
    b = packed_batch(random_case(seed), seed=seed, index_dtype=[torch.int32, torch.int64][seed % 2])
    x = value_inputs(b["loss_mask"].numel(), seed=seed, offset=[0.0, 100.0, -3.0][seed])  # |R| >> |v - R| too
    for red in REDUCTIONS:
        check_against_reference(backend, b, x, clip=0.3, reduction=red)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explained_variance_with_large_mean_does_not_cancel(backend):
    """Returns ~ 1000 +- 1: per-block (n, sum, M2) partials keep the variance exact in float64."""
    b = packed_batch(SHAPE_TABLE["long_multiblock"], seed=3)
    x = value_inputs(b["loss_mask"].numel(), seed=3, offset=1000.0)
    _, m, _ = run_backend(backend, b, x)
    _, rm, _ = run_backend(None, b, x)
    torch.testing.assert_close(m["explained_variance"].double(), rm["explained_variance"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m["value_mean"].double(), rm["value_mean"], rtol=1e-6, atol=0)


@pytest.mark.skipif("cpp" not in BACKENDS, reason="the cpp backend defines the op schema")
# the multi-block case is the slow one on the host (8x4 blocks); make test-all runs it
@pytest.mark.parametrize("case", ["single_token", "no_trainable",
                                  pytest.param("long_multiblock", marks=pytest.mark.slow)])
def test_cuda_kernels_on_host_match_reference(monkeypatch, cuda_host_lib, case):
    b, threads = host.host_case(monkeypatch, cuda_host_lib, case)
    x = value_inputs(b["loss_mask"].numel(), seed=len(case), offset=100.0)  # EV with a large mean
    for red in REDUCTIONS[1:3] if threads > 32 else REDUCTIONS:  # 256 host threads are slow
        check_against_reference("cpp", b, x, clip=0.2 if red != "sum" else None, reduction=red)
    check_against_reference("cpp", b, x, clip=0.1, reduction="token-mean", denominator=7)


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_fully_masked_batch_gives_zero_loss_and_gradient(backend, reduction):
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=0)
    b["loss_mask"] = torch.zeros_like(b["loss_mask"])
    x = value_inputs(b["loss_mask"].numel(), seed=0)
    if backend != "torch":  # the kernels never read masked positions into the loss (autograd would)
        x["returns"][::4] = float("inf")
    loss, m, grad = run_backend(backend, b, x, clip=0.2, reduction=reduction)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert all(v.item() == 0.0 for v in m.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_deterministic(backend):
    b = packed_batch(OVER_BLOCKS, seed=2)
    x = value_inputs(b["loss_mask"].numel(), seed=2)
    threads = torch.get_num_threads()
    runs = []
    for n_threads in THREADS:
        torch.set_num_threads(n_threads)
        runs.append(run_backend(backend, b, x, clip=0.2, reduction="rollout-mean"))
    torch.set_num_threads(threads)
    l0, m0, g0 = runs[0]
    for l1, m1, g1 in runs[1:]:
        assert torch.equal(l0, l1) and torch.equal(g0, g1) and all(torch.equal(m0[k], m1[k]) for k in m0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_over_blocks(backend):
    b = packed_batch(OVER_BLOCKS, seed=5, index_dtype=torch.int64)
    x = value_inputs(b["loss_mask"].numel(), seed=5, offset=3.0)
    for kw in (dict(clip=0.2, reduction="segment-mean"), dict(reduction="rollout-mean", denominator=99),
               dict(clip=0.1, reduction="token-mean")):
        check_against_reference(backend, b, x, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_flows_to_values_only(backend):
    b = packed_batch(SHAPE_TABLE["odd_lengths"], seed=1)
    x = {k: t.clone().requires_grad_() for k, t in value_inputs(b["loss_mask"].numel(), seed=1).items()}
    loss, _ = crf.value_loss(*x.values(), b["loss_mask"], clip=0.1, backend=backend)
    (3.0 * loss).backward()
    assert x["old_values"].grad is None and x["returns"].grad is None
    v = x["values"].detach().double().requires_grad_()
    r_loss, _ = ref.value_loss(v, x["old_values"], x["returns"], b["loss_mask"], clip=0.1)
    (3.0 * r_loss).backward()
    assert (v.grad != 0).sum() > 10 and (v.grad == 0).sum() > 10  # both branches of the clip occur
    torch.testing.assert_close(x["values"].grad.double(), v.grad, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_half_precision_gradient_within_rounding(backend):
    b = packed_batch(SHAPE_TABLE["odd_lengths"], seed=1)
    x = value_inputs(b["loss_mask"].numel(), seed=1)
    for dtype, ulp in ((torch.bfloat16, 2.0 ** -7), (torch.float16, 2.0 ** -10)):
        v = x["values"].to(dtype).requires_grad_()
        loss, _ = crf.value_loss(v, x["old_values"], x["returns"], b["loss_mask"], clip=0.1, backend=backend)
        loss.backward()
        r_v = v.detach().double().requires_grad_()
        r_loss, _ = ref.value_loss(r_v, x["old_values"], x["returns"], b["loss_mask"], clip=0.1)
        r_loss.backward()
        assert v.grad.dtype == dtype and (r_v.grad != 0).sum() > 10
        assert ((v.grad.double() - r_v.grad).abs() <= (ulp / 2 + 1e-5) * r_v.grad.abs() + torch.finfo(dtype).smallest_normal * ulp).all()  # + subnormal spacing


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_nan_old_value_on_a_trainable_token_propagates(backend):
    """With the clip, a NaN old value makes v_clip NaN: the loss is NaN on every backend (a min/max that
    drops NaN used to give a finite loss)."""
    x = value_inputs(30, seed=3)
    x["old_values"][4] = float("nan")
    loss, _ = crf.value_loss(x["values"], x["old_values"], x["returns"], torch.ones(30, dtype=torch.bool), clip=0.2,
                             backend=backend)
    assert loss.isnan()
    x = value_inputs(30, seed=3)
    x["returns"][4] = float("nan")
    loss, m = crf.value_loss(x["values"], x["old_values"], x["returns"], torch.ones(30, dtype=torch.bool), clip=0.2,
                             backend=backend)
    assert loss.isnan() and m["explained_variance"].isnan()


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("clip", [None, 0.2])
def test_non_finite_at_masked_positions_changes_nothing(backend, value, clip):
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=7)
    x = value_inputs(b["loss_mask"].numel(), seed=7)
    off = ~b["loss_mask"]
    dirty = {k: torch.where(off, value, t) for k, t in x.items()}
    out = []
    for inp in (x, dirty):
        v = inp["values"].clone().requires_grad_()
        loss, m = crf.value_loss(v, inp["old_values"], inp["returns"], b["loss_mask"], clip=clip,
                                 cu_seqlens=b["cu_seqlens"], reduction="segment-mean", backend=backend)
        loss.backward()
        out.append((loss, m, v.grad))
    (l0, m0, g0), (l1, m1, g1) = out
    assert torch.isfinite(l1) and torch.isfinite(g1).all() and (g1[off] == 0).all()
    assert torch.equal(l0, l1) and torch.equal(g0, g1) and all(torch.equal(m0[k], m1[k]) for k in m0)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda t, k: t.update(loss_mask=t["loss_mask"].float()), TypeError, "loss_mask"),
    (lambda t, k: t.update(values=t["values"].int()), TypeError, "values"),
    (lambda t, k: t.update(returns=t["returns"][1:]), ValueError, "returns"),
    (lambda t, k: t.update(old_values=None), TypeError, "old_values"),
    (lambda t, k: k.update(clip=-0.1), ValueError, "clip"),
    (lambda t, k: k.update(reduction="rollout"), ValueError, "reduction"),
    (lambda t, k: k.update(reduction="sum", denominator=2), ValueError, "denominator"),
    (lambda t, k: k.update(cu_seqlens=torch.tensor([0, 5])), ValueError, "cu_seqlens"),
    (lambda t, k: k.update(backend="cuda"), ValueError, "cuda"),
])
def test_bad_inputs_raise(mutate, exc, match):
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=0)
    t = dict(value_inputs(b["loss_mask"].numel(), seed=0), loss_mask=b["loss_mask"])
    k = dict(cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"])
    mutate(t, k)
    with pytest.raises(exc, match=match):
        crf.value_loss(t["values"], t["old_values"], t["returns"], t["loss_mask"], **k)


def test_torch_backend_wrapper_is_the_reference_with_every_argument():
    """backend="torch" hands every argument to the reference (compared with the reference called directly,
    on inputs where each argument changes the result)."""
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=3)
    x = value_inputs(b["loss_mask"].numel(), seed=3, offset=1.0)
    kw = dict(clip=0.15, cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"], reduction="rollout-mean",
              denominator=5)
    args = (x["values"], x["old_values"], x["returns"], b["loss_mask"])
    got, gm = crf.value_loss(*args, backend="torch", **kw)
    want, wm = ref.value_loss(*args, **kw)
    assert got.dtype == torch.float32 and got.item() == want.float().item()
    assert all(gm[k].item() == wm[k].float().item() for k in wm)
    for k, other in [("clip", None), ("cu_seqlens", None), ("cu_segments", None), ("reduction", "segment-mean"),
                     ("denominator", None)]:
        changed = dict(kw, **{k: other})
        if k == "cu_seqlens":
            changed.update(cu_segments=None, reduction="token-mean")
        alt, alt_m = ref.value_loss(*args, **changed)
        assert alt.item() != want.item() or any(alt_m[m].item() != wm[m].item() for m in wm), k


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_clip_tie_takes_the_unclipped_gradient(backend):
    """clip=0 with |v - R| = |old - R|: both branches equal; every backend and the reference give the
    unclipped gradient v - R (not torch.maximum's half)."""
    v = torch.tensor([101.3125, 1.0], requires_grad=True)
    loss, _ = crf.value_loss(v, torch.tensor([100.4375, 1.0]), torch.tensor([100.875, 0.0]),
                             torch.ones(2, dtype=torch.bool), clip=0.0, reduction="sum", backend=backend)
    loss.backward()
    assert v.grad.tolist() == [0.4375, 1.0]


# ---------------------------------------------------------------- a zero denominator


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_denominator_is_zero_where_float32_overflows(backend):
    """denominator=0 weights every token 0: loss and gradient are 0, also on a token whose float32 squared
    error overflows (|v - R| = 1e20: inf in float32, finite in the float64 reference); a NaN input still gives
    a NaN loss, as in the reference."""
    _check_zero_denominator(backend)


@pytest.mark.skipif("cpp" not in BACKENDS, reason="the cpp backend defines the op schema")
def test_zero_denominator_cuda_kernels_on_host(monkeypatch, cuda_host_lib):
    host.route_small_block(monkeypatch, cuda_host_lib)
    _check_zero_denominator("cpp")


def _check_zero_denominator(backend):
    v = torch.tensor([0.1, 0.2, 1e20, -0.3, 0.4])
    ret = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.2])
    mask = torch.ones(5, dtype=torch.bool)
    for den in (0.0, torch.tensor(0.0)):
        want, _ = ref.value_loss(v.double(), v, ret, mask, denominator=den)
        assert want.item() == 0.0
        x = v.clone().requires_grad_()
        loss, _ = crf.value_loss(x, v, ret, mask, denominator=den, backend=backend)
        loss.backward()
        assert loss.item() == 0.0, (backend, den, loss.item())
        assert torch.equal(x.grad, torch.zeros(5)), (backend, den, x.grad)
    v[1] = float("nan")
    loss, _ = crf.value_loss(v, v, ret, mask, denominator=0.0, backend=backend)
    assert ref.value_loss(v.double(), v, ret, mask, denominator=0.0)[0].isnan()
    assert loss.isnan(), backend


# ---------------------------------------------------------------- the Python entry on the cpp and torch backends, fast


ops_vl = importlib.import_module("compactionrl_fast.ops.value_loss")  # the package exports the function
ENTRY_BACKENDS = ("cpp", "torch")
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


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
@pytest.mark.parametrize("reduction", REDS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_reductions_match_reference(backend, reduction, clip):
    _compare(backend, _inputs(), clip=clip, reduction=reduction)


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
@pytest.mark.parametrize("kw", [
    dict(clip=0.0),
    dict(clip=0.3, reduction="segment-mean", denominator=3),
    dict(clip=1, reduction="rollout-mean", denominator=torch.tensor(2.0)),
    dict(reduction="token-mean", denominator=500.0),
])
def test_options_match_reference(backend, kw):
    _compare(backend, _inputs(seed=2), scale=-1.5, **kw)


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
def test_each_option_changes_the_loss(backend):
    inp = _inputs(seed=2)
    base, m0 = crf.value_loss(**inp, backend=backend)
    for kw in (dict(clip=0.1), dict(reduction="segment-mean"), dict(reduction="rollout-mean"), dict(reduction="sum"),
               dict(denominator=3.0)):
        assert not torch.allclose(crf.value_loss(**inp, backend=backend, **kw)[0], base), kw
    m = crf.value_loss(**inp, clip=0.1, backend=backend)[1]
    assert float(m0["clip_fraction"]) == 0.0 < float(m["clip_fraction"]) < 1.0
    assert float(m["explained_variance"]) != 0.0 and float(m["value_mean"]) != 0.0


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
@pytest.mark.parametrize("layout", ["no_segments", "no_seqlens"])
def test_layout_defaults(backend, layout):
    inp = _inputs()
    inp["cu_segments"] = None
    if layout == "no_seqlens":
        inp["cu_seqlens"] = None
    _compare(backend, inp, clip=0.2, reduction="rollout-mean" if layout == "no_segments" else "segment-mean")


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
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


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
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
    # routing only (8 tokens under the interpreter); the kernels: the tests above
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
