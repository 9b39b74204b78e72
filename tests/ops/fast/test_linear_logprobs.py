"""compactionrl_fast.ops.linear_logprobs on the torch backend (the CPU chunk loop), fast: log-probs, entropy
and the gradients of hidden, weight and bias against the float64 reference's autograd for every dtype,
chunking (one chunk, several, a short last one), temperature, bias and subset of needed gradients; the
fused `linear_logprobs_loss`; exactness at large logits and finiteness at tiny temperatures; every argument
check with its name. Triton (CUDA, or float32 under the interpreter): tests/ops/test_linear_logprobs.py."""
import importlib
import types

import pytest
import torch

import compactionrl_fast as crf
from tests.utils import CountOps

ll = importlib.import_module("compactionrl_fast.ops.linear_logprobs")  # the packages export the functions
loop = importlib.import_module("compactionrl_fast.ops._linear_logprobs_loop")
ref = importlib.import_module("compactionrl_fast.reference.linear_logprobs")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2, torch.float16: 8e-3}
# a chunk buffer of the wrong shape would be resized by an out= op (with this warning) and still give the right
# numbers: make it an error
pytestmark = pytest.mark.filterwarnings("error:An output with one or more elements was resized")


@pytest.fixture
def triton_launches():
    """{kernel name: launches} of the Triton kernels during the test (see `_no_triton_kernels`)."""
    return {}


@pytest.fixture(autouse=True)
def _no_triton_kernels(request, monkeypatch):
    """The torch path must not launch the Triton kernels; tests that ask for `triton_launches` count them."""
    try:
        from compactionrl_fast.kernels import linear_logprobs as klp
    except ImportError:  # no triton: nothing to guard
        return
    launches = request.getfixturevalue("triton_launches") if "triton_launches" in request.fixturenames else None
    for name in ("linear_logprobs_stats", "linear_logprobs_dlogits"):
        real = getattr(klp, name)

        def wrapped(*a, _real=real, _name=name, **k):
            if launches is None:
                raise AssertionError("a Triton kernel ran on the torch path")
            launches[_name] = launches.get(_name, 0) + 1
            return _real(*a, **k)

        monkeypatch.setattr(klp, name, wrapped)


def _data(dtype=torch.float32, T=7, H=6, V=11, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) * 0.7).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.7).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    y = torch.randint(0, V, (T,), generator=g)
    return h, w, b, y


def _leaves(*xs):
    return [x for x in xs if x is not None and x.requires_grad]


def _check_grads(got_out, want_out, leaves, seed=1):
    """d (sum_i g_i * out_i) / d leaves of both, with the same random upstream g per output."""
    gen = torch.Generator().manual_seed(seed)
    gs = [torch.randn(o.shape, generator=gen) for o in got_out]
    got = torch.autograd.grad(got_out, leaves, gs)
    want = torch.autograd.grad(want_out, leaves, [g.double() for g in gs])
    for x, gx, wx in zip(leaves, got, want):
        assert gx.dtype == x.dtype and gx.shape == x.shape
        torch.testing.assert_close(gx.double(), wx.double(), rtol=TOL[x.dtype], atol=TOL[x.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 4, 100])
