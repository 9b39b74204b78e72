"""linear_logprobs: every backend's values and gradients (hidden, weight, bias; from the log-probs, the
entropy and both) against the float64 full-logits reference; the Triton kernels on many vocabulary
tiles; bf16/fp16 against PyTorch's own error in that dtype; bad inputs. Then the torch backend (the CPU chunk
loop), fast: log-probs, entropy and the gradients of hidden, weight and bias against the float64 reference's
autograd for every dtype, chunking (one chunk, several, a short last one), temperature, bias and subset of needed
gradients; the fused `linear_logprobs_loss`; exactness at large logits and finiteness at tiny temperatures; every
argument check with its name."""
import importlib
import types

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import linear_logprobs as ref
from compactionrl_fast.reference import naive_linear_logprobs
from tests.utils import RecordOps

# a chunk buffer of the wrong shape would be resized by an out= op (with this warning) and still give the right
# numbers: make it an error
pytestmark = pytest.mark.filterwarnings("error:An output with one or more elements was resized")

BACKENDS = ["torch-tuned"] + [b for b in ("triton",) if b in available(torch.device("cpu"))]
# (T, H, V): odd sizes, T = 1, V not a multiple of the 2048 vocabulary tile, several tiles
SHAPES = [(1, 96, 37), (63, 96, 5000), (1000, 96, 300), (100, 64, 2049)]


def make(T, H, V, dtype=torch.float32, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # logits of a few units, like a trained LM head: peaked and flat rows both occur
    h = torch.randn(T, H, generator=gen) * 1.5
    w = torch.randn(V, H, generator=gen) / H**0.5
    b = torch.randn(V, generator=gen) if bias else None
    y = torch.randint(0, V, (T,), generator=gen)
    y[:1] = V - 1
    y[1:2] = 0
    leaf = lambda t: None if t is None else t.to(dtype).requires_grad_()
    return leaf(h), leaf(w), leaf(b), y


def rel(a, r):
    """max-norm relative error of a against the float64 truth r."""
    a, r = a.detach().double(), r.detach()
    return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))


def run(fn, h, w, b, y, g_lp, g_ent, **kw):
    """Outputs and gradients (hidden, weight, bias) of sum(g_lp * logp + g_ent * entropy)."""
    want_ent = g_ent is not None
    out = fn(h, w, y, bias=b, return_entropy=want_ent, **kw)
    lp, ent = out if want_ent else (out, None)
    loss = (lp * g_lp.to(lp.dtype)).sum() if g_lp is not None else 0.0
    if want_ent:
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    leaves = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(loss, leaves)
    return [lp, ent], list(grads)


def check_against_reference(backend, h, w, b, y, g_lp, g_ent, tol, **kw):
    outs, grads = run(crf.linear_logprobs, h, w, b, y, g_lp, g_ent, backend=backend, **kw)
    kw.pop("chunk_size", None)
    r_outs, r_grads = run(ref, h, w, b, y, g_lp, g_ent, **kw)
    for name, a, r in [("logp", outs[0], r_outs[0]), ("entropy", outs[1], r_outs[1])]:
        if r is None:
            assert a is None
            continue
        assert a.dtype == torch.float32 and a.shape == r.shape
        assert not a.isnan().any(), name
        assert rel(a, r) < tol, (name, rel(a, r))
    for name, a, r in zip(["d_hidden", "d_weight", "d_bias"], grads, r_grads):
        assert a.dtype == h.dtype and not a.isnan().any(), name
        assert rel(a, r) < tol, (name, rel(a, r))


# ---------------------------------------------------------------- reference


def test_reference_hand_computed():
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([0.0, 0.5, -1.0], dtype=torch.float64)
    y = torch.tensor([2, 1])
    lp, ent = ref(h, w, y, bias=b, temperature=2.0, return_entropy=True)
    z = torch.tensor([[1.0, 0.5, 0.0], [0.0, 2.5, 1.0]], dtype=torch.float64) / 2.0
    p = z.exp() / z.exp().sum(1, keepdim=True)
    torch.testing.assert_close(lp, p[[0, 1], [2, 1]].log())
    torch.testing.assert_close(ent, -(p * p.log()).sum(1))


def test_reference_gradcheck_both_outputs():
    """The oracle's own gradients (autograd through log_softmax) against finite differences."""
    h, w, b, y = make(4, 5, 7, dtype=torch.float64, bias=True)

    def f(h, w, b):
        lp, ent = ref(h, w, y, bias=b, temperature=0.6, return_entropy=True)
        return lp, ent

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_entropy_gradient_closed_form():
    """dH/dz = -p (log p + H), the formula the backward kernels use."""
    z = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    lp = torch.log_softmax(z, -1)
    H = -(lp.exp() * lp).sum(-1)
    (g,) = torch.autograd.grad(H.sum(), z)
    p = lp.detach().exp()
    torch.testing.assert_close(g, -p * (lp.detach() + H.detach()[:, None]))


