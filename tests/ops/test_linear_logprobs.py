"""linear_logprobs: every backend's values and gradients (hidden, weight, bias; from the log-probs, the
entropy and both) against the float64 full-logits reference; the Triton kernels on many vocabulary
tiles; bf16/fp16 against PyTorch's own error in that dtype; bad inputs."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import linear_logprobs as ref
from compactionrl_fast.reference import naive_linear_logprobs

BACKENDS = ["torch"] + [b for b in ("triton",) if b in available(torch.device("cpu"))]
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
    for chunk in (1, 7, 36, 37, 1000) if backend == "torch" else (7, 1000):
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


@pytest.mark.parametrize("backend,with_entropy", [("torch", False), ("torch", True)]
                         + [(b, True) for b in BACKENDS if b != "torch"])
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
        _, grads = run(crf.linear_logprobs, h, w, b, y, *g, backend="torch", chunk_size=3)
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