@pytest.mark.parametrize("entropy", [False, True])
def test_matches_reference(dtype, chunk_size, entropy):
    h, w, b, y = _data(dtype)
    for x in (h, w, b):
        x.requires_grad_()
    out = crf.linear_logprobs(h, w, y, bias=b, temperature=0.8, chunk_size=chunk_size, return_entropy=entropy,
                              backend="torch")
    want = ref.linear_logprobs(h, w, y, bias=b, temperature=0.8, return_entropy=entropy)
    out, want = (out, want) if entropy else ((out,), (want,))
    for o, r in zip(out, want):
        assert o.dtype == torch.float32 and o.shape == (7,)
        torch.testing.assert_close(o.double(), r.detach(), rtol=TOL[dtype], atol=TOL[dtype])
    _check_grads(out, want, [h, w, b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("used", ["logp", "entropy"])
@pytest.mark.parametrize("chunk_size", [2, 100])
def test_one_output_used(dtype, used, chunk_size):
    # the other output gets no gradient (None upstream): the backward must not need it
    h, w, b, y = _data(dtype)
    for x in (h, w, b):
        x.requires_grad_()
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, temperature=1.3, chunk_size=chunk_size, return_entropy=True)
    r_lp, r_ent = ref.linear_logprobs(h, w, y, bias=b, temperature=1.3, return_entropy=True)
    _check_grads([lp if used == "logp" else ent], [r_lp if used == "logp" else r_ent], [h, w, b])


@pytest.mark.parametrize("needs", ["h", "w", "b", "wb"])
@pytest.mark.parametrize("chunk_size", [3, 100])
def test_only_the_needed_gradients(needs, chunk_size):
    h, w, b, y = _data(torch.bfloat16)
    h.requires_grad_("h" in needs)
    w.requires_grad_("w" in needs)
    b.requires_grad_("b" in needs)
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, chunk_size=chunk_size, return_entropy=True)
    r_lp, r_ent = ref.linear_logprobs(h, w, y, bias=b, return_entropy=True)
    _check_grads([lp, ent], [r_lp, r_ent], _leaves(h, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [3, 4])
def test_no_bias_with_temperature(dtype, chunk_size):
    h, w, _, y = _data(dtype, bias=False)
    for x in (h, w):
        x.requires_grad_()
    out = crf.linear_logprobs(h, w, y, temperature=0.6, chunk_size=chunk_size, return_entropy=True)
    want = ref.linear_logprobs(h, w, y, temperature=0.6, return_entropy=True)
    for o, r in zip(out, want):
        torch.testing.assert_close(o.double(), r.detach(), rtol=TOL[dtype], atol=TOL[dtype])
    _check_grads(out, want, [h, w])


def test_op_outputs():
    # the forward op: (lse, logp, entropy or [0], row max, log-sum), each [T] float32
    h, w, b, y = _data()
    z = (h.double() @ w.double().T + b.double()) / 0.7
    for C in (3, 7):
        for ent_on in (True, False):
            lse, logp, ent, rowmax, logsum = torch.ops.compactionrl_fast.linear_logprobs_fwd(
                h, w, b, y, 1 / 0.7, C, ent_on, False)
            for t in (lse, logp, rowmax, logsum):
                assert t.dtype == torch.float32 and t.shape == (7,)
            torch.testing.assert_close(lse.double(), z.logsumexp(-1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rowmax.double(), z.amax(-1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logsum.double(), (z - z.amax(-1, keepdim=True)).exp().sum(-1).log(),
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logp.double(), z.log_softmax(-1)[torch.arange(7), y], rtol=1e-5, atol=1e-5)
            assert ent.dtype == torch.float32 and ent.shape == ((7,) if ent_on else (0,))
    e = ll._empty0(torch.zeros(3, dtype=torch.bfloat16))
    assert e.shape == (0,) and e.dtype == torch.float32


class _SpyChunker(loop._Chunker):
    sizes = []

    def __init__(self, hidden, weight, bias, inv_t, C, *a, **k):
        _SpyChunker.sizes.append(C)
        super().__init__(hidden, weight, bias, inv_t, C, *a, **k)


def test_chunk_size_choice(monkeypatch):
    # the given size, capped at T (at least 1); None: the budget over V (patched small here: 44 // 11 = 4)
    monkeypatch.setattr(loop, "_Chunker", _SpyChunker)
    monkeypatch.setattr(ll, "CHUNK_ELEMS", {"cpu": 44, "cuda": 1 << 28})
    h, w, b, y = _data()
    loss_fn = _ppo_like(torch.ones(7), torch.ones(7))
    for chunk_size, want in ((None, 4), (100, 7), (3, 3), (1, 1)):
        _SpyChunker.sizes = []
        crf.linear_logprobs(h, w, y, bias=b, chunk_size=chunk_size)
        crf.linear_logprobs_loss(h, w, y, loss_fn, bias=b, chunk_size=chunk_size)
        assert _SpyChunker.sizes == [want, want], (chunk_size, _SpyChunker.sizes)


def test_no_bias_and_int32_targets_and_defaults():
    h, w, _, y = _data(bias=False)
    h.requires_grad_()
    lp = crf.linear_logprobs(h, w, y.int())
    want = ref.linear_logprobs(h, w, y)
    torch.testing.assert_close(lp.double(), want.detach(), rtol=2e-5, atol=2e-5)
    _check_grads([lp], [want], [h])


def test_no_gradient_needed():
    h, w, b, y = _data()
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, return_entropy=True)
    assert not lp.requires_grad and not ent.requires_grad


def test_exact_at_large_logits():
    # integer logits around 3000 are exact in float32: log p must keep its digits (no z_y - lse, whose
    # rounding at 3000 is ~2e-4), and the entropy too (no lse - E[z])
    h = torch.tensor([[1000.0, 1.0], [3000.0, -2.0], [1.0, 1.0]])
    w = torch.tensor([[3.0, 0.0], [3.0, 1.0], [3.0, -1.0], [1.0, 2.0]])
    y = torch.tensor([0, 2, 3])
    for C in (1, 3):
        h_ = h.clone().requires_grad_()
        lp, ent = crf.linear_logprobs(h_, w, y, return_entropy=True, chunk_size=C)
        r_lp, r_ent = ref.linear_logprobs(h_, w, y, return_entropy=True)
        torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=0, atol=1e-6)
        gl = torch.autograd.grad([lp.sum(), ent.sum()], h_)[0]
        want = torch.autograd.grad([r_lp.sum(), r_ent.sum()], h_)[0]
        torch.testing.assert_close(gl.double(), want.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1e-3, 1e-30])
