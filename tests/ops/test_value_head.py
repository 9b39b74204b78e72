"""value_head and value_head_loss. The Python entry on the cpp and torch backends, fast: values and the
gradients of hidden, weight and bias against the float64 reference's autograd, for every dtype, with the torch
path's row chunks made small (CHUNK_ELEMS patched) so that several chunks run; rows of zero gradient holding
inf/NaN; the backend "auto" picks; value_head_loss; every argument check with its name. Then every backend vs the
float64 reference (values and the gradients of hidden, weight, bias); bf16/fp16 within 2x of PyTorch's
same-dtype error; results at 1, 2 and 3 threads (bitwise for cpp and Triton, within float32 rounding for torch's
MKL gemv); the fused head + loss against the reference composition; bad inputs.

Triton runs under the interpreter here, whose bf16 arithmetic is broken, so its tests are float32."""
import importlib

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import losses as ref
from tests.utils import RecordOps, SHAPE_TABLE, packed_batch

vh = importlib.import_module("compactionrl_fast.ops.value_head")  # the package exports the function
BACKENDS = ("cpp", "torch-tuned")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# an out= slice of the wrong length is resized (with this warning) and may still get the right numbers: an error
pytestmark = pytest.mark.filterwarnings("error:An output with one or more elements was resized")


@pytest.fixture
def _modest_chunk_budget(monkeypatch):
    """64 rows at H = 8 (one chunk for these tests' T = 10): a broken chunk loop then runs tens of iterations, not
    the half million of the real 4M-element budget (the tests of every backend, below, use the real one)."""
    monkeypatch.setattr(vh, "CHUNK_ELEMS", 64 * 8)


@pytest.fixture(params=["chunks", "one_chunk"])
def chunks(request, monkeypatch):
    """The torch path in one row chunk, or in chunks of 3 rows (T = 10: the last one short)."""
    if request.param == "chunks":
        monkeypatch.setattr(vh, "CHUNK_ELEMS", 3 * 8)
    return request.param