# ---------------------------------------------------------------- backends vs reference, fp32


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_fp32(backend, shape):
    T, H, V = shape
    h, w, b, y = make(T, H, V, bias=True, seed=T)
    gen = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    chunk = max(1, T // 3 + 1)  # does not divide T (T > 1)
    check_against_reference(backend, h, w, b, y, g_lp, g_ent, 5e-6, temperature=0.7, chunk_size=chunk)
    if backend == "triton":
        return  # the interpreter runs one program at a time; the second pass only changes the matmul
    # without bias, temperature 1, default chunk size, log-probs only
    h, w, _, y = make(T, H, V, seed=T + 1)
    check_against_reference(backend, h, w, None, y, g_lp, None, 5e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_gradients_from_each_output(backend, which):
    T, H, V = 50, 96, 1500
    h, w, b, y = make(T, H, V, bias=True, seed=3)
    gen = torch.Generator().manual_seed(2)
    g_lp = torch.randn(T, generator=gen) if which != "entropy" else None
    g_ent = torch.randn(T, generator=gen) if which != "logp" else None
    if which == "entropy":  # entropy alone: logp is returned but not in the loss (its grad is None)
        _, ent = crf.linear_logprobs(h, w, y, bias=b, temperature=1.3, chunk_size=16, return_entropy=True,
                                     backend=backend)
        grads = torch.autograd.grad((ent * g_ent).sum(), [h, w, b])
        r_ent = ref(h, w, y, bias=b, temperature=1.3, return_entropy=True)[1]
        r_grads = torch.autograd.grad((r_ent * g_ent).sum(), [h, w, b])
        for a, r in zip(grads, r_grads):
            assert rel(a, r) < 5e-6
        return
    check_against_reference(backend, h, w, b, y, g_lp, g_ent, 5e-6, temperature=1.3, chunk_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_sizes_agree(backend):
    T, H, V = 37, 32, 700
    h, w, b, y = make(T, H, V, bias=True, seed=5)
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    r_outs, r_grads = run(ref, h, w, b, y, g_lp, g_ent, temperature=0.9)
    for chunk in (1, 7, 36, 37, 1000) if backend == "torch-tuned" else (7, 1000):
        outs, grads = run(crf.linear_logprobs, h, w, b, y, g_lp, g_ent, temperature=0.9, chunk_size=chunk,
                          backend=backend)
        for a, r in zip(outs + grads, r_outs + r_grads):
            assert rel(a, r) < 5e-6, chunk


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_some_inputs_need_grad(backend):
    T, H, V = 20, 16, 300
    h, w, b, y = make(T, H, V, bias=True, seed=6)
    w.requires_grad_(False)
    b.requires_grad_(False)
    lp = crf.linear_logprobs(h, w, y, bias=b, chunk_size=8, backend=backend)
    (gh,) = torch.autograd.grad(lp.sum(), h)
    (rh,) = torch.autograd.grad(ref(h, w, y, bias=b).sum(), h)
    assert rel(gh, rh) < 5e-6
    with torch.no_grad():
        lp2 = crf.linear_logprobs(h, w, y, bias=b, backend=backend)
    # another chunk size: other matmul shapes, which MKL may round differently (it does with AVX2 kernels)
    assert not lp2.requires_grad and rel(lp2, lp.detach()) < 5e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    h, w, b, y = make(0, 8, 10, bias=True)
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, return_entropy=True, backend=backend)
    assert lp.shape == (0,) and ent.shape == (0,)
    gh, gw, gb = torch.autograd.grad((lp.sum() + ent.sum()), [h, w, b])
    assert gh.shape == (0, 8) and (gw == 0).all() and (gb == 0).all()


def test_peaked_distribution_entropy_stays_precise():
    """A near-one-hot row (huge logit gap): entropy ~ 0 must not come out as lse - E[z] noise."""
    T, H, V = 4, 8, 3000
    h, w, _, y = make(T, H, V, seed=7)
    with torch.no_grad():
        w[5] = h[0] * 40.0 / h[0].norm()  # token 5 dominates row 0 with a logit of about 40 * |h| / |h|
    for backend in BACKENDS:
        lp, ent = crf.linear_logprobs(h, w, y, return_entropy=True, backend=backend)
        r_lp, r_ent = ref(h, w, y, return_entropy=True)
        assert (ent.double() - r_ent).abs().max() < 1e-5, backend
        assert (lp.double() - r_lp).abs().max() < 1e-5 * (1 + r_lp.abs().max()), backend


# ---------------------------------------------------------------- Triton kernels on many tiles


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton with TRITON_INTERPRET=1")
def test_triton_kernels_many_tiles_and_masked_vocabulary():
    from compactionrl_fast.kernels.linear_logprobs import linear_logprobs_dlogits, linear_logprobs_stats

    C, V = 9, 1000
    z = torch.randn(C, V, dtype=torch.float64) * 3
    z[:, 997:] = float("-inf")  # a vocabulary entry masked with a -inf bias has p = 0
    z[2, :] = z[2, :].clamp(max=-5.0)
    z[2, 10] = 30.0  # a peaked row
    y = torch.randint(0, 997, (C,))
    buf = torch.empty(C, V + 24)[:, :V].copy_(z.float())  # row stride != V
    lse, logp, ent = (torch.full((C,), float("nan")) for _ in range(3))
    linear_logprobs_stats(buf, y, lse, logp, ent, tile=64)  # 16 tiles, the last one partial
    lp_all = torch.log_softmax(z, -1)
    p = lp_all.exp()
    r_ent = -(p * lp_all.nan_to_num(neginf=0.0)).sum(1)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, 1), rtol=0, atol=2e-6)
    torch.testing.assert_close(logp.double(), lp_all[torch.arange(C), y], rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), r_ent, rtol=0, atol=2e-6)
    g_lp, g_ent = torch.randn(C), torch.randn(C)
    linear_logprobs_dlogits(buf, y, lse, ent, g_lp, g_ent, tile=128)
    d = -p * (g_lp[:, None].double() + g_ent[:, None].double() * (lp_all.nan_to_num(neginf=0.0) + r_ent[:, None]))
    d[torch.arange(C), y] += g_lp.double()
    torch.testing.assert_close(buf.double(), d, rtol=0, atol=2e-6)
    assert (buf[:, 997:] == 0).all()
    # a small vocabulary packs 16 rows into a block: 9 rows leave the block partial
    z = torch.randn(C, 100) * 2
    lse, logp = torch.full((C,), float("nan")), torch.full((C,), float("nan"))
    linear_logprobs_stats(z, y % 100, lse, logp, None)
    torch.testing.assert_close(lse, torch.logsumexp(z, 1), rtol=0, atol=2e-6)
    torch.testing.assert_close(logp, torch.log_softmax(z, 1)[torch.arange(C), y % 100], rtol=0, atol=2e-6)


