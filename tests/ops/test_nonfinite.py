"""Non-finite and extreme inputs (issue 27): every CPU backend, and the CUDA C++ kernels run on the host, agree
with the float64 reference on the outputs AND the gradients, NaN for NaN at the same positions and the same
infinities (docs/ops.md, "Non-finite input").

Each case puts one bad value (NaN, +-inf, 3e38, a log-ratio of 100 or 1000, a NaN old value, ...) at a
trainable token and, separately, at a non-trainable one, in a small batch of ordinary tokens (several
segments, so the per-segment weights differ), and compares loss, metrics and gradients token by token.
"""
from __future__ import annotations

import math

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from tests.ops import _losses_cuda_host as cuda_host
from tests.ops.test_gae import build_cuda_host as gae_cuda_host
from tests.ops.test_gae import route_cpp_to_cuda_host as route_gae_to_cuda_host
from compactionrl_fast.reference import gae as ref_gae
from compactionrl_fast.reference.linear_logprobs import linear_logprobs as ref_llp_fn
from compactionrl_fast.reference import losses as ref

CPU = torch.device("cpu")
LOSS_BACKENDS = [b for b in ("cpp", "triton", "torch") if b in available(CPU)]
LLP_BACKENDS = ["torch-tuned"] + [b for b in ("triton",) if b in available(CPU)]
# the CUDA C++ kernels too (losses, segment_gae), run on the host (tests/cuda_host_emu.h)
CUDA_HOST = "cuda-c++-on-host"
INF, NAN = float("inf"), float("nan")

T = 40
TRAIN, FROZEN = 13, 14  # the bad token: trainable / not trainable
CU = torch.tensor([0, 9, 25, 40], dtype=torch.int32)
CU_SEG = torch.tensor([0, 2, 3], dtype=torch.int32)


def _mask():
    m = torch.rand(T, generator=torch.Generator().manual_seed(1)) < 0.75
    m[TRAIN], m[FROZEN] = True, False
    return m


@pytest.fixture(scope="module")
def cuda_host_libs(tmp_path_factory):
    """The CUDA C++ kernels of the losses and of segment_gae built for the host, at small block shapes."""
    return (cuda_host.build(tmp_path_factory.mktemp("nonfinite_losses_host"), *cuda_host.SHAPES[0]),
            gae_cuda_host(tmp_path_factory.mktemp("nonfinite_gae_host"), 8, 4))


def route(request, monkeypatch, backend):
    """The backend to call: CUDA_HOST is backend="cpp" routed to the CUDA kernels' host builds."""
    if backend != CUDA_HOST:
        return backend
    losses, gae = request.getfixturevalue("cuda_host_libs")
    cuda_host.route_cpp_to_cuda_host(monkeypatch, losses)
    route_gae_to_cuda_host(monkeypatch, gae)
    return "cpp"


def same(got, want, what, atol=1e-6):
    """float32 `got` against the float64 reference `want` rounded to float32: NaN where it has NaN, the same
    infinities, finite values close."""
    got, want = got.detach().float().cpu(), want.detach().double().cpu().float()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- ppo_policy_loss

def _policy_inputs():
    g = torch.Generator().manual_seed(5)
    old = torch.randn(T, generator=g) * 0.8 - 2.0
    return dict(logprobs=old + torch.randn(T, generator=g) * 0.6, old_logprobs=old,
                advantages=torch.randn(T, generator=g), rollout_logprobs=old + torch.randn(T, generator=g) * 0.3)


# (name, {input: value}, advantage sign at the token (None: keep), log-ratio (None: keep))
POLICY_CASES = [
    ("logp=+inf", {"logprobs": INF}), ("logp=-inf", {"logprobs": -INF}), ("logp=nan", {"logprobs": NAN}),
    ("old=-inf", {"old_logprobs": -INF}), ("old=+inf", {"old_logprobs": INF}), ("old=nan", {"old_logprobs": NAN}),
    ("adv=+inf", {"advantages": INF}), ("adv=-inf", {"advantages": -INF}), ("adv=nan", {"advantages": NAN}),
    ("adv=+3e38", {"advantages": 3e38}), ("adv=-3e38", {"advantages": -3e38}),
    ("logratio=1000", {"logratio": 1000.0}), ("logratio=1000,adv<0", {"logratio": 1000.0, "advantages": -1.0}),
    ("logratio=1000,adv=0", {"logratio": 1000.0, "advantages": 0.0}),
    ("logratio=100,adv>0", {"logratio": 100.0, "advantages": 1.0}),
    ("logratio=100,adv<0", {"logratio": 100.0, "advantages": -1.0}),
    ("logratio=100,adv=0", {"logratio": 100.0, "advantages": 0.0}),
    ("logratio=-1000", {"logratio": -1000.0}),
    ("logratio=89,adv=1e-3", {"logratio": 89.0, "advantages": 1e-3}),  # ratio past float32, the loss not
    ("roll=nan", {"rollout_logprobs": NAN}), ("roll=-inf", {"rollout_logprobs": -INF}),
    ("roll=+inf", {"rollout_logprobs": INF}),
]
POLICY_OPTS = {
    "plain": dict(),
    "dual+tis": dict(dual_clip=3.0, tis=True, tis_cap=2.0),
    "tis-nocap,segment-mean": dict(tis=True, reduction="segment-mean"),
    "denominator=0": dict(denominator=0.0),  # weights 0: 0 times an infinite float64 term is NaN
}