def test_tiny_temperature_stays_finite(temperature):
    h, w, b, y = _data()
    w.requires_grad_()
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, temperature=temperature, return_entropy=True, chunk_size=3)
    (gw,) = torch.autograd.grad([lp.sum(), ent.sum()], w)
    assert torch.isfinite(gw).all() and torch.isfinite(ent).all()
    if temperature == 1e-3:
        r_lp, r_ent = ref.linear_logprobs(h, w, y, bias=b, temperature=temperature, return_entropy=True)
        (rw,) = torch.autograd.grad([r_lp.sum(), r_ent.sum()], w)
        torch.testing.assert_close(gw.double(), rw.double(), rtol=1e-4, atol=1e-3)


def test_out_of_range_targets_without_value_checks(monkeypatch):
    # unchecked (as on CUDA by default): logp NaN for that row, no one-hot term in its gradient
    monkeypatch.setattr(ll, "value_checks", lambda t: False)
    h, w, b, y = _data()
    y[2], y[5] = 11, -1
    h.requires_grad_()
    lp = crf.linear_logprobs(h, w, y, bias=b, chunk_size=4)
    assert lp[[2, 5]].isnan().all() and not lp[[0, 1, 3, 4, 6]].isnan().any()
    (g,) = torch.autograd.grad(lp, h, torch.ones(7))
    logits = (h.detach().double() @ w.double().T + b.double())
    p = logits.softmax(-1)
    onehot = torch.zeros(7, 11, dtype=torch.float64)
    ok = (y >= 0) & (y < 11)
    onehot[ok.nonzero()[:, 0], y[ok]] = 1.0
    torch.testing.assert_close(g.double(), (onehot - p) @ w.double(), rtol=1e-5, atol=1e-5)
    idx, okk = loop._target_index(y, 11)
    assert idx.tolist() == [int(v) if 0 <= v < 11 else 0 for v in y] and okk.tolist() == ok.tolist()


def test_default_chunk_size():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert type(ll.default_chunk_size(10000, 100000, cpu)) is int
    assert ll.default_chunk_size(10000, 1 << 20, cpu) == 16
    assert ll.default_chunk_size(10000, 32768, cpu) == 512
    assert ll.default_chunk_size(100, 32768, cpu) == 100
    assert ll.default_chunk_size(10000, 100000, cpu) == 160  # 167 rounded down to a multiple of 16
    assert ll.default_chunk_size(10000, 1 << 21, cpu) == 8  # under 16: kept
    assert ll.default_chunk_size(10000, 1 << 30, cpu) == 1
    assert ll.default_chunk_size(10000, 151936, cuda) == 1760
    assert ll.default_chunk_size(10000, 32768, torch.device("meta")) == 512
    assert ll.default_chunk_size(0, 0, cpu) == 1
    assert ll.default_chunk_size(10 ** 9, 0, cpu) == 1 << 24
    assert loop._chunks(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)] and loop._chunks(0, 3) == []


def test_backward_with_no_upstream_is_none():
    ctx = types.SimpleNamespace(saved_tensors=(None,) * 8, needs_input_grad=(True, True, True) + (False,) * 5,
                                cfg=(1.0, 4, False))
    assert ll._fwd_backward(ctx, None, None, None, None, None) == (None,) * 8
    ctx.needs_input_grad = (False,) * 8
    assert ll._fwd_backward(ctx, None, torch.ones(3), None, None, None) == (None,) * 8


# ---------------------------------------------------------------- linear_logprobs_loss