# ---------------------------------------------------------------- fused variant (linear_logprobs_loss)


def ppo_token_loss(old_lp, adv, mask, n, ent_coef):
    """A clipped-PPO loss with an entropy bonus, token-mean over a known count: a sum over tokens."""
    def loss(lp, ent, sl):
        ratio = torch.exp(lp - old_lp[sl].to(lp.dtype))
        a = adv[sl].to(lp.dtype)
        l = torch.maximum(-ratio * a, -ratio.clamp(0.8, 1.28) * a)
        if ent is not None:
            l = l - ent_coef * ent
        return (l * mask[sl]).sum() / n
    return loss


@pytest.mark.parametrize("backend,with_entropy", [("torch-tuned", False), ("torch-tuned", True)]
                         + [(b, True) for b in BACKENDS if b != "torch-tuned"])
def test_fused_loss_matches_reference(backend, with_entropy):
    T, H, V = 90, 96, 1100
    h, w, b, y = make(T, H, V, bias=True, seed=9)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        old_lp = ref(h, w, y, bias=b, temperature=0.8) + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)
    adv, mask = torch.randn(T, generator=gen), torch.rand(T, generator=gen) < 0.7
    token_loss = ppo_token_loss(old_lp, adv, mask, int(mask.sum()), 0.01)
    loss, lp, ent = crf.linear_logprobs_loss(h, w, y, token_loss, bias=b, temperature=0.8, chunk_size=32,
                                             with_entropy=with_entropy, backend=backend)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and not lp.requires_grad
    assert (ent is not None) == with_entropy
    grads = torch.autograd.grad(loss * 3.0, [h, w, b])  # an upstream gradient != 1 scales the stored ones
    r_lp, r_ent = ref(h, w, y, bias=b, temperature=0.8, return_entropy=True)
    r_loss = token_loss(r_lp, r_ent if with_entropy else None, slice(0, T))
    r_grads = torch.autograd.grad(r_loss * 3.0, [h, w, b])
    assert abs(float(loss.detach()) - float(r_loss.detach())) < 1e-5 * (1 + abs(float(r_loss.detach())))
    assert rel(lp, r_lp) < 5e-6
    if with_entropy:
        assert rel(ent, r_ent) < 5e-6
    for name, a, r in zip(["d_hidden", "d_weight", "d_bias"], grads, r_grads):
        assert rel(a, r) < 5e-6, (name, rel(a, r))


def test_fused_loss_edge_cases():
    T, H, V = 10, 8, 20
    h, w, b, y = make(T, H, V, bias=True)
    # a loss that does not depend on the log-probs: zero gradients, not an error
    loss, _, _ = crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: torch.full((sl.stop - sl.start,), 2.0).sum(),
                                          chunk_size=3)
    assert float(loss.detach()) == 20.0  # 2 per token
    # a constant per chunk is not a sum over tokens (its value would depend on the chunk count)
    with pytest.raises(ValueError, match="token_loss must be a sum over tokens"):
        crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: torch.tensor(2.0), chunk_size=3)
    gh, gw = torch.autograd.grad(loss + (h.sum() + w.sum()) * 0, [h, w])
    assert (gh == 0).all() and (gw == 0).all()
    # weight frozen: only hidden gets a gradient
    w2 = w.detach()
    loss, _, _ = crf.linear_logprobs_loss(h, w2, y, lambda lp, ent, sl: lp.sum())
    (gh,) = torch.autograd.grad(loss, h)
    (rh,) = torch.autograd.grad(ref(h, w2, y).sum(), h)
    assert rel(gh, rh) < 5e-6
    with pytest.raises(TypeError, match="token_loss"):
        crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: lp)
    with pytest.raises(TypeError, match="token_loss"):
        crf.linear_logprobs_loss(h, w, y, "sum")
    with pytest.raises(TypeError, match="with_entropy"):
        crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: lp.sum(), with_entropy=None)