def _data(dtype, T=10, H=8, seed=0, wdtype=None, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(H, generator=g).to(wdtype or dtype)
    b = torch.randn(1, generator=g).to(wdtype or dtype) if bias else None
    return h, w, b


def _grads(out, inputs, g):
    need = [x for x in inputs if x is not None and x.requires_grad]
    return torch.autograd.grad(out, need, g)


def _mvs(count):
    return count.ops["aten.mv.default"] + count.ops["aten.mv.out"]


def _count_inside(monkeypatch, name):
    """A RecordOps around vh.<name>, the body of a torch-path op (a dispatch mode sees a custom op, not its body)."""
    counter, fn = RecordOps(), getattr(vh, name)

    def counted(*args):
        with counter:
            return fn(*args)

    monkeypatch.setattr(vh, name, counted)
    return counter


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_torch_path_row_chunks(monkeypatch):
    # bf16: one gemv per 3-row chunk; float32 on CPU: one gemv for the values and one for d_weight, the chunks
    # only to redo d_weight without non-finite masked rows
    monkeypatch.setattr(vh, "CHUNK_ELEMS", 3 * 8)
    for dtype, mvs in ((torch.bfloat16, (4, 4)), (torch.float32, (1, 1))):
        h, w, b = _data(dtype)
        w.requires_grad_()
        with monkeypatch.context() as m:
            fwd = _count_inside(m, "_torch_fwd")
            out = crf.value_head(h, w, b, backend="torch-tuned")
        g = torch.linspace(-1, 2, 10)
        with monkeypatch.context() as m:
            bwd = _count_inside(m, "_torch_bwd")
            (gw,) = torch.autograd.grad(out, w, g)
        assert (_mvs(fwd), _mvs(bwd)) == mvs, (fwd.ops, bwd.ops)
        want = ref.value_head(h, w, b)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw.double(), h.double().T @ g.double(), rtol=TOL[dtype], atol=TOL[dtype])
    h[4, 2] = float("nan")
    g[4] = 0.0
    out = crf.value_head(h, w, b, backend="torch-tuned")
    with monkeypatch.context() as m:
        bwd = _count_inside(m, "_torch_bwd")
        (gw,) = torch.autograd.grad(out, w, g)
    assert _mvs(bwd) == 1 + 4, bwd.ops  # the gemv, then 4 masked chunks
    torch.testing.assert_close(gw.double(), h.double().nan_to_num(0.0).T @ g.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_torch_backward_off_cpu_float32():
    # float32 off CPU masks rows chunk by chunk (no gemv to redo): shapes and dtypes on the meta device
    h, w, g = torch.empty(10, 8, device="meta"), torch.empty(8, device="meta"), torch.empty(10, device="meta")
    dh, dw = vh._torch_bwd(h, w, g, True, True)
    assert dh.shape == (10, 8) and dw.shape == (8,) and dh.dtype == dw.dtype == torch.float32
    dh, dw = vh._torch_bwd(h, w, g, True, False)
    assert dh.shape == (10, 8) and dw is None


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference(chunks, backend, dtype, bias):
    h, w, b = _data(dtype, bias=bias)
    for x in (h, w, b):
        if x is not None:
            x.requires_grad_()
    out = crf.value_head(h, w, b, backend=backend)
    assert out.dtype == torch.float32 and out.shape == (10,)
    want = ref.value_head(h, w, b)
    torch.testing.assert_close(out.double(), want, rtol=TOL[torch.float32], atol=1e-5)
    g = torch.linspace(-1, 2, 10)
    g[3] = 0.0
    got = _grads(out, (h, w, b), g)
    exp = _grads(want, (h, w, b), g.double())
    for x, gx, ex in zip([x for x in (h, w, b) if x is not None], got, exp):
        assert gx.dtype == x.dtype and gx.shape == x.shape
        torch.testing.assert_close(gx.double(), ex.double(), rtol=TOL[x.dtype], atol=TOL[x.dtype])


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("need", ["h", "w", "b", "hw"])
def test_only_the_needed_gradients(chunks, backend, need):
    h, w, b = _data(torch.bfloat16)
    h.requires_grad_("h" in need)
    w.requires_grad_("w" in need)
    b.requires_grad_("b" in need)
    out = crf.value_head(h, w, b, backend=backend)
    g = torch.randn(10)
    got = _grads(out, (h, w, b), g)
    exp = _grads(ref.value_head(h, w, b), (h, w, b), g.double())
    assert len(got) == len(need)
    for gx, ex in zip(got, exp):
        torch.testing.assert_close(gx.double(), ex.double(), rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_float64_and_linear_weights(backend, dtype):
    # an nn.Linear(H, 1) weight [1, H] and a [1] bias in float64: gradients come back in those dtypes/shapes
    h, _, _ = _data(dtype)
    w = torch.randn(1, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, dtype=torch.float64, requires_grad=True)
    out = crf.value_head(h, w, b, backend=backend)
    want = ref.value_head(h, w.reshape(-1), b)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    gw, gb = torch.autograd.grad(out, (w, b), torch.ones(10))
    ew, eb = torch.autograd.grad(want, (w, b), torch.ones(10, dtype=torch.float64))
    assert gw.dtype == torch.float64 and gw.shape == (1, 8) and gb.shape == (1,)
    torch.testing.assert_close(gw, ew, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(gb, eb)


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_zero_gradient_may_hold_inf_and_nan(chunks, backend, dtype):
    h, w, b = _data(dtype)
    h[2, 1], h[7, 4], h[8, 0] = float("inf"), float("nan"), -float("inf")
    w.requires_grad_()
    mask = torch.ones(10, dtype=torch.bool)
    mask[[2, 7, 8]] = False
    g = torch.where(mask, torch.randn(10), 0.0)
    (gw,) = torch.autograd.grad(crf.value_head(h, w, b, backend=backend), w, g)
    want = (h.double() * mask[:, None]).nan_to_num(0.0, 0.0, 0.0).T @ g.double()
    torch.testing.assert_close(gw.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("backend", BACKENDS + tuple(b for b in ("triton",) if b in available(torch.device("cpu"))))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_rows_of_zero_gradient_get_zero_d_hidden_whatever_the_weight(chunks, backend, dtype, value):
    """A NaN/inf in the weight: a row of zero gradient (a masked token) gets d_hidden exactly 0, not 0 * w (NaN);
    the other rows g * w (issue 55)."""
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("the interpreter's bf16 is broken")
    h, w, b = _data(dtype)
    w[3] = value
    h.requires_grad_()
    g = torch.randn(10)
    g[[2, 7, 8]] = 0.0
    (dh,) = torch.autograd.grad(crf.value_head(h, w, b, backend=backend), h, g)
    want = torch.where((g != 0)[:, None], g[:, None].double() * w.double(), 0.0)
    torch.testing.assert_close(dh.double(), want, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)
    assert (dh[[2, 7, 8]] == 0).all()


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_an_inf_row_with_a_gradient_gives_inf():
    h, w, _ = _data(torch.float32)
    h[4, 2] = float("inf")
    w.requires_grad_()
    (gw,) = torch.autograd.grad(crf.value_head(h, w, backend="torch-tuned"), w, torch.ones(10))
    assert gw[2] == float("inf") and torch.isfinite(gw[[0, 1, 3, 4, 5, 6, 7]]).all()


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_torch_backward_pieces():
    # direct: d_hidden in hidden's dtype, d_weight float32, rows with g = 0 skipped, None where not needed
    h = torch.tensor([[1.0, 2.0], [float("nan"), 3.0], [4.0, -1.0]], dtype=torch.bfloat16)
    w = torch.tensor([0.5, -2.0])
    g = torch.tensor([1.0, 0.0, 2.0])
    dh, dw = vh._torch_bwd(h, w, g, True, True)
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert dh.float().tolist() == [[0.5, -2.0], [0.0, -0.0], [1.0, -4.0]]
    assert dw.tolist() == [9.0, 0.0]
    assert vh._torch_bwd(h, w, g, False, True)[0] is None and vh._torch_bwd(h, w, g, True, False)[1] is None
    h32 = h.float()
    dh, dw = vh._torch_bwd(h32, w, g, True, True)
    assert dh.tolist() == [[0.5, -2.0], [0.0, -0.0], [1.0, -4.0]] and dw.tolist() == [9.0, 0.0]
    assert vh._torch_bwd(h32, w, g, False, True)[0] is None and vh._torch_bwd(h32, w, g, True, False)[1] is None
    assert vh._masked_rows(h32, g)[1].tolist() == [0.0, 0.0]


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_torch_forward_pieces(monkeypatch):
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)
    w = torch.tensor([1.0, -1.0])
    monkeypatch.setattr(vh, "CHUNK_ELEMS", 2)  # one row per chunk
    real_empty = torch.empty

    def nan_empty(*a, **k):  # float outputs start as NaN: an element no chunk writes fails
        t = real_empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    assert vh._torch_fwd(h, w, None).tolist() == [-1.0, -1.0, -1.0]
    assert vh._torch_fwd(h, w, torch.tensor(0.5)).tolist() == [-0.5, -0.5, -0.5]
    assert vh._torch_fwd(h.float(), w, torch.tensor(0.5)).tolist() == [-0.5, -0.5, -0.5]
    assert vh._rows(2) == 1 and vh._rows(0) == 2 and vh._rows(5) == 1
    monkeypatch.setattr(vh, "CHUNK_ELEMS", 12)
    assert vh._rows(4) == 3 and vh._rows(5) == 2


@pytest.mark.parametrize("bwd", ["value_head_bwd", "value_head_bwd_torch"])
def test_the_registered_backward_formula(bwd):
    """The autograd formula each fwd op is registered with (built once at import): d hidden and d weight from
    the backend's bwd op, d bias = sum(grad), None where an input needs no gradient."""
    from types import SimpleNamespace

    if bwd == "value_head_bwd" and "cpp" not in available(torch.device("cpu")):
        pytest.skip("the C++ extension is not built")
    g64 = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 4, generator=g64), torch.randn(4, generator=g64)
    grad = torch.randn(6, generator=g64)
    backward = vh._backward_of(bwd)
    for need in [(True, True, True), (False, True, False), (True, False, True), (False, False, False)]:
        ctx = SimpleNamespace(saved_tensors=(h, w), needs_input_grad=need)
        dh, dw, db = backward(ctx, grad.double())  # a float64 grad is taken as float32
        want = (torch.outer(grad, w), h.t() @ grad, grad.sum())
        for got, n, exp in zip((dh, dw, db), need, want):
            assert got is None if not n else torch.allclose(got, exp, rtol=1e-6, atol=1e-6)


def test_bwd_ops_return_empty_gradients_not_asked_for():
    h, w, g = torch.ones(3, 2, dtype=torch.bfloat16), torch.ones(2), torch.ones(3)
    for bwd in ("value_head_bwd_torch",) + (("value_head_bwd",) if "cpp" in available(torch.device("cpu")) else ()):
        op = getattr(torch.ops.compactionrl_fast, bwd)
        dh, dw = op(h, w, g, False, False)
        assert dh.shape == dw.shape == (0,)
        dh, dw = op(h, w, g, True, False)
        assert dh.shape == (3, 2) and dw.shape == (0,)
        dh, dw = op(h, w, g, False, True)
        assert dh.shape == (0,) and dw.shape == (2,) and dw.dtype == torch.float32


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_torch_path_keeps_float32_under_a_float64_default():
    """The torch path's buffers are float32 whatever torch's default dtype (users set float64)."""
    h = torch.tensor([[1.0, 2.0], [float("inf"), 3.0], [4.0, -1.0]])
    w, g = torch.tensor([0.5, -2.0]), torch.tensor([1.0, 0.0, 2.0])
    want = [vh._torch_fwd(h.bfloat16(), w, None), *vh._torch_bwd(h.bfloat16(), w, g, True, True),
            *vh._torch_bwd(h, w, g, True, True)]  # float32 with an inf row of zero gradient: the masked redo
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = [vh._torch_fwd(h.bfloat16(), w, None), *vh._torch_bwd(h.bfloat16(), w, g, True, True),
               *vh._torch_bwd(h, w, g, True, True)]
    finally:
        torch.set_default_dtype(old)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert want[2].dtype == want[4].dtype == torch.float32 and want[4].tolist() == [9.0, 0.0]


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_off_cpu_allocates_there_and_leaves_hidden_alone(dtype):
    """Off the CPU (meta tensors stand in for a GPU) the buffers are made on hidden's device, and the masked
    upcast of d_weight never writes into the caller's hidden (a float32 hidden's .float() is hidden itself)."""
    h = torch.empty(5, 3, dtype=dtype, device="meta")
    w, g = torch.empty(3, device="meta"), torch.empty(5, device="meta")
    v0 = h._version
    out = vh._torch_fwd(h, w, None)
    dh, dw = vh._torch_bwd(h, w, g, True, True)
    assert out.device.type == dh.device.type == dw.device.type == "meta"
    assert out.dtype == dw.dtype == torch.float32 and dh.dtype == dtype and h._version == v0


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("dtype, want", [(torch.float32, None), (torch.bfloat16, "value_head_fwd"),
                                         (torch.float16, "value_head_fwd")])
def test_auto_backend_on_cpu(dtype, want):
    # float32: BLAS gemv (torch); half precision: the C++ loop
    h, w, b = _data(dtype)
    w.requires_grad_()
    with RecordOps() as rec:
        out = crf.value_head(h, w, b)
        out.backward(torch.ones(10))
    names = [f for f, _ in rec.calls]
    if want is None:  # the torch pair
        assert names == ["compactionrl_fast.value_head_fwd_torch.default", "compactionrl_fast.value_head_bwd_torch.default"]
    else:
        assert names == ["compactionrl_fast.value_head_fwd.default", "compactionrl_fast.value_head_bwd.default"]
    with RecordOps() as rec:
        crf.value_head(h, w, b, backend="cpp")
    assert [f for f, _ in rec.calls] == ["compactionrl_fast.value_head_fwd.default"]


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_cpp_op_arguments():
    h, w, b = _data(torch.bfloat16, wdtype=torch.float64)
    h = torch.randn(8, 10, dtype=torch.bfloat16).T  # not contiguous
    w.requires_grad_()
    with RecordOps() as rec:
        crf.value_head(h, w, b, backend="cpp").backward(torch.ones(10))
    (_, fa), (_, ba) = rec.calls
    assert fa[0].is_contiguous() and fa[1].dtype == torch.float32 and fa[2].shape == () and fa[2].dtype == torch.float32
    assert ba[2].dtype == torch.float32 and (ba[3], ba[4]) == (False, True)


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("backend", ["cpp", "torch-tuned", "torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_value_head_loss(backend, dtype):
    h, w, b = _data(dtype)
    for x in (h, w, b):
        x.requires_grad_()
    old, ret = torch.randn(10), torch.randn(10)
    mask = torch.rand(10) < 0.7
    kw = dict(clip=0.3, reduction="sum")
    if backend != "auto":
        kw["backend"] = backend
    with RecordOps() as rec:
        loss, m = crf.value_head_loss(h, w, b, old, ret, mask, **kw)
    names = [f for f, _ in rec.calls]
    # "auto" on CPU: BLAS for float32, C++ for bf16; "torch": the reference head and loss, no custom op
    tuned = backend == "torch-tuned" or (backend == "auto" and dtype == torch.float32)
    head = [] if backend == "torch" else ["compactionrl_fast.value_head_fwd_torch.default"] if tuned else \
        ["compactionrl_fast.value_head_fwd.default"]
    loss_ops = [] if backend == "torch" else ["compactionrl_fast.segment_weights.default",
                                              "compactionrl_fast.value_loss.default"]
    assert names == head + loss_ops
    want, m_r = ref.value_loss(ref.value_head(h, w, b), old, ret, mask, **{k: v for k, v in kw.items()
                                                                          if k != "backend"})
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m["value_mean"].double(), m_r["value_mean"], rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(loss, (h, w, b))
    exp = torch.autograd.grad(want, (h, w, b))
    for gx, ex in zip(got, exp):
        torch.testing.assert_close(gx.double(), ex.double(), rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_triton_backend_runs_the_triton_ops():
    # routing only (float32 under the interpreter); the kernels: the tests below
    pytest.importorskip("triton")
    h, w, b = _data(torch.float32)
    for needs in ("hwb", "w", "h"):
        for x, k in ((h, "h"), (w, "w"), (b, "b")):
            x.requires_grad_(k in needs)
        with RecordOps() as rec:
            out = crf.value_head(h, w, b, backend="triton")
            g = torch.linspace(-1, 1, 10)
            got = _grads(out, (h, w, b), g)
        assert [f for f, _ in rec.calls] == ["compactionrl_fast.value_head_fwd_triton.default",
                                             "compactionrl_fast.value_head_bwd_triton.default"]
        want = ref.value_head(h, w, b)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        for gx, ex in zip(got, _grads(want, (h, w, b), g.double())):
            torch.testing.assert_close(gx.double(), ex.double(), rtol=1e-5, atol=1e-5)
    with RecordOps() as rec:
        crf.value_head_loss(h, w, b, torch.zeros(10), torch.zeros(10), torch.ones(10, dtype=torch.bool),
                            backend="triton")
    assert [f for f, _ in rec.calls][0] == "compactionrl_fast.value_head_fwd_triton.default"


@pytest.mark.usefixtures("_modest_chunk_budget")
def test_value_head_loss_auto_and_refused_backends():
    # "auto" runs the head's own pick (C++ for bf16); a backend neither op has is refused
    h, w, b = _data(torch.bfloat16)
    mask = torch.ones(10, dtype=torch.bool)
    with RecordOps() as rec:
        crf.value_head_loss(h, w, b, torch.zeros(10), torch.zeros(10), mask, backend="auto")
    assert rec.calls[0][0] == "compactionrl_fast.value_head_fwd.default"
    with pytest.raises(ValueError, match="^backend"):
        crf.value_head_loss(h, w, b, torch.zeros(10), torch.zeros(10), mask, backend="cuda")


@pytest.mark.usefixtures("_modest_chunk_budget")
@pytest.mark.parametrize("args, err, match", [
    ((torch.zeros(4, 3, dtype=torch.float64), torch.zeros(3)), TypeError, "^hidden"),
    ((torch.zeros(4), torch.zeros(4)), ValueError, "^hidden"),
    ((torch.zeros(4, 3), torch.zeros(3, dtype=torch.int32)), TypeError, "^weight"),
    ((torch.zeros(4, 3), torch.zeros(4)), ValueError, "^weight"),
    ((torch.zeros(4, 3), torch.zeros(2, 3)), ValueError, "^weight"),
    ((torch.zeros(4, 3), torch.zeros(3, 1)), ValueError, "^weight"),
    ((torch.zeros(4, 3), torch.zeros(3, device="meta")), ValueError, "^weight"),
    ((torch.zeros(4, 3), torch.zeros(3), torch.zeros(2)), ValueError, "^bias"),
    ((torch.zeros(4, 3), torch.zeros(3), torch.zeros(1, dtype=torch.int64)), TypeError, "^bias"),
    ((torch.zeros(4, 3), torch.zeros(3), torch.zeros(1, device="meta")), ValueError, "^bias"),
    ((torch.zeros(4, 3), torch.zeros(3), None, "fast"), ValueError, "^backend"),
])
def test_refused_naming_the_argument(args, err, match):
    *a, backend = args if len(args) == 4 else (*args, "auto")
    with pytest.raises(err, match=match):
        crf.value_head(*a, backend=backend)


# ---------------------------------------------------------------- every backend against the float64 reference


HEAD_BACKENDS = ["torch-tuned", "torch"] + [b for b in ("cpp", "triton") if b in available(torch.device("cpu"))]
SHAPES = [(1, 1), (7, 33), (100, 129), (257, 300)]  # odd T and H, several blocks in both


def head_inputs(T, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(H, generator=g) / H ** 0.5).to(dtype)
    return hidden, weight, torch.randn((), generator=g).to(dtype), torch.randn(T, generator=g)


def grads(fn, hidden, weight, bias, g):
    hidden, weight, bias = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    out = fn(hidden, weight, bias)
    out.backward(g.to(out.dtype))
    return out.detach(), hidden.grad, weight.grad, bias.grad


@pytest.mark.parametrize("backend", HEAD_BACKENDS)
@pytest.mark.parametrize("T,H", SHAPES)
def test_value_head_matches_reference_fp32(backend, T, H):
    hidden, weight, bias, g = head_inputs(T, H, torch.float32)
    out, dh, dw, db = grads(lambda h, w, b: crf.value_head(h, w, b, backend=backend), hidden, weight, bias, g)
    rout, rdh, rdw, rdb = grads(ref.value_head, hidden.double(), weight.double(), bias.double(), g.double())
    assert out.dtype == torch.float32 and dh.dtype == dw.dtype == db.dtype == torch.float32
    # float32 dot products of length H: error ~ sqrt(H) ulp of sum |h w|
    tol = lambda a: 1e-6 * max(H, T) ** 0.5 * a  # noqa: E731
    assert ((out.double() - rout).abs() <= tol((hidden.abs() @ weight.abs()).double() + bias.abs())).all()
    assert ((dh.double() - rdh).abs() <= 1e-7 * rdh.abs() + 1e-30).all()
    assert ((dw.double() - rdw).abs() <= tol((hidden.abs().t() @ g.abs()).double())).all()
    torch.testing.assert_close(db.double(), rdb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [b for b in HEAD_BACKENDS if b != "triton"])  # interpreter bf16 is broken
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_value_head_low_precision_within_2x_of_pytorch(backend, dtype):
    """bf16/fp16 hidden and weight: our error vs float64 at most 2x that of PyTorch's same-dtype matmul."""
    T, H = 300, 1024
    hidden, weight, bias, g = head_inputs(T, H, dtype, seed=1)
    rout, rdh, rdw, _ = grads(ref.value_head, hidden.double(), weight.double(), bias.double(), g.double())
    out, dh, dw, _ = grads(lambda h, w, b: crf.value_head(h, w, b, backend=backend), hidden, weight, bias, g)
    pout, pdh, pdw, _ = grads(lambda h, w, b: h @ w + b, hidden, weight, bias, g)
    assert out.dtype == torch.float32 and dh.dtype == dtype and dw.dtype == dtype
    err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    assert err(out, rout) <= 2 * err(pout, rout)
    assert err(dh, rdh) <= 2 * err(pdh, rdh) + 1e-30
    assert err(dw, rdw) <= 2 * err(pdw, rdw)
    assert err(out, rout) < 1e-4 * rout.abs().max().item()  # float32 accumulation, not a bf16 result


@pytest.mark.slow
@pytest.mark.parametrize("backend", HEAD_BACKENDS)
def test_value_head_deterministic_across_thread_counts(backend):
    """cpp and Triton fix the order of every reduction: bitwise equal at 1, 2 and 3 threads. The torch
    backend's products are MKL's gemv, which splits its sums by the threads it gets and picks kernels by
    instruction set: there only d_hidden (one rounded product per element) is bitwise, and the sums agree
    within the float32 accuracy bound of test_value_head_matches_reference_fp32 (~sqrt(n) ulps of the sum of
    |terms|; measured here: <= 1e-7 of it, the bound is 4.5e-5)."""
    # T = 2000: 7 row groups of the C++ backward (>= 256 rows each), 63 Triton row blocks
    T, H = 2000, 130
    hidden, weight, bias, g = head_inputs(T, H, torch.float32, seed=2)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(grads(lambda h, w, b: crf.value_head(h, w, b, backend=backend), hidden, weight, bias, g))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        if backend not in ("torch-tuned", "torch"):  # MKL's matmuls round by thread count
            assert all(torch.equal(x, y) for x, y in zip(runs[0], other))
            continue
        (out, dh, dw, db), (out2, dh2, dw2, db2) = runs[0], other
        tol = 1e-6 * max(H, T) ** 0.5
        assert torch.equal(dh, dh2)
        assert ((out - out2).abs() <= tol * (hidden.abs() @ weight.abs() + bias.abs())).all()
        assert ((dw - dw2).abs() <= tol * (hidden.abs().t() @ g.abs())).all()
        assert (db - db2).abs() <= tol * g.abs().sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_value_head_torch_path_over_many_chunks(monkeypatch, dtype):
    """The torch path upcasts bf16/fp16 in row chunks of CHUNK_ELEMS elements (4M by default): with a small
    chunk the batch spans 9 chunks, and every chunk's d_weight must be summed (not only the last's)."""
    import importlib

    vh = importlib.import_module("compactionrl_fast.ops.value_head")

    monkeypatch.setattr(vh, "CHUNK_ELEMS", 64 * 40)  # 40 rows per chunk at H = 64
    T, H = 350, 64
    hidden, weight, bias, g = head_inputs(T, H, dtype, seed=6)
    out, dh, dw, db = grads(lambda h, w, b: crf.value_head(h, w, b, backend="torch-tuned"), hidden, weight, bias, g)
    rout, rdh, rdw, rdb = grads(ref.value_head, hidden.double(), weight.double(), bias.double(), g.double())
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[dtype]
    scale = (hidden.double().abs().t() @ g.double().abs())
    assert ((dw.double() - rdw).abs() <= ulp * rdw.abs() + 1e-5 * scale).all()  # one rounding to the dtype
    assert ((out.double() - rout).abs() <= 1e-5 * (hidden.double().abs() @ weight.double().abs() + 1)).all()


@pytest.mark.parametrize("backend", [b for b in HEAD_BACKENDS if b != "torch"])  # the reference is plain autograd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_value_head_loss_ignores_non_finite_masked_rows(backend, dtype, value):
    """A NaN/inf hidden row or return at a masked position must not reach grad_weight / grad_bias on any
    backend but the reference: the same gradients as with finite values there."""
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("the interpreter's bf16 is broken")
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=4)
    T, H = b["loss_mask"].numel(), 24
    hidden, weight, bias, _ = head_inputs(T, H, dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    ret, old = torch.randn(T, generator=g), torch.randn(T, generator=g)
    off = ~b["loss_mask"]
    out = []
    for dirty in (False, True):
        h = torch.where(off[:, None], value, hidden).to(dtype) if dirty else hidden
        r = torch.where(off, value, ret) if dirty else ret
        h, w, bb = (t.detach().clone().requires_grad_() for t in (h, weight, bias))
        loss, _ = crf.value_head_loss(h, w, bb, old, r, b["loss_mask"], clip=0.3, cu_seqlens=b["cu_seqlens"],
                                      reduction="segment-mean", backend=backend)
        loss.backward()
        out.append((loss, h.grad, w.grad, bb.grad))
    (l0, dh0, dw0, db0), (l1, dh1, dw1, db1) = out
    assert torch.isfinite(dw1).all() and torch.isfinite(db1).all() and torch.isfinite(dh1).all()
    assert torch.equal(l0, l1) and torch.equal(dw0, dw1) and torch.equal(db0, db1) and torch.equal(dh0, dh1)


def test_value_head_accepts_linear_weight_and_no_bias():
    hidden, weight, _, _ = head_inputs(5, 8, torch.float32)
    lin = torch.nn.Linear(8, 1)
    out = crf.value_head(hidden, lin.weight, lin.bias)
    torch.testing.assert_close(out, lin(hidden).squeeze(-1))
    out.sum().backward()
    assert lin.weight.grad.shape == (1, 8) and lin.bias.grad.shape == (1,)
    torch.testing.assert_close(crf.value_head(hidden, weight), hidden @ weight)


@pytest.mark.parametrize("backend", ["auto"] + HEAD_BACKENDS)
@pytest.mark.parametrize("reduction", ["token-mean", "segment-mean"])
def test_value_head_loss_matches_reference_composition(backend, reduction):
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=4)
    T, H = b["loss_mask"].numel(), 48
    hidden, weight, bias, _ = head_inputs(T, H, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    ret, old = torch.randn(T, generator=g), torch.randn(T, generator=g)
    kw = dict(clip=0.3, cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"], reduction=reduction)

    def ours(h, w, bb):
        loss, m = crf.value_head_loss(h, w, bb, old, ret, b["loss_mask"], backend=backend, **kw)
        return loss

    def theirs(h, w, bb):
        loss, m = ref.value_loss(ref.value_head(h, w, bb), old, ret, b["loss_mask"], **kw)
        return loss

    loss, dh, dw, db = grads(ours, hidden, weight, bias, torch.tensor(1.0))
    rl, rdh, rdw, rdb = grads(theirs, hidden.double(), weight.double(), bias.double(), torch.tensor(1.0))
    torch.testing.assert_close(loss.double(), rl, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dh.double(), rdh, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(db.double(), rdb, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(hidden=a["hidden"].int()), TypeError, "hidden"),
    (lambda a: a.update(hidden=a["hidden"][0]), ValueError, "hidden"),
    (lambda a: a.update(weight=a["weight"][:-1]), ValueError, "weight"),
    (lambda a: a.update(weight=a["weight"].to("meta")), ValueError, "weight"),
    (lambda a: a.update(bias=torch.zeros(2)), ValueError, "bias"),
    (lambda a: a.update(backend="cuda"), ValueError, "cuda"),
])
def test_value_head_bad_inputs_raise(mutate, exc, match):
    hidden, weight, bias, _ = head_inputs(4, 6, torch.float32)
    a = dict(hidden=hidden, weight=weight, bias=bias, backend="auto")
    mutate(a)
    with pytest.raises(exc, match=match):
        crf.value_head(a["hidden"], a["weight"], a["bias"], backend=a["backend"])