def _ppo_like(adv, mask):
    return lambda lp, ent, sl: -(adv[sl] * lp * mask[sl]).sum() / 5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_loss_matches_reference(dtype, chunk_size, with_entropy):
    h, w, b, y = _data(dtype)
    for x in (h, w, b):
        x.requires_grad_()
    adv = torch.randn(7)
    mask = torch.tensor([1, 1, 0, 1, 1, 0, 1.0])
    if with_entropy:
        def token_loss(lp, ent, sl):
            return -(adv[sl] * lp * mask[sl]).sum() / 5 - 0.1 * ent.sum()
    else:
        token_loss = _ppo_like(adv, mask)
    loss, lp, ent = crf.linear_logprobs_loss(h, w, y, token_loss, bias=b, temperature=0.9, chunk_size=chunk_size,
                                             with_entropy=with_entropy, backend="torch")
    r_lp, r_ent = ref.linear_logprobs(h, w, y, bias=b, temperature=0.9, return_entropy=True)
    want = -(adv.double() * r_lp * mask.double()).sum() / 5 - (0.1 * r_ent.sum() if with_entropy else 0.0)
    assert loss.dtype == torch.float32 and loss.shape == () and loss.requires_grad
    torch.testing.assert_close(loss.double(), want.detach(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=TOL[dtype], atol=TOL[dtype])
    assert not lp.requires_grad
    if with_entropy:
        torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=TOL[dtype], atol=TOL[dtype])
        assert not ent.requires_grad
    else:
        assert ent is None
    _check_grads([loss * 1], [want], [h, w, b])


@pytest.mark.parametrize("scale", [-2.5, 2.0, 1.0])
def test_loss_backward_scales_by_the_upstream_gradient_and_once_only(scale):
    h, w, b, y = _data()
    for x in (h, w, b):
        x.requires_grad_()
    adv, mask = torch.randn(7), torch.ones(7)
    loss, lp, ent = crf.linear_logprobs_loss(h, w, y, _ppo_like(adv, mask), bias=b, chunk_size=3)
    assert ent is None and lp.shape == (7,)
    out = loss * scale
    with CountOps() as ops:
        out.backward(retain_graph=True)
    assert ("aten.mul_.Tensor" in ops.ops) == (scale != 1.0), ops.ops  # 1.0 on CPU: no pass over the gradients
    r_lp = ref.linear_logprobs(h, w, y, bias=b)
    want = -(adv.double() * r_lp).sum() / 5 * scale
    g_ref = torch.autograd.grad(want, (h, w, b))
    for x, g in zip((h, w, b), g_ref):
        torch.testing.assert_close(x.grad.double(), g.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"^linear_logprobs_loss: backward ran a second time through the same "
                                           r"loss \(retain_graph=True\): its gradients are formed in the forward "
                                           r"pass and handed out by the first backward only; call "
                                           r"linear_logprobs_loss again for another backward$"):
        out.backward()


def test_loss_exact_at_large_logits():
    # integer logits around 3000 (exact in float32): the gradients come from the forward's z - max, never
    # from recomputed logits minus lse (which rounds at 3000)
    h = torch.tensor([[1000.0, 1.0], [3000.0, -2.0], [1.0, 1.0]], requires_grad=True)
    w = torch.tensor([[3.0, 0.0], [3.0, 1.0], [3.0, -1.0], [1.0, 2.0]])
    y = torch.tensor([0, 2, 3])
    for C in (1, 3):
        loss, _, _ = crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: -(lp * 0.5).sum() - ent.sum(),
                                              chunk_size=C, with_entropy=True)
        (g,) = torch.autograd.grad(loss, h)
        r_lp, r_ent = ref.linear_logprobs(h, w, y, return_entropy=True)
        (rg,) = torch.autograd.grad(-(r_lp * 0.5).sum() - r_ent.sum(), h)
        torch.testing.assert_close(g.double(), rg.double(), rtol=1e-5, atol=1e-5)


def test_loss_of_unit_upstream_and_partial_needs():
    h, w, b, y = _data(torch.bfloat16)
    w.requires_grad_()
    adv, mask = torch.randn(7), torch.ones(7)
    loss, _, _ = crf.linear_logprobs_loss(h, w, y, _ppo_like(adv, mask), bias=b, chunk_size=100)
    loss.backward()
    want = -(adv.double() * ref.linear_logprobs(h, w, y, bias=b)).sum() / 5
    (gw,) = torch.autograd.grad(want, w)
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.double(), gw.double(), rtol=6e-2, atol=6e-2)