def _policy_case(case, at):
    x = _policy_inputs()
    x["advantages"][at] = 1.0  # a positive advantage, overridden by the case
    for k, v in case.items():
        if k == "logratio":
            x["logprobs"][at] = x["old_logprobs"][at] + v
        else:
            x[k][at] = v
    return x


def _run_policy(backend, x, mask, opts):
    opts = dict(opts)
    roll = x["rollout_logprobs"] if opts.pop("tis", False) else None
    lp = x["logprobs"].clone().requires_grad_()
    kw = dict(cu_seqlens=CU, cu_segments=CU_SEG, rollout_logprobs=roll, **opts)
    if backend is None:
        loss, m = ref.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], mask, **kw)
    else:
        loss, m = crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], mask, backend=backend, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    return loss, m, g


@pytest.mark.parametrize("opts", POLICY_OPTS, ids=str)
@pytest.mark.parametrize("where", ["trainable", "frozen"])
@pytest.mark.parametrize("name,case", POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
@pytest.mark.parametrize("backend", LOSS_BACKENDS + [CUDA_HOST])
def test_policy_loss(request, monkeypatch, backend, name, case, where, opts):
    backend = route(request, monkeypatch, backend)
    if "roll" in name and "tis" not in opts:
        pytest.skip("rollout_logprobs are read with TIS only")
    mask = _mask()
    x = _policy_case(case, TRAIN if where == "trainable" else FROZEN)
    want = _run_policy(None, x, mask, POLICY_OPTS[opts])
    got = _run_policy(backend, x, mask, POLICY_OPTS[opts])
    same(got[0], want[0], "loss")
    for k in want[1]:
        same(got[1][k], want[1][k], k)
    same(got[2], want[2], "grad")
    if where == "frozen":  # a non-trainable token changes nothing
        clean = _run_policy(None, _policy_inputs() | {"advantages": x["advantages"]}, mask, POLICY_OPTS[opts])
        assert all(math.isfinite(float(v)) for v in (got[0], *got[1].values())) and got[2].isfinite().all()
        same(got[2], clean[2], "grad (clean)")


# ---------------------------------------------------------------- value_loss, value_head_loss

def _value_inputs():
    g = torch.Generator().manual_seed(6)
    ret = torch.randn(T, generator=g)
    v = ret + torch.randn(T, generator=g) * 0.5
    return dict(values=v, old_values=v + torch.randn(T, generator=g) * 0.3, returns=ret)


VALUE_CASES = [
    ("v=nan", {"values": NAN}), ("v=+inf", {"values": INF}), ("v=-inf", {"values": -INF}),
    ("v=3e38", {"values": 3e38}), ("v=1e30", {"values": 1e30}),
    ("v=3e19", {"values": 3e19}),  # the square past float32, the weighted loss not
    ("ret=nan", {"returns": NAN}), ("ret=+inf", {"returns": INF}), ("ret=-3e38", {"returns": -3e38}),
    ("old=nan", {"old_values": NAN}), ("old=+inf", {"old_values": INF}), ("old=-inf", {"old_values": -INF}),
    ("old=3e38", {"old_values": 3e38}),
]
VALUE_OPTS = {"noclip": dict(), "clip": dict(clip=0.2), "clip,rollout-mean": dict(clip=0.2, reduction="rollout-mean"),
              "clip,denominator=0": dict(clip=0.2, denominator=0.0)}


def _value_case(case, at):
    x = _value_inputs()
    for k, v in case.items():
        x[k][at] = v
    return x


def _run_value(backend, x, mask, opts):
    v = x["values"].clone().requires_grad_()
    kw = dict(cu_seqlens=CU, cu_segments=CU_SEG, **opts)
    if backend is None:
        loss, m = ref.value_loss(v, x["old_values"], x["returns"], mask, **kw)
    else:
        loss, m = crf.value_loss(v, x["old_values"], x["returns"], mask, backend=backend, **kw)
    (g,) = torch.autograd.grad(loss, v)
    return loss, m, g


@pytest.mark.parametrize("opts", VALUE_OPTS, ids=str)
@pytest.mark.parametrize("where", ["trainable", "frozen"])
@pytest.mark.parametrize("name,case", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
@pytest.mark.parametrize("backend", LOSS_BACKENDS + [CUDA_HOST])
def test_value_loss(request, monkeypatch, backend, name, case, where, opts):
    backend = route(request, monkeypatch, backend)
    mask = _mask()
    x = _value_case(case, TRAIN if where == "trainable" else FROZEN)
    want = _run_value(None, x, mask, VALUE_OPTS[opts])
    got = _run_value(backend, x, mask, VALUE_OPTS[opts])
    same(got[0], want[0], "loss")
    for k in want[1]:
        same(got[1][k], want[1][k], k)
    same(got[2], want[2], "grad")
    if where == "frozen":
        assert all(math.isfinite(float(v)) for v in (got[0], *got[1].values())) and got[2].isfinite().all()


@pytest.mark.parametrize("scale", [1e30, 1e36])
@pytest.mark.parametrize("backend", LOSS_BACKENDS + [CUDA_HOST])
def test_explained_variance_of_huge_values(request, monkeypatch, backend, scale):
    """Values and returns ~1e30 (squares past float32): the explained variance is the float64 one."""
    backend = route(request, monkeypatch, backend)
    x = _value_inputs()
    x = {k: t * scale for k, t in x.items()}
    mask = _mask()
    want = _run_value(None, x, mask, {})
    got = _run_value(backend, x, mask, {})
    assert math.isfinite(float(want[1]["explained_variance"]))
    for k in want[1]:
        same(got[1][k], want[1][k], k)
    same(got[0], want[0], "loss")


HEAD_CASES = [("h=nan", "hidden", NAN), ("h=+inf", "hidden", INF), ("old=nan", "old_values", NAN),
              ("ret=nan", "returns", NAN), ("ret=+inf", "returns", INF),
              # the head's weight (every token's value NaN or inf): a masked token's d_hidden is still 0 (issue 55)
              ("w=nan", "weight", NAN), ("w=-inf", "weight", -INF)]


@pytest.mark.parametrize("where", ["trainable", "frozen"])
@pytest.mark.parametrize("name,key,val", HEAD_CASES, ids=[c[0] for c in HEAD_CASES])
@pytest.mark.parametrize("backend", LOSS_BACKENDS + ["torch-tuned"])
def test_value_head_loss(backend, name, key, val, where):
    if key == "weight" and where == "frozen":
        pytest.skip("the weight is not per token: the trainable case covers it")
    g = torch.Generator().manual_seed(7)
    H = 24
    hidden, w, b = torch.randn(T, H, generator=g), torch.randn(H, generator=g) * 0.2, torch.randn(1, generator=g)
    x = _value_inputs()
    at = TRAIN if where == "trainable" else FROZEN
    if key == "hidden":
        hidden[at, 3] = val
    elif key == "weight":
        w[3] = val
    else:
        x[key][at] = val
    mask = _mask()

    def run(backend):
        h, wt, bb = (t.clone().requires_grad_() for t in (hidden, w, b))
        kw = dict(clip=0.2, cu_seqlens=CU, reduction="segment-mean")
        if backend is None:
            # the reference: a non-trainable token's row is never read (the documented rule), so it is zeroed
            hv = torch.where(mask[:, None], h, 0.0)
            loss, m = ref.value_loss(ref.value_head(hv, wt, bb), x["old_values"], x["returns"], mask, **kw)
        else:
            loss, m = crf.value_head_loss(h, wt, bb, x["old_values"], x["returns"], mask, backend=backend, **kw)
        return (loss, m, *torch.autograd.grad(loss, [h, wt, bb]))

    want, got = run(None), run(backend)
    same(got[0], want[0], "loss")
    for k in want[1]:
        same(got[1][k], want[1][k], k)
    for name_, a, r in zip(("d_hidden", "d_weight", "d_bias"), got[2:], want[2:]):
        same(a, r, name_)


# ---------------------------------------------------------------- float64 inputs of the losses (issue 55)

# (op, input, value): values near 1e300 are finite in float64 only (a float32 copy would be +-inf)
F64_CASES = [("ppo_policy_loss", "advantages", 1e300), ("ppo_policy_loss", "advantages", -1e300),
             ("ppo_policy_loss", "old_logprobs", 1e300), ("ppo_policy_loss", "old_logprobs", -1e300),
             ("ppo_policy_loss", "logprobs", -1e300), ("ppo_policy_loss", "rollout_logprobs", 1e300),
             ("value_loss", "values", 1e300), ("value_loss", "values", -1e300), ("value_loss", "returns", 1e300),
             ("value_loss", "returns", -1e300), ("value_loss", "old_values", 1e300)]


# and the input that gets the gradient: float64 too, or float32 (only the others float64; 1e300 is no float32)
F64_PARAMS = [(*c, gd) for c in F64_CASES for gd in (torch.float64, torch.float32)
              if gd == torch.float64 or c[1] not in ("logprobs", "values")]


@pytest.mark.parametrize("op,key,val,grad_dtype", F64_PARAMS,
                         ids=[f"{c[1]}={c[2]:g}-grad-{str(c[3])[6:]}" for c in F64_PARAMS])
@pytest.mark.parametrize("backend", LOSS_BACKENDS + ["auto"])
def test_float64_inputs(backend, op, key, val, grad_dtype):
    """float64 inputs are computed in float64 by cpp ("auto" on CPU) and the reference: the same loss, metrics
    and gradient (float64 for a float64 input, to a few float64 roundings), values near 1e300 included, on
    trainable and masked tokens; triton refuses them (docs/ops.md, "float64 inputs")."""
    policy = op == "ppo_policy_loss"
    first = "logprobs" if policy else "values"
    x = {k: t.double() for k, t in (_policy_inputs() if policy else _value_inputs()).items()}
    x[key][[TRAIN, FROZEN]] = val
    mask = _mask()
    kw = dict(cu_seqlens=CU, cu_segments=CU_SEG, reduction="segment-mean")
    if policy:
        kw.update(dual_clip=3.0, rollout_logprobs=x.pop("rollout_logprobs"), tis_cap=2.0)
    else:
        kw.update(clip=0.2)
    rest = [x[k] for k in (("old_logprobs", "advantages") if policy else ("old_values", "returns"))]

    def run(fn, **b):
        leaf = x[first].to(grad_dtype).requires_grad_()
        loss, m = fn(leaf, *rest, mask, **kw, **b)
        return loss, m, torch.autograd.grad(loss, leaf)[0]

    fn = crf.ppo_policy_loss if policy else crf.value_loss
    if backend == "triton":
        with pytest.raises(ValueError, match="float64 inputs .* backend='cpp'"):
            run(fn, backend=backend)
        return
    want, got = run(getattr(ref, op)), run(fn, backend=backend)
    same(got[0], want[0], "loss")
    for k in want[1]:
        same(got[1][k], want[1][k], k)
    assert got[2].dtype == grad_dtype and (got[2][~mask] == 0).all()
    rtol = 1e-12 if grad_dtype == torch.float64 else 2e-7  # a float32 gradient: the float64 one rounded
    torch.testing.assert_close(got[2], want[2], rtol=rtol, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("op", ["ppo_policy_loss", "value_loss"])
def test_float64_inputs_are_refused_by_the_float32_kernels(op):
    """The Triton and CUDA loss kernels read float32: a float64 input is a ValueError there, also for "auto" on
    CUDA tensors (ops/_dispatch.py `_op_rule`), never a float32 copy that turns 1e300 into inf."""
    from compactionrl_fast.ops._dispatch import _op_rule

    for asked, b in (("auto", "triton"), ("auto", "cuda"), ("triton", "triton"), ("cuda", "cuda")):
        with pytest.raises(ValueError, match=f"{op}: float64 inputs .* the {b} kernels read float32"):
            _op_rule(op, asked, b, "cuda", torch.float64, False)
        assert _op_rule(op, asked, b, "cuda", torch.float32, False) == b
    assert _op_rule(op, "auto", "cpp", "cpu", torch.float64, False) == "cpp"


# ---------------------------------------------------------------- segment_gae

GAE_CASES = [("r=nan", "rewards", NAN), ("r=+inf", "rewards", INF), ("v=nan", "values", NAN),
             ("v=-inf", "values", -INF), ("v=3e38", "values", 3e38)]


@pytest.mark.parametrize("where", ["trainable", "frozen"])
@pytest.mark.parametrize("name,key,val", GAE_CASES, ids=[c[0] for c in GAE_CASES])
@pytest.mark.parametrize("backend", LOSS_BACKENDS + [CUDA_HOST])
def test_segment_gae(request, monkeypatch, backend, name, key, val, where):
    backend = route(request, monkeypatch, backend)
    g = torch.Generator().manual_seed(8)
    x = dict(rewards=torch.randn(T, generator=g), values=torch.randn(T, generator=g))
    mask = _mask()
    x[key][TRAIN if where == "trainable" else FROZEN] = val
    kw = dict(gamma=0.99, lam=0.95)
    want = ref_gae.segment_gae(x["rewards"], x["values"], mask, CU, CU_SEG, **kw)
    got = crf.segment_gae(x["rewards"], x["values"], mask, CU, CU_SEG, backend=backend, **kw)
    # finite values within one float32 ulp of the largest output (the accuracy rule of segment_gae: returns
    # are advantages plus values, and a 3e38 value cancels there)
    big = max(float(r[r.isfinite()].abs().max()) for r in want)
    for n, a, r in zip(("advantages", "returns"), got, want):
        same(a, r, n, atol=big * 2.0**-23)


# ---------------------------------------------------------------- linear_logprobs (and the fused loss)

LLP_CASES = [("h=nan", "hidden", NAN), ("h=+inf", "hidden", INF), ("w=nan", "weight", NAN), ("b=-inf", "bias", -INF)]


@pytest.mark.parametrize("name,key,val", LLP_CASES, ids=[c[0] for c in LLP_CASES])
@pytest.mark.parametrize("backend", LLP_BACKENDS)
def test_linear_logprobs(backend, name, key, val):
    g = torch.Generator().manual_seed(9)
    Tl, H, V = 12, 16, 30
    t = dict(hidden=torch.randn(Tl, H, generator=g), weight=torch.randn(V, H, generator=g) * 0.3,
             bias=torch.randn(V, generator=g))
    y = torch.randint(0, V, (Tl,), generator=g)
    t[key][(4, 2) if key != "bias" else 7] = val
    g_lp, g_ent = torch.randn(Tl, generator=g), torch.randn(Tl, generator=g)

    def run(fn, **kw):
        h, w, b = (t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        lp, ent = fn(h, w, y, bias=b, return_entropy=True, **kw)
        return (lp, ent, *torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), [h, w, b]))

    want = run(ref_llp_fn)
    got = run(crf.linear_logprobs, backend=backend, chunk_size=5)
    for n, a, r in zip(("logprobs", "entropy", "d_hidden", "d_weight", "d_bias"), got, want):
        same(a, r, n)


@pytest.mark.parametrize("backend", LLP_BACKENDS)
def test_linear_logprobs_loss_needs_a_sum_over_tokens(backend):
    """A token_loss that is not a sum over tokens (a constant, a mean) cannot be split into chunks: a
    ValueError when the call has more than one chunk; with one chunk the loss is the reference's."""
    g = torch.Generator().manual_seed(10)
    Tl, H, V = 12, 16, 30
    h, w = torch.randn(Tl, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (Tl,), generator=g)
    for fn in (lambda lp, ent, sl: torch.tensor(1.0), lambda lp, ent, sl: lp.mean()):
        with pytest.raises(ValueError, match="token_loss must be a sum over tokens"):
            crf.linear_logprobs_loss(h, w, y, fn, chunk_size=5, backend=backend)
        loss, _, _ = crf.linear_logprobs_loss(h, w, y, fn, chunk_size=Tl, backend=backend)
        want = fn(ref_llp_fn(h, w, y), None, slice(0, Tl))
        same(loss, want, "loss")


# ---------------------------------------------------------------- offsets of the wrong type

@pytest.mark.parametrize("op", ["ppo_policy_loss", "value_loss", "value_head_loss", "segment_gae",
                                "global_denominator"])
@pytest.mark.parametrize("arg", ["cu_seqlens", "cu_segments"])
def test_list_offsets_are_a_type_error(op, arg):
    x, mask = _policy_inputs(), _mask()
    cu = {"cu_seqlens": CU, "cu_segments": CU_SEG}
    cu[arg] = cu[arg].tolist()
    calls = {
        "ppo_policy_loss": lambda: crf.ppo_policy_loss(x["logprobs"], x["old_logprobs"], x["advantages"], mask, **cu),
        "value_loss": lambda: crf.value_loss(x["logprobs"], x["old_logprobs"], x["advantages"], mask, **cu),
        "value_head_loss": lambda: crf.value_head_loss(torch.randn(T, 4), torch.randn(4), None, x["old_logprobs"],
                                                       x["advantages"], mask, **cu),
        "segment_gae": lambda: crf.segment_gae(x["advantages"], x["old_logprobs"], mask, **cu),
        "global_denominator": lambda: crf.global_denominator("segment-mean", mask, **cu),
    }
    with pytest.raises(TypeError, match=f"^{arg} must be a torch.Tensor, got list$"):
        calls[op]()
