"""compactionrl_fast.ops.value_head's Python entry on the cpp and torch backends, fast: values and the
gradients of hidden, weight and bias against the float64 reference's autograd, for every dtype, with the
torch path's row chunks made small (CHUNK_ELEMS patched) so that several chunks run; rows of zero gradient
holding inf/NaN; the backend "auto" picks; value_head_loss; every argument check with its name.
Triton: tests/ops/test_value_head.py."""
import importlib

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.reference import losses as ref
from tests.ops.fast._record import RecordOps
from tests.utils import CountOps

vh = importlib.import_module("compactionrl_fast.ops.value_head")  # the package exports the function
BACKENDS = ("cpp", "torch")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# an out= slice of the wrong length is resized (with this warning) and may still get the right numbers: an error
pytestmark = pytest.mark.filterwarnings("error:An output with one or more elements was resized")


@pytest.fixture(autouse=True)
def _modest_chunk_budget(monkeypatch):
    """64 rows at H = 8 (one chunk for these tests' T = 10): a broken chunk loop then runs tens of iterations, not
    the half million of the real 4M-element budget (tests/ops/test_value_head.py uses the real one)."""
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
    """A CountOps around vh.<name>, the body of a torch-path op (a dispatch mode sees a custom op, not its body)."""
    counter, fn = CountOps(), getattr(vh, name)

    def counted(*args):
        with counter:
            return fn(*args)

    monkeypatch.setattr(vh, name, counted)
    return counter


def test_torch_path_row_chunks(monkeypatch):
    # bf16: one gemv per 3-row chunk; float32 on CPU: one gemv for the values and one for d_weight, the chunks
    # only to redo d_weight without non-finite masked rows
    monkeypatch.setattr(vh, "CHUNK_ELEMS", 3 * 8)
    for dtype, mvs in ((torch.bfloat16, (4, 4)), (torch.float32, (1, 1))):
        h, w, b = _data(dtype)
        w.requires_grad_()
        with monkeypatch.context() as m:
            fwd = _count_inside(m, "_torch_fwd")
            out = crf.value_head(h, w, b, backend="torch")
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
    out = crf.value_head(h, w, b, backend="torch")
    with monkeypatch.context() as m:
        bwd = _count_inside(m, "_torch_bwd")
        (gw,) = torch.autograd.grad(out, w, g)
    assert _mvs(bwd) == 1 + 4, bwd.ops  # the gemv, then 4 masked chunks
    torch.testing.assert_close(gw.double(), h.double().nan_to_num(0.0).T @ g.double(), rtol=1e-5, atol=1e-5)


def test_torch_backward_off_cpu_float32():
    # float32 off CPU masks rows chunk by chunk (no gemv to redo): shapes and dtypes on the meta device
    h, w, g = torch.empty(10, 8, device="meta"), torch.empty(8, device="meta"), torch.empty(10, device="meta")
    dh, dw = vh._torch_bwd(h, w, g, True, True)
    assert dh.shape == (10, 8) and dw.shape == (8,) and dh.dtype == dw.dtype == torch.float32
    dh, dw = vh._torch_bwd(h, w, g, True, False)
    assert dh.shape == (10, 8) and dw is None


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


def test_an_inf_row_with_a_gradient_gives_inf():
    h, w, _ = _data(torch.float32)
    h[4, 2] = float("inf")
    w.requires_grad_()
    (gw,) = torch.autograd.grad(crf.value_head(h, w, backend="torch"), w, torch.ones(10))
    assert gw[2] == float("inf") and torch.isfinite(gw[[0, 1, 3, 4, 5, 6, 7]]).all()


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
    assert vh._rows(3, 2) == 1 and vh._rows(3, 0) == 2 and vh._rows(3, 5) == 1
    monkeypatch.setattr(vh, "CHUNK_ELEMS", 12)
    assert vh._rows(3, 4) == 3 and vh._rows(3, 5) == 2


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


def test_cpp_op_arguments():
    h, w, b = _data(torch.bfloat16, wdtype=torch.float64)
    h = torch.randn(8, 10, dtype=torch.bfloat16).T  # not contiguous
    w.requires_grad_()
    with RecordOps() as rec:
        crf.value_head(h, w, b, backend="cpp").backward(torch.ones(10))
    (_, fa), (_, ba) = rec.calls
    assert fa[0].is_contiguous() and fa[1].dtype == torch.float32 and fa[2].shape == () and fa[2].dtype == torch.float32
    assert ba[2].dtype == torch.float32 and (ba[3], ba[4]) == (False, True)


@pytest.mark.parametrize("backend", ["cpp", "torch", "auto"])
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
    head = ["compactionrl_fast.value_head_fwd_torch.default"] if backend == "torch" or (
        backend == "auto" and dtype == torch.float32) else \
        ["compactionrl_fast.value_head_fwd.default"]  # "auto" on CPU: BLAS for float32, C++ for bf16
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


def test_triton_backend_runs_the_triton_ops():
    # routing only (float32 under the interpreter); the kernels: tests/ops/test_value_head.py
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


def test_value_head_loss_auto_and_refused_backends():
    # "auto" runs the head's own pick (C++ for bf16); a backend neither op has is refused
    h, w, b = _data(torch.bfloat16)
    mask = torch.ones(10, dtype=torch.bool)
    with RecordOps() as rec:
        crf.value_head_loss(h, w, b, torch.zeros(10), torch.zeros(10), mask, backend="auto")
    assert rec.calls[0][0] == "compactionrl_fast.value_head_fwd.default"
    with pytest.raises(ValueError, match="^backend"):
        crf.value_head_loss(h, w, b, torch.zeros(10), torch.zeros(10), mask, backend="cuda")


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