def test_loss_without_gradient_in_the_token_loss():
    # a token loss that is constant, or ignores the entropy: zero gradients, not errors
    h, w, b, y = _data()
    h.requires_grad_()
    loss, _, ent = crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: torch.full((sl.stop - sl.start,), 2.0).sum(),
                                            chunk_size=3, with_entropy=True)
    assert float(loss.detach()) == 2.0 * h.shape[0] and ent is not None
    loss.backward()
    assert (h.grad == 0).all()
    h.grad = None
    loss, _, _ = crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: lp.sum() * 0 + lp[0], with_entropy=True)
    loss.backward()
    assert h.grad[1:].abs().sum() == 0 and h.grad[0].abs().sum() > 0


@pytest.mark.parametrize("fn, match", [
    (lambda lp, ent, sl: lp, r"^token_loss must return a one-element tensor, got Tensor \(3,\)$"),
    (lambda lp, ent, sl: 1.0, "^token_loss must return a one-element tensor, got float $"),
])
def test_loss_refuses_a_non_scalar_token_loss(fn, match):
    h, w, b, y = _data()
    with pytest.raises(TypeError, match=match):
        crf.linear_logprobs_loss(h, w, y, fn, chunk_size=3)


def test_loss_refuses_a_non_callable():
    h, w, b, y = _data()
    with pytest.raises(TypeError, match=r"^token_loss must be callable \(logprobs_c, entropy_c, sl\) -> scalar, "
                                        "got float$"):
        crf.linear_logprobs_loss(h, w, y, 3.0)
    fn = _ppo_like(torch.ones(7), torch.ones(7))
    with pytest.raises(ValueError, match="^bias must have 11 elements"):
        crf.linear_logprobs_loss(h, w, y, fn, bias=torch.zeros(10))
    with pytest.raises(ValueError, match="^chunk_size must be >= 1, got 0"):
        crf.linear_logprobs_loss(h, w, y, fn, chunk_size=0)
    with pytest.raises(TypeError, match="^with_entropy must be a bool"):
        crf.linear_logprobs_loss(h, w, y, _ppo_like(torch.ones(7), torch.ones(7)), with_entropy=1)


# ---------------------------------------------------------------- argument checks


def _call(**over):
    h, w, b, y = _data()
    kw = dict(hidden=h, weight=w, targets=y, bias=b)
    kw.update(over)
    return crf.linear_logprobs(**kw)


