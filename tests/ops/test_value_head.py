"""value_head and value_head_loss: every backend vs the float64 reference (values and the gradients of
hidden, weight, bias); bf16/fp16 within 2x of PyTorch's same-dtype error; results at 1, 2 and 3 threads
(bitwise for cpp and Triton, within float32 rounding for torch's MKL gemv); the fused head + loss against
the reference composition; bad inputs.

Triton runs under the interpreter here, whose bf16 arithmetic is broken, so its tests are float32."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import losses as ref
from tests.utils import SHAPE_TABLE, packed_batch

HEAD_BACKENDS = ["torch"] + [b for b in ("cpp", "triton") if b in available(torch.device("cpu"))]
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
        if backend != "torch":
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
    out, dh, dw, db = grads(lambda h, w, b: crf.value_head(h, w, b, backend="torch"), hidden, weight, bias, g)
    rout, rdh, rdw, rdb = grads(ref.value_head, hidden.double(), weight.double(), bias.double(), g.double())
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[dtype]
    scale = (hidden.double().abs().t() @ g.double().abs())
    assert ((dw.double() - rdw).abs() <= ulp * rdw.abs() + 1e-5 * scale).all()  # one rounding to the dtype
    assert ((out.double() - rout).abs() <= 1e-5 * (hidden.double().abs() @ weight.double().abs() + 1)).all()


@pytest.mark.parametrize("backend", HEAD_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_value_head_loss_ignores_non_finite_masked_rows(backend, dtype, value):
    """A NaN/inf hidden row or return at a masked position must not reach grad_weight / grad_bias on any
    backend: the same gradients as with finite values there."""
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