# ---------------------------------------------------------------- half precision (CPU path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_pytorch_error(dtype):
    """bf16/fp16 inputs: error against float64 at most 2x that of the naive composition in that dtype."""
    T, H, V = 300, 96, 2000
    h, w, b, y = make(T, H, V, dtype=dtype, bias=True, seed=8)
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    outs, grads = run(crf.linear_logprobs, h, w, b, y, g_lp, g_ent, temperature=0.8, chunk_size=70)
    n_outs, n_grads = run(naive_linear_logprobs, h, w, b, y, g_lp, g_ent, temperature=0.8)
    r_outs, r_grads = run(ref, h, w, b, y, g_lp, g_ent, temperature=0.8)
    for name, a, n, r in zip(["logp", "entropy", "d_hidden", "d_weight", "d_bias"], outs + grads,
                             n_outs + n_grads, r_outs + r_grads):
        assert not a.isnan().any(), name
        assert rel(a, r) <= 2 * rel(n, r) + 1e-6, (name, rel(a, r), rel(n, r))
    # the fused variant on the same loss
    token_loss = lambda lp, ent, sl: (lp * g_lp[sl]).sum() + (ent * g_ent[sl]).sum()
    loss, lp, ent = crf.linear_logprobs_loss(h, w, y, token_loss, bias=b, temperature=0.8, chunk_size=70,
                                             with_entropy=True)
    grads = torch.autograd.grad(loss, [h, w, b])
    for name, a, n, r in zip(["logp", "entropy", "d_hidden", "d_weight", "d_bias"], [lp, ent, *grads],
                             n_outs + n_grads, r_outs + r_grads):
        assert rel(a, r) <= 2 * rel(n, r) + 1e-6, ("fused", name, rel(a, r), rel(n, r))


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_naming_the_argument():
    h, w, b, y = make(6, 8, 10, bias=True)
    f = crf.linear_logprobs
    with pytest.raises(ValueError, match="targets"):
        f(h, w, torch.tensor([0, 1, 2, 3, 4, 10]))
    with pytest.raises(ValueError, match="targets"):
        f(h, w, torch.tensor([0, 1, -1, 3, 4, 5]))
    with pytest.raises(ValueError, match="targets"):
        f(h, w, y[:5])
    with pytest.raises(TypeError, match="targets"):
        f(h, w, y.float())
    with pytest.raises(TypeError, match="weight"):
        f(h, w.double(), y)
    with pytest.raises(TypeError, match="hidden"):
        f(h.double(), w.double(), y)
    with pytest.raises(TypeError, match="hidden"):
        f(h.tolist(), w, y)
    with pytest.raises(ValueError, match="weight"):
        f(h, w[:, :5], y)
    with pytest.raises(ValueError, match="weight"):
        f(h, w[:0], y)
    with pytest.raises(ValueError, match="hidden"):
        f(h[0], w, y)
    with pytest.raises(ValueError, match="bias"):
        f(h, w, y, bias=b[:9])
    with pytest.raises(TypeError, match="bias"):
        f(h, w, y, bias=b.double())
    for t in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            f(h, w, y, temperature=t)
    with pytest.raises(TypeError, match="temperature"):
        f(h, w, y, temperature="1")
    with pytest.raises(ValueError, match="chunk_size"):
        f(h, w, y, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        f(h, w, y, chunk_size=2.5)
    with pytest.raises(TypeError, match="return_entropy"):
        f(h, w, y, return_entropy=1)
    with pytest.raises(ValueError, match="backend"):
        f(h, w, y, backend="cpp")
    with pytest.raises(ValueError, match="backend"):
        f(h, w, y, backend="nope")
    if "triton" in BACKENDS:
        with pytest.raises(ValueError, match="float32"):
            f(h.bfloat16(), w.bfloat16(), y, backend="triton")


# ---------------------------------------------------------------- extreme values, unchecked inputs (issue 14)


def _exact_large_logits(offset, T=8, H=4, V=64, seed=3):
    """hidden in {-1, 0, 1}, weight in multiples of 1/4, bias = offset (a multiple of 1/4 below 2^22):
    every float32 logit, and every partial sum of the matmul, is exact, so the float64 reference sees the
    very logits the op computes and any error is the op's own."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randint(-1, 2, (T, H), generator=gen).float().requires_grad_()
    w = (torch.randint(-8, 9, (V, H), generator=gen).float() / 4).requires_grad_()
    b = torch.full((V,), float(offset), requires_grad=True)
    return h, w, b, torch.randint(0, V, (T,), generator=gen)


@pytest.mark.parametrize("offset", [4e5, 4e6])
def test_entropy_gradient_precise_at_large_logits(offset):
    """The backward recomputes the logits; log p must come from z - max (as in the forward), not z - lse,
    which cancels at large logits (the entropy gradient was off by 2.6% at 4e5 and 38% at 4e6)."""
    h, w, b, y = _exact_large_logits(offset)
    g_lp, g_ent = torch.randn(8, generator=torch.Generator().manual_seed(1)), torch.linspace(-1, 1, 8)
    for g in ((None, g_ent), (g_lp, g_ent), (g_lp, None)):
        _, grads = run(crf.linear_logprobs, h, w, b, y, *g, backend="torch-tuned", chunk_size=3)
        _, r_grads = run(ref, h, w, b, y, *g)
        for name, a, r in zip(["d_hidden", "d_weight", "d_bias"], grads, r_grads):
            assert rel(a, r) < 1e-5, (name, g[0] is None, g[1] is None, rel(a, r))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_temperatures_finite_or_rejected(backend):
    h, w, b, y = make(7, 8, 30, bias=True)
    # 1/1e-30 fits float32: finite outputs and gradients (log p ~ -1e30 where p = 0 must not give 0 * inf)
    (lp, ent), grads = run(crf.linear_logprobs, h, w, b, y, torch.ones(7), torch.ones(7), temperature=1e-30,
                           backend=backend, chunk_size=3)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert all(torch.isfinite(g).all() for g in grads)
    # every logit negative (at 1e-30 they reach -1e31, below any "minus infinity" a running max may start
    # from), or every one positive (their difference to that start overflows)
    for shift in (-20.0, 20.0):
        (lp, ent), grads = run(crf.linear_logprobs, h, w, (b.detach() + shift).requires_grad_(), y, torch.ones(7),
                               torch.ones(7), temperature=1e-30, backend=backend, chunk_size=3)
        assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and all(torch.isfinite(g).all() for g in grads)
    # 1/temperature overflows float32: a clear error, before any work
    for t in (1e-39, 1e-300, 5e-324):
        with pytest.raises(ValueError, match="temperature.*overflows"):
            crf.linear_logprobs(h, w, y, temperature=t, backend=backend)
        with pytest.raises(ValueError, match="temperature.*overflows"):
            crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: lp.sum(), temperature=t, backend=backend)


def test_second_backward_of_fused_loss_is_a_clear_error():
    h, w, b, y = make(6, 8, 10, bias=True)
    loss, _, _ = crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: lp.sum(), bias=b, chunk_size=4)
    (2.0 * loss).backward(retain_graph=True)
    g1 = h.grad.clone()
    with pytest.raises(RuntimeError, match="linear_logprobs_loss: backward ran a second time"):
        loss.backward()
    assert torch.equal(h.grad, g1)  # the failed backward added nothing
    (rh,) = torch.autograd.grad(2.0 * ref(h, w, y, bias=b).sum(), h)
    assert rel(g1, rh) < 5e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_out_of_range_targets_give_nan_not_a_crash(monkeypatch, backend):
    """With the value checks off (CUDA's default; COMPACTIONRL_FAST_CHECKS=0 here) targets are not read on
    the host: an out-of-range one gives logp NaN for its row, the other rows stay right, nothing reads out
    of bounds."""
    h, w, b, y = make(6, 8, 10, bias=True)
    bad = y.clone()
    bad[2], bad[4] = 10, -3
    with pytest.raises(ValueError, match="targets"):
        crf.linear_logprobs(h, w, bad, backend=backend)
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "0")
    lp = crf.linear_logprobs(h, w, bad, bias=b, backend=backend, chunk_size=4)
    want = ref(h, w, y, bias=b)
    ok = torch.tensor([True, True, False, True, False, True])
    assert lp[~ok].isnan().all()
    assert rel(lp[ok], want[ok]) < 5e-6
    (gh,) = torch.autograd.grad(torch.where(ok, lp, 0.0).sum(), h)
    (rh,) = torch.autograd.grad(torch.where(ok, want, 0.0).sum(), h)
    # rows with a bad target get -p from the unused log-prob's (zero) upstream gradient: here 0
    assert rel(gh, rh) < 5e-6


class _NewVxH(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ops that allocate a new tensor of `shape` (outputs that alias no input)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape and t.untyped_storage().data_ptr() not in ins:
                self.count += 1
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_weight_gradient_accumulates_in_place(dtype, fused):
    """d W is one fp32 [V, H] accumulator updated in place per chunk: the backward allocates at most two
    [V, H] tensors (the accumulator and, for bf16, its cast to the weight's dtype), however many chunks.
    The backward op's chunk loop is called directly: a dispatch mode sees a custom op's outputs only."""
    import importlib

    ll = importlib.import_module("compactionrl_fast.ops.linear_logprobs")
    T, H, V = 40, 8, 24
    h, w, b, y = make(T, H, V, dtype=dtype, bias=True)
    counts = []
    for chunk in (20, 4):  # 2 and 10 chunks
        mode = _NewVxH((V, H))
        if not fused:
            lse, lp, ent, rowmax, logsum = torch.ops.compactionrl_fast.linear_logprobs_fwd(
                h.detach(), w.detach(), b.detach(), y, 1.0, chunk, True, False)
            g = torch.ones(T)
        with mode:
            if fused:
                loss, _, _ = crf.linear_logprobs_loss(h, w, y, lambda lp, ent, sl: lp.float().sum(), bias=b,
                                                      chunk_size=chunk, with_entropy=False)
                torch.autograd.grad(loss, [h, w, b])
            else:
                dh, dw, db = ll.linear_logprobs_bwd(h.detach(), w.detach(), b.detach(), y, lse, ent, g, g, 1.0, chunk,
                                                    (True, True, True), False, rowmax, logsum)
                assert dw.shape == (V, H) and dw.dtype == dtype
        counts.append(mode.count)
    assert counts[0] == counts[1] <= 2, counts


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entropy", [False, True])
def test_torch_compile_fullgraph_forward_and_backward(backend, entropy):
    """The forward and backward chunk loops are custom ops with fake impls and a registered autograd
    formula: the call traces into one graph (fullgraph=True raises on any break), and the compiled
    forward and backward equal eager ones."""
    torch._dynamo.reset()
    T, H, V = 20, 16, 300
    h, w, b, y = make(T, H, V, bias=True, seed=8)

    def step(h, w, b, y):
        out = crf.linear_logprobs(h * 1.0, w, y, bias=b, temperature=0.7, chunk_size=8, return_entropy=entropy,
                                  backend=backend)
        lp, ent = out if entropy else (out, None)
        return lp.sum() * 2.0 + (0.0 if ent is None else (ent * torch.linspace(0, 1, T)).sum())

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(h, w, b, y)
    g_got = torch.autograd.grad(got, [h, w, b])
    want = step(h, w, b, y)
    g_want = torch.autograd.grad(want, [h, w, b])
    assert torch.equal(got, want)
    for a, r in zip(g_got, g_want):
        assert torch.equal(a, r)


# ---------------------------------------------------------------- the torch backend (the CPU chunk loop), fast


ll = importlib.import_module("compactionrl_fast.ops.linear_logprobs")  # the packages export the functions
loop = importlib.import_module("compactionrl_fast.ops._linear_logprobs_loop")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2, torch.float16: 8e-3}


@pytest.fixture
def triton_launches():
    """{kernel name: launches} of the Triton kernels during the test (see `_no_triton_kernels`)."""
    return {}


@pytest.fixture
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


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 4, 100])
@pytest.mark.parametrize("entropy", [False, True])
def test_matches_reference(dtype, chunk_size, entropy):
    h, w, b, y = _data(dtype)
    for x in (h, w, b):
        x.requires_grad_()
    out = crf.linear_logprobs(h, w, y, bias=b, temperature=0.8, chunk_size=chunk_size, return_entropy=entropy,
                              backend="torch-tuned")
    want = ref(h, w, y, bias=b, temperature=0.8, return_entropy=entropy)
    out, want = (out, want) if entropy else ((out,), (want,))
    for o, r in zip(out, want):
        assert o.dtype == torch.float32 and o.shape == (7,)
        torch.testing.assert_close(o.double(), r.detach(), rtol=TOL[dtype], atol=TOL[dtype])
    _check_grads(out, want, [h, w, b])


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("used", ["logp", "entropy"])
@pytest.mark.parametrize("chunk_size", [2, 100])
def test_one_output_used(dtype, used, chunk_size):
    # the other output gets no gradient (None upstream): the backward must not need it
    h, w, b, y = _data(dtype)
    for x in (h, w, b):
        x.requires_grad_()
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, temperature=1.3, chunk_size=chunk_size, return_entropy=True)
    r_lp, r_ent = ref(h, w, y, bias=b, temperature=1.3, return_entropy=True)
    _check_grads([lp if used == "logp" else ent], [r_lp if used == "logp" else r_ent], [h, w, b])


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("needs", ["h", "w", "b", "wb"])
@pytest.mark.parametrize("chunk_size", [3, 100])
def test_only_the_needed_gradients(needs, chunk_size):
    h, w, b, y = _data(torch.bfloat16)
    h.requires_grad_("h" in needs)
    w.requires_grad_("w" in needs)
    b.requires_grad_("b" in needs)
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, chunk_size=chunk_size, return_entropy=True)
    r_lp, r_ent = ref(h, w, y, bias=b, return_entropy=True)
    _check_grads([lp, ent], [r_lp, r_ent], _leaves(h, w, b))


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [3, 4])
def test_no_bias_with_temperature(dtype, chunk_size):
    h, w, _, y = _data(dtype, bias=False)
    for x in (h, w):
        x.requires_grad_()
    out = crf.linear_logprobs(h, w, y, temperature=0.6, chunk_size=chunk_size, return_entropy=True)
    want = ref(h, w, y, temperature=0.6, return_entropy=True)
    for o, r in zip(out, want):
        torch.testing.assert_close(o.double(), r.detach(), rtol=TOL[dtype], atol=TOL[dtype])
    _check_grads(out, want, [h, w])


@pytest.mark.usefixtures("_no_triton_kernels")
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


@pytest.mark.usefixtures("_no_triton_kernels")
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


@pytest.mark.usefixtures("_no_triton_kernels")
def test_no_bias_and_int32_targets_and_defaults():
    h, w, _, y = _data(bias=False)
    h.requires_grad_()
    lp = crf.linear_logprobs(h, w, y.int())
    want = ref(h, w, y)
    torch.testing.assert_close(lp.double(), want.detach(), rtol=2e-5, atol=2e-5)
    _check_grads([lp], [want], [h])


@pytest.mark.usefixtures("_no_triton_kernels")
def test_no_gradient_needed():
    h, w, b, y = _data()
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, return_entropy=True)
    assert not lp.requires_grad and not ent.requires_grad


@pytest.mark.usefixtures("_no_triton_kernels")
def test_exact_at_large_logits():
    # integer logits around 3000 are exact in float32: log p must keep its digits (no z_y - lse, whose
    # rounding at 3000 is ~2e-4), and the entropy too (no lse - E[z])
    h = torch.tensor([[1000.0, 1.0], [3000.0, -2.0], [1.0, 1.0]])
    w = torch.tensor([[3.0, 0.0], [3.0, 1.0], [3.0, -1.0], [1.0, 2.0]])
    y = torch.tensor([0, 2, 3])
    for C in (1, 3):
        h_ = h.clone().requires_grad_()
        lp, ent = crf.linear_logprobs(h_, w, y, return_entropy=True, chunk_size=C)
        r_lp, r_ent = ref(h_, w, y, return_entropy=True)
        torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=0, atol=1e-6)
        gl = torch.autograd.grad([lp.sum(), ent.sum()], h_)[0]
        want = torch.autograd.grad([r_lp.sum(), r_ent.sum()], h_)[0]
        torch.testing.assert_close(gl.double(), want.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("temperature", [1e-3, 1e-30])
def test_tiny_temperature_stays_finite(temperature):
    h, w, b, y = _data()
    w.requires_grad_()
    lp, ent = crf.linear_logprobs(h, w, y, bias=b, temperature=temperature, return_entropy=True, chunk_size=3)
    (gw,) = torch.autograd.grad([lp.sum(), ent.sum()], w)
    assert torch.isfinite(gw).all() and torch.isfinite(ent).all()
    if temperature == 1e-3:
        r_lp, r_ent = ref(h, w, y, bias=b, temperature=temperature, return_entropy=True)
        (rw,) = torch.autograd.grad([r_lp.sum(), r_ent.sum()], w)
        torch.testing.assert_close(gw.double(), rw.double(), rtol=1e-4, atol=1e-3)


@pytest.mark.usefixtures("_no_triton_kernels")
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


@pytest.mark.usefixtures("_no_triton_kernels")
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


@pytest.mark.usefixtures("_no_triton_kernels")
def test_backward_with_no_upstream_is_none():
    ctx = types.SimpleNamespace(saved_tensors=(None,) * 8, needs_input_grad=(True, True, True) + (False,) * 5,
                                cfg=(1.0, 4, False))
    assert ll._fwd_backward(ctx, None, None, None, None, None) == (None,) * 8
    ctx.needs_input_grad = (False,) * 8
    assert ll._fwd_backward(ctx, None, torch.ones(3), None, None, None) == (None,) * 8


# ---------------------------------------------------------------- linear_logprobs_loss


def _ppo_like(adv, mask):
    return lambda lp, ent, sl: -(adv[sl] * lp * mask[sl]).sum() / 5


@pytest.mark.usefixtures("_no_triton_kernels")
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
                                             with_entropy=with_entropy, backend="torch-tuned")
    r_lp, r_ent = ref(h, w, y, bias=b, temperature=0.9, return_entropy=True)
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


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("scale", [-2.5, 2.0, 1.0])
def test_loss_backward_scales_by_the_upstream_gradient_and_once_only(scale):
    h, w, b, y = _data()
    for x in (h, w, b):
        x.requires_grad_()
    adv, mask = torch.randn(7), torch.ones(7)
    loss, lp, ent = crf.linear_logprobs_loss(h, w, y, _ppo_like(adv, mask), bias=b, chunk_size=3)
    assert ent is None and lp.shape == (7,)
    out = loss * scale
    with RecordOps() as ops:
        out.backward(retain_graph=True)
    assert ("aten.mul_.Tensor" in ops.ops) == (scale != 1.0), ops.ops  # 1.0 on CPU: no pass over the gradients
    r_lp = ref(h, w, y, bias=b)
    want = -(adv.double() * r_lp).sum() / 5 * scale
    g_ref = torch.autograd.grad(want, (h, w, b))
    for x, g in zip((h, w, b), g_ref):
        torch.testing.assert_close(x.grad.double(), g.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"^linear_logprobs_loss: backward ran a second time through the same "
                                           r"loss \(retain_graph=True\): its gradients are formed in the forward "
                                           r"pass and handed out by the first backward only; call "
                                           r"linear_logprobs_loss again for another backward$"):
        out.backward()


@pytest.mark.usefixtures("_no_triton_kernels")
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
        r_lp, r_ent = ref(h, w, y, return_entropy=True)
        (rg,) = torch.autograd.grad(-(r_lp * 0.5).sum() - r_ent.sum(), h)
        torch.testing.assert_close(g.double(), rg.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("_no_triton_kernels")
def test_loss_of_unit_upstream_and_partial_needs():
    h, w, b, y = _data(torch.bfloat16)
    w.requires_grad_()
    adv, mask = torch.randn(7), torch.ones(7)
    loss, _, _ = crf.linear_logprobs_loss(h, w, y, _ppo_like(adv, mask), bias=b, chunk_size=100)
    loss.backward()
    want = -(adv.double() * ref(h, w, y, bias=b)).sum() / 5
    (gw,) = torch.autograd.grad(want, w)
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.double(), gw.double(), rtol=6e-2, atol=6e-2)


@pytest.mark.usefixtures("_no_triton_kernels")
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


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("fn, match", [
    (lambda lp, ent, sl: lp, r"^token_loss must return a one-element tensor, got Tensor \(3,\)$"),
    (lambda lp, ent, sl: 1.0, "^token_loss must return a one-element tensor, got float $"),
])
def test_loss_refuses_a_non_scalar_token_loss(fn, match):
    h, w, b, y = _data()
    with pytest.raises(TypeError, match=match):
        crf.linear_logprobs_loss(h, w, y, fn, chunk_size=3)


@pytest.mark.usefixtures("_no_triton_kernels")
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


@pytest.mark.usefixtures("_no_triton_kernels")
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


@pytest.mark.usefixtures("_no_triton_kernels")
def test_accepted_edges():
    # temperature where 1/t is just representable, chunk size 1, an empty batch
    h, w, b, y = _data()
    assert torch.isfinite(_call(temperature=1e-38)).all()
    _call(temperature=4e-39)  # 1/t = 2.5e38 still fits float32 (the logits may overflow: not an error)
    _call(temperature=1.0 / ll.FLOAT32_MAX)  # 1/t is float32 max exactly: allowed
    assert _call(chunk_size=1).shape == (7,)
    lp, ent = crf.linear_logprobs(torch.zeros(0, 6), w, torch.zeros(0, dtype=torch.int64), return_entropy=True)
    assert lp.shape == ent.shape == (0,)


@pytest.mark.usefixtures("_no_triton_kernels")
@pytest.mark.parametrize("chunk_size", [3, 100])
def test_triton_backend_runs_the_triton_kernels(triton_launches, chunk_size):
    # routing only (float32 under the interpreter): values and gradients, the kernels launched, the op's
    # outputs; the kernels themselves: the tests above
    pytest.importorskip("triton")
    h, w, b, y = _data()
    for x in (h, w, b):
        x.requires_grad_()
    out = crf.linear_logprobs(h, w, y, bias=b, temperature=0.8, chunk_size=chunk_size, return_entropy=True,
                              backend="triton")
    want = ref(h, w, y, bias=b, temperature=0.8, return_entropy=True)
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
    r_lp, r_ent = ref(h, w, y, bias=b, temperature=0.8, return_entropy=True)
    r_loss = -(adv.double() * r_lp).sum() - 0.1 * r_ent.sum()
    torch.testing.assert_close(loss.double(), r_loss.detach(), rtol=2e-5, atol=2e-5)
    _check_grads([loss * 1], [r_loss], [h, w, b])
    assert triton_launches == {"linear_logprobs_stats": n, "linear_logprobs_dlogits": n}
    lse, _, ent0, rowmax, logsum = torch.ops.compactionrl_fast.linear_logprobs_fwd(h, w, b, y, 1.0, 3, False, True)
    assert ent0.shape == rowmax.shape == logsum.shape == (0,) and lse.shape == (7,)


@pytest.mark.usefixtures("_no_triton_kernels")
def test_triton_on_cpu_is_float32_only():
    h, w, b, y = _data(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^backend='triton' on CPU tensors \(the Triton interpreter\) supports "
                                         r"float32 only: the interpreter's bf16/fp16 arithmetic is unreliable; use "
                                         r"backend='torch-tuned'$"):
        crf.linear_logprobs(h, w, y, backend="triton")
    with pytest.raises(ValueError, match="^backend='triton' on CPU tensors"):
        crf.linear_logprobs_loss(h, w, y, _ppo_like(torch.ones(7), torch.ones(7)), backend="triton")
    resolve = importlib.import_module("compactionrl_fast.ops._dispatch").resolve_backend
    assert resolve("auto", torch.device("cpu"), op="linear_logprobs", dtype=torch.bfloat16) == "torch-tuned"
    assert resolve("triton", torch.device("cpu"), op="linear_logprobs", dtype=torch.float32) == "triton"