@pytest.mark.parametrize("over, err, match", [
    (dict(hidden=torch.zeros(7, 6, dtype=torch.float64)), TypeError, "^hidden"),
    (dict(hidden=torch.zeros(7)), ValueError, "^hidden"),
    (dict(weight=torch.zeros(11, 6, dtype=torch.bfloat16)), TypeError, "^weight"),
    (dict(weight=torch.zeros(11)), ValueError, "^weight"),
    (dict(weight=torch.zeros(11, 5)), ValueError, r"^weight must be \[V, H\] with H=6 \(hidden's last dim\), got "
                                                  r"shape \(11, 5\)"),
    (dict(weight=torch.zeros(0, 6), bias=None), ValueError,
     r"^weight must have at least one row \(vocabulary size V >= 1\)$"),
    (dict(weight=torch.zeros(11, 6, device="meta")), ValueError, "^weight"),
    (dict(targets=torch.zeros(7)), TypeError, "^targets"),
    (dict(targets=torch.zeros(6, dtype=torch.int64)), ValueError, "^targets must have 7 elements"),
    (dict(targets=torch.zeros(7, 1, dtype=torch.int64)), ValueError, "^targets must be 1-D"),
    (dict(targets=torch.zeros(7, dtype=torch.int64, device="meta")), ValueError, "^targets is on meta"),
    (dict(bias=torch.zeros(11, 1)), ValueError, "^bias must be 1-D"),
    (dict(bias=torch.zeros(11, device="meta")), ValueError, "^bias is on meta"),
    (dict(targets=torch.full((7,), 11)), ValueError, r"^targets must be in \[0, V=11\), got targets\[0\]=11"),
    (dict(targets=torch.tensor([0, 1, 2, -3, 4, 5, 6])), ValueError,
     r"^targets must be in \[0, V=11\), got targets\[3\]=-3$"),
    (dict(bias=torch.zeros(10)), ValueError, "^bias"),
    (dict(bias=torch.zeros(11, dtype=torch.float64)), TypeError, "^bias"),
    (dict(temperature=0.0), ValueError, "^temperature must be a finite float > 0, got 0.0"),
    (dict(temperature=float("inf")), ValueError, "^temperature"),
    (dict(temperature=-1.0), ValueError, r"^temperature must be in \[0.0, inf\], got -1.0$"),
    (dict(temperature="1"), TypeError, "^temperature"),
    (dict(temperature=1e-39), ValueError, "^temperature=1e-39 is too small"),
    (dict(chunk_size=2.0), TypeError, "^chunk_size must be an int or None, got float"),
    (dict(chunk_size=True), TypeError, "^chunk_size must be an int or None, got bool"),
    (dict(chunk_size=0), ValueError, "^chunk_size must be >= 1, got 0"),
    (dict(return_entropy=1), TypeError, "^return_entropy must be a bool, got int"),
    (dict(backend="cpp"), ValueError, "^backend"),
])
def test_refused_naming_the_argument(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


def test_accepted_edges():
    # temperature where 1/t is just representable, chunk size 1, an empty batch
    h, w, b, y = _data()
    assert torch.isfinite(_call(temperature=1e-38)).all()
    _call(temperature=4e-39)  # 1/t = 2.5e38 still fits float32 (the logits may overflow: not an error)
    _call(temperature=1.0 / ll.FLOAT32_MAX)  # 1/t is float32 max exactly: allowed
    assert _call(chunk_size=1).shape == (7,)
    lp, ent = crf.linear_logprobs(torch.zeros(0, 6), w, torch.zeros(0, dtype=torch.int64), return_entropy=True)
    assert lp.shape == ent.shape == (0,)


@pytest.mark.parametrize("chunk_size", [3, 100])
def test_triton_backend_runs_the_triton_kernels(triton_launches, chunk_size):
    # routing only (float32 under the interpreter): values and gradients, the kernels launched, the op's
    # outputs; the kernels themselves: tests/ops/test_linear_logprobs.py
    pytest.importorskip("triton")
    h, w, b, y = _data()
    for x in (h, w, b):
        x.requires_grad_()
    out = crf.linear_logprobs(h, w, y, bias=b, temperature=0.8, chunk_size=chunk_size, return_entropy=True,
                              backend="triton")
    want = ref.linear_logprobs(h, w, y, bias=b, temperature=0.8, return_entropy=True)
    for o, r in zip(out, want):
        torch.testing.assert_close(o.double(), r.detach(), rtol=2e-5, atol=2e-5)
    _check_grads(out, want, [h, w, b])
    n = -(-7 // chunk_size)
    assert triton_launches == {"linear_logprobs_stats": n, "linear_logprobs_dlogits": n}
    triton_launches.clear()
    adv = torch.randn(7)
    loss, lp, ent = crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: -(adv[sl] * lp).sum() - 0.1 * ent.sum(),
                                             bias=b, temperature=0.8, chunk_size=chunk_size, with_entropy=True,
                                             backend="triton")
    r_lp, r_ent = ref.linear_logprobs(h, w, y, bias=b, temperature=0.8, return_entropy=True)
    r_loss = -(adv.double() * r_lp).sum() - 0.1 * r_ent.sum()
    torch.testing.assert_close(loss.double(), r_loss.detach(), rtol=2e-5, atol=2e-5)
    _check_grads([loss * 1], [r_loss], [h, w, b])
    assert triton_launches == {"linear_logprobs_stats": n, "linear_logprobs_dlogits": n}
    lse, _, ent0, rowmax, logsum = torch.ops.compactionrl_fast.linear_logprobs_fwd(h, w, b, y, 1.0, 3, False, True)
    assert ent0.shape == rowmax.shape == logsum.shape == (0,) and lse.shape == (7,)


def test_triton_on_cpu_is_float32_only():
    h, w, b, y = _data(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^backend='triton' on CPU tensors \(the Triton interpreter\) supports "
                                         r"float32 only: the interpreter's bf16/fp16 arithmetic is unreliable; use "
                                         r"backend='torch'$"):
        crf.linear_logprobs(h, w, y, backend="triton")
    with pytest.raises(ValueError, match="^backend='triton' on CPU tensors"):
        crf.linear_logprobs_loss(h, w, y, _ppo_like(torch.ones(7), torch.ones(7)), backend="triton")
    resolve = importlib.import_module("compactionrl_fast.ops._dispatch").resolve_backend
    assert resolve("auto", torch.device("cpu"), op="linear_logprobs", dtype=torch.bfloat16) == "torch"
    assert resolve("triton", torch.device("cpu"), op="linear_logprobs", dtype=torch.float32) == "triton"
