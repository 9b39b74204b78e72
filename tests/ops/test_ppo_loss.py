"""ppo_policy_loss: reference vs hand-computed values and the common trainers' token-mean and
per-sequence-mean formulations; every backend vs the float64 reference (loss, gradient, metrics) on packed
batches from the shape table, every reduction with and without a denominator, every clip variant;
fully-masked and empty batches; determinism; torch.compile; bad inputs. Then the Python entry on the cpp and
torch backends, fast: loss, metrics and gradient against the float64 reference (its autograd) for every
reduction, layout, clip, dual clip and truncated importance weight; the arguments handed to the op; every
argument check with its name; the fake impl and the registration."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops import ppo_loss as ops_ppo
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import losses as ref
from tests.ops import _losses_cuda_host as host
from tests.utils import RecordOps, SHAPE_TABLE, packed_batch, random_case

# numpy warns on the inf/NaN the interpreter computes in masked-out lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
BACKENDS = [b for b in ("cpp", "triton", "cuda") if b in available(torch.device("cpu"))]
REDUCTIONS = ["token-mean", "segment-mean", "rollout-mean", "sum"]
CLIPS = {
    "symmetric": dict(clip_low=0.2, clip_high=0.2),
    "asymmetric": dict(clip_low=0.2, clip_high=0.28),
    "dual": dict(clip_low=0.2, clip_high=0.2, dual_clip=3.0),
    "tis": dict(clip_low=0.1, clip_high=0.3, tis=True, tis_cap=2.0),
    "tis_uncapped_dual": dict(dual_clip=2.0, tis=True),
}

# Above every block/thread-split threshold: the C++ kernels' 8,192-token blocks (3 blocks, so 2 threads
# split them), Triton's 1,024-token programs; segments cross block boundaries, one of 3 tokens sits inside
# a block, an empty one sits on a boundary.
OVER_BLOCKS = [[(9000, "rand"), (7000, "rand"), (3, "all"), (0, "rand"), (5000, "rand")], [(1200, "all")]]
THREADS = (1, 2, 3)

# Every reduction with and without a denominator, every clip variant (paired up to keep the sweep short).
SWEEP = [("dual", "token-mean", False), ("symmetric", "token-mean", True), ("asymmetric", "segment-mean", False),
         ("tis", "segment-mean", True), ("tis_uncapped_dual", "rollout-mean", False), ("dual", "rollout-mean", True),
         ("asymmetric", "sum", False)]


def policy_inputs(T, seed):
    """float32 log-probs with ratios spread over ~[0.2, 5] (clip and dual clip both active)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(T, generator=g) * 0.8 - 2.0
    return dict(logprobs=old + torch.randn(T, generator=g) * 0.6, old_logprobs=old,
                advantages=torch.randn(T, generator=g), rollout_logprobs=old + torch.randn(T, generator=g) * 0.3)


def run_backend(backend, b, x, clip, **kw):
    """(loss, metrics, grad) from `backend`, or from the float64 reference for backend=None."""
    clip = dict(clip)
    roll = x["rollout_logprobs"] if clip.pop("tis", False) else None
    lp = x["logprobs"].clone().double().requires_grad_() if backend is None else x["logprobs"].clone().requires_grad_()
    fn = ref.ppo_policy_loss if backend is None else crf.ppo_policy_loss
    extra = {} if backend is None else {"backend": backend}
    loss, m = fn(lp, x["old_logprobs"], x["advantages"], b["loss_mask"], cu_seqlens=b["cu_seqlens"],
                 cu_segments=b["cu_segments"], rollout_logprobs=roll, **clip, **kw, **extra)
    loss.backward()
    return loss, m, lp.grad


def check_against_reference(backend, b, x, clip, **kw):
    loss, m, grad = run_backend(backend, b, x, clip, **kw)
    rl, rm, rg = run_backend(None, b, x, clip, **kw)
    assert loss.dtype == torch.float32 and loss.shape == () and grad.dtype == torch.float32
    assert not grad.isnan().any() and not loss.isnan()
    # tolerance from the float32 precision floor, relative to sum_t w_t |l_t|
    c = dict(clip)
    roll = x["rollout_logprobs"] if c.pop("tis", False) else None
    l_tok = ref.ppo_token_losses(x["logprobs"], x["old_logprobs"], x["advantages"], rollout_logprobs=roll, **c)[0]
    w = ref.token_weights(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], kw.get("reduction", "token-mean"),
                          kw.get("denominator"))
    scale = float((w * l_tok.abs()).sum())
    assert abs(loss.item() - rl.item()) <= 2e-6 * scale + 1e-30, (backend, clip, kw, loss.item(), rl.item())
    torch.testing.assert_close(grad.double(), rg, rtol=2e-6, atol=1e-30, msg=lambda s: f"{backend} {clip} {kw}: {s}")
    assert (grad[~b["loss_mask"]] == 0).all()
    for k in ("clip_fraction", "dual_clip_fraction", "ratio_max"):
        torch.testing.assert_close(m[k].double(), rm[k], rtol=1e-6, atol=0, msg=k)
    torch.testing.assert_close(m["approx_kl"].double(), rm["approx_kl"], rtol=1e-5, atol=1e-9)
    # float32 log ratios: each rounds relative to |logprobs| + |old_logprobs|
    mk = b["loss_mask"]
    mag = float((x["logprobs"].abs() + x["old_logprobs"].abs())[mk].double().mean()) if mk.any() else 0.0
    torch.testing.assert_close(m["log_ratio"].double(), rm["log_ratio"], rtol=1e-5, atol=1e-6 * mag + 1e-12)
    assert set(m) == set(rm)
    for v in m.values():
        assert v.shape == () and v.dtype == torch.float32


# ---------------------------------------------------------------- reference, by hand and vs trainers


def test_reference_hand_computed():
    lp = torch.tensor([0.0, 0.5, -0.5, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(5, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, 3.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False, True])
    r = torch.exp(lp.detach())
    # token 0: ratio 1 -> -1 (grad -1); token 1: ratio e^.5 > 1.2, A > 0 -> clipped at -1.2 (grad 0);
    # token 2: ratio e^-.5 < .8, A < 0 -> clipped at .8 (grad 0); token 4: ratio e^2 = 7.39, A < 0:
    # unclipped 7.39 > dual 3 -> 3 (grad 0)
    want = torch.tensor([-1.0, -1.2, 0.8, 0.0, 3.0], dtype=torch.float64)
    loss, m = ref.ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0)
    loss.backward()
    torch.testing.assert_close(loss, want[mask].mean())
    torch.testing.assert_close(lp.grad, torch.tensor([-0.25, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert float(m["clip_fraction"]) == 0.5 and float(m["dual_clip_fraction"]) == 0.25
    torch.testing.assert_close(m["ratio_max"], r[4])
    kl = ((r - 1) - lp.detach())[mask].mean()
    torch.testing.assert_close(m["approx_kl"], kl)
    torch.testing.assert_close(m["log_ratio"], lp.detach()[mask].mean())
    # truncated importance weight: min(exp(old - rollout), cap) scales each token's loss
    roll = torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0], dtype=torch.float64)
    loss_tis, _ = ref.ppo_policy_loss(lp.detach(), old, adv, mask, dual_clip=3.0, rollout_logprobs=roll, tis_cap=2.0)
    torch.testing.assert_close(loss_tis, (want * torch.tensor([1, 1, 1, 1, 2.0]))[mask].mean().double())


def _padded_batch(seed):
    B, L = 6, 50
    lengths = [50, 1, 17, 33, 2, 49]
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = torch.rand(n, generator=g) < 0.7
        mask[i, 0] = True  # every row has a trainable token
    old = torch.randn(B, L, generator=g, dtype=torch.float64) - 2
    lp = old + 0.5 * torch.randn(B, L, generator=g, dtype=torch.float64)
    adv = torch.randn(B, L, generator=g, dtype=torch.float64)
    return lengths, mask, lp, old, adv


@pytest.mark.parametrize("clip_low,clip_high", [(0.2, 0.2), (0.2, 0.28)])
def test_reference_matches_common_trainer_formulations(clip_low, clip_high):
    """Single-segment batches: "token-mean" == sum(l*mask)/sum(mask); "segment-mean" == the mean over
    sequences of each sequence's masked token mean."""
    lengths, mask, lp, old, adv = _padded_batch(0)
    loss_mat = ref.padded_ppo_token_losses(lp, old, adv, clip_low, clip_high)
    pack = lambda t: torch.cat([t[i, :n] for i, n in enumerate(lengths)])  # noqa: E731
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    kw = dict(clip_low=clip_low, clip_high=clip_high, cu_seqlens=cu)
    tm, _ = ref.ppo_policy_loss(pack(lp), pack(old), pack(adv), pack(mask), reduction="token-mean", **kw)
    sm, _ = ref.ppo_policy_loss(pack(lp), pack(old), pack(adv), pack(mask), reduction="segment-mean", **kw)
    torch.testing.assert_close(tm, ref.padded_token_mean(loss_mat, mask))
    torch.testing.assert_close(sm, ref.padded_seq_mean_token_mean(loss_mat, mask))
    # one segment per rollout: rollout-mean is segment-mean
    rm, _ = ref.ppo_policy_loss(pack(lp), pack(old), pack(adv), pack(mask), reduction="rollout-mean", **kw)
    torch.testing.assert_close(rm, sm)
    # and the fused op agrees with the trainers' formulation directly
    for b in BACKENDS:
        for red, want in (("token-mean", ref.padded_token_mean(loss_mat, mask)),
                          ("segment-mean", ref.padded_seq_mean_token_mean(loss_mat, mask))):
            got, _ = crf.ppo_policy_loss(pack(lp).float(), pack(old).float(), pack(adv).float(), pack(mask),
                                         reduction=red, backend=b, **kw)
            assert abs(float(got) - float(want)) < 1e-5 * float(loss_mat.abs().mean()), (b, red)


def test_reference_weights_by_hand():
    mask = torch.tensor([True, True, False, True, True, True, False])
    cu = torch.tensor([0, 2, 3, 4, 7])  # segments: [T T] [F] [T] [T T F]
    cs = torch.tensor([0, 2, 4])        # rollouts: segments 0-1 (2 tokens), segments 2-3 (3 tokens)
    w = lambda red, d=None: ref.token_weights(mask, cu, cs, red, d).tolist()  # noqa: E731
    assert w("sum") == [1, 1, 0, 1, 1, 1, 0]
    assert w("token-mean") == pytest.approx([0.2, 0.2, 0, 0.2, 0.2, 0.2, 0])
    assert w("token-mean", 10) == pytest.approx([0.1, 0.1, 0, 0.1, 0.1, 0.1, 0])
    # 3 segments with tokens: 1/(2*3), 1/(1*3), 1/(2*3)
    assert w("segment-mean") == pytest.approx([1 / 6, 1 / 6, 0, 1 / 3, 1 / 6, 1 / 6, 0])
    assert w("rollout-mean") == pytest.approx([1 / 4, 1 / 4, 0, 1 / 6, 1 / 6, 1 / 6, 0])
    assert w("rollout-mean", 4) == pytest.approx([1 / 8, 1 / 8, 0, 1 / 12, 1 / 12, 1 / 12, 0])


# ---------------------------------------------------------------- backends vs reference


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SHAPE_TABLE))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_backend_matches_reference_shape_table(backend, case, index_dtype):
    b = packed_batch(SHAPE_TABLE[case], seed=len(case), index_dtype=index_dtype)
    x = policy_inputs(b["loss_mask"].numel(), seed=len(case))
    n = int(b["loss_mask"].sum())
    for clip, red, denominator in SWEEP:
        kw = dict(denominator=3 * n + 7) if denominator else {}
        check_against_reference(backend, b, x, CLIPS[clip], reduction=red, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_backend_matches_reference_random(backend, seed):
    b = packed_batch(random_case(seed), seed=seed, index_dtype=[torch.int32, torch.int64][seed % 2])
    x = policy_inputs(b["loss_mask"].numel(), seed=seed)
    for red in REDUCTIONS:
        check_against_reference(backend, b, x, CLIPS["tis_uncapped_dual"], reduction=red)
    check_against_reference(backend, b, x, CLIPS["asymmetric"], reduction="rollout-mean",
                            denominator=torch.tensor(11.0))


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_fully_masked_batch_gives_zero_loss_and_gradient(backend, reduction):
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=0)
    b["loss_mask"] = torch.zeros_like(b["loss_mask"])
    x = policy_inputs(b["loss_mask"].numel(), seed=0)
    x["logprobs"][::3] = float("-inf")  # garbage at masked positions must not leak
    loss, m, grad = run_backend(backend, b, x, CLIPS["tis"], reduction=reduction)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert all(float(v) == 0.0 for v in m.values())


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_empty_batch(backend):
    e = torch.zeros(0, requires_grad=True)
    loss, m = crf.ppo_policy_loss(e, e.detach(), e.detach(), torch.zeros(0, dtype=torch.bool), backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and e.grad.shape == (0,)
    loss, _ = crf.ppo_policy_loss(e, e.detach(), e.detach(), torch.zeros(0, dtype=torch.bool),
                                  cu_seqlens=torch.tensor([0, 0, 0]), reduction="segment-mean", backend=backend)
    assert loss.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_deterministic(backend):
    b = packed_batch(OVER_BLOCKS, seed=2)
    x = policy_inputs(b["loss_mask"].numel(), seed=2)
    runs = []
    threads = torch.get_num_threads()
    for n_threads in THREADS + (1,):
        torch.set_num_threads(n_threads)
        runs.append(run_backend(backend, b, x, CLIPS["dual"], reduction="segment-mean"))
    torch.set_num_threads(threads)
    for loss, m, grad in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and torch.equal(grad, runs[0][2])
        assert all(torch.equal(m[k], runs[0][1][k]) for k in m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_flows_to_logprobs_only_and_scales_with_grad_output(backend):
    b = packed_batch(SHAPE_TABLE["odd_lengths"], seed=1)
    x = policy_inputs(b["loss_mask"].numel(), seed=1)
    lp = x["logprobs"].clone().requires_grad_()
    old = x["old_logprobs"].clone().requires_grad_()
    adv = x["advantages"].clone().requires_grad_()
    loss, _ = crf.ppo_policy_loss(lp, old, adv, b["loss_mask"], backend=backend)
    (3.0 * loss).backward()
    assert old.grad is None and adv.grad is None
    _, _, g1 = run_backend(backend, b, x, CLIPS["symmetric"])
    torch.testing.assert_close(lp.grad, 3.0 * g1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_second_backward_fails_loudly_and_changes_nothing(backend, scale):
    """The backward hands out the saved gradient buffer itself (one [T] buffer in all). A second backward
    through a retained graph is refused with a clear error; the gradient handed out first stays right."""
    b = packed_batch(SHAPE_TABLE["odd_lengths"], seed=1)
    x = policy_inputs(b["loss_mask"].numel(), seed=1)
    _, _, want = run_backend(None, b, x, CLIPS["symmetric"])
    lp = x["logprobs"].clone().requires_grad_()
    loss, _ = crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], b["loss_mask"], backend=backend)
    (g1,) = torch.autograd.grad(scale * loss, lp, retain_graph=True)
    kept = g1.clone()
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, lp, grad_outputs=torch.tensor(2.0), retain_graph=True)
    assert torch.equal(g1, kept)
    torch.testing.assert_close(g1.double(), scale * want, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_and_half_precision_inputs(backend):
    b = packed_batch(SHAPE_TABLE["odd_lengths"], seed=1)
    x = policy_inputs(b["loss_mask"].numel(), seed=1)
    with torch.no_grad():
        loss, _ = crf.ppo_policy_loss(x["logprobs"], x["old_logprobs"], x["advantages"], b["loss_mask"],
                                      backend=backend)
    want, _ = ref.ppo_policy_loss(x["logprobs"], x["old_logprobs"], x["advantages"], b["loss_mask"])
    assert abs(loss.item() - float(want)) < 1e-5
    for dtype in (torch.bfloat16, torch.float16):
        lp = x["logprobs"].to(dtype).requires_grad_()
        loss, _ = crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], b["loss_mask"], backend=backend)
        loss.backward()
        assert lp.grad.dtype == dtype and lp.grad.shape == lp.shape
        # the float64 gradient at the same (rounded) log-probs, rounded once to the dtype: within half an ulp
        # (+ the float32 kernel's error)
        r_lp = lp.detach().double().requires_grad_()
        r_loss, _ = ref.ppo_policy_loss(r_lp, x["old_logprobs"], x["advantages"], b["loss_mask"])
        r_loss.backward()
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # relative spacing at a power of 2
        assert ((lp.grad.double() - r_lp.grad).abs() <= (ulp / 2 + 1e-5) * r_lp.grad.abs() + torch.finfo(dtype).smallest_normal * ulp).all()  # + subnormal spacing
        assert (r_lp.grad != 0).sum() > 10 and abs(loss.item() - r_loss.item()) < 1e-5


# ---------------------------------------------------------------- CUDA kernels, run on the host


@pytest.mark.skipif("cpp" not in BACKENDS, reason="the cpp backend defines the op schema")
# the multi-block case is the slow one on the host (8x4 blocks); make test-all runs it
@pytest.mark.parametrize("case", ["single_token", "empty_segments", "no_trainable",
                                  pytest.param("long_multiblock", marks=pytest.mark.slow)])
def test_cuda_kernels_on_host_match_reference(monkeypatch, cuda_host_lib, case):
    b, threads = host.host_case(monkeypatch, cuda_host_lib, case)
    x = policy_inputs(b["loss_mask"].numel(), seed=len(case))
    n = int(b["loss_mask"].sum())
    for clip, red, denominator in SWEEP[:3] if threads > 32 else SWEEP:  # 256 host threads are slow
        check_against_reference("cpp", b, x, CLIPS[clip], reduction=red, **(dict(denominator=n + 5) if denominator else {}))


# ---------------------------------------------------------------- torch.compile


@pytest.mark.skipif("cpp" not in BACKENDS, reason="needs the compiled extension")
@pytest.mark.parametrize("reduction", ["token-mean", "segment-mean"])
def test_torch_compile_fullgraph(reduction):
    """The op traces into one graph (fake impl + registered autograd): fullgraph=True raises on any break."""
    torch._dynamo.reset()
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=0)
    x = policy_inputs(b["loss_mask"].numel(), seed=0)

    def step(lp, old, adv, mask, cu):
        loss, m = crf.ppo_policy_loss(lp * 1.0, old, adv, mask, cu_seqlens=cu, reduction=reduction, dual_clip=3.0)
        return loss * 2.0, m["clip_fraction"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    lp = x["logprobs"].clone().requires_grad_()
    loss, cf = compiled(lp, x["old_logprobs"], x["advantages"], b["loss_mask"], b["cu_seqlens"])
    loss.backward()
    lp2 = x["logprobs"].clone().requires_grad_()
    loss2, cf2 = step(lp2, x["old_logprobs"], x["advantages"], b["loss_mask"], b["cu_seqlens"])
    loss2.backward()
    assert torch.equal(loss, loss2) and torch.equal(cf, cf2) and torch.equal(lp.grad, lp2.grad)


# ---------------------------------------------------------------- bad inputs


def _good():
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=0)
    x = policy_inputs(b["loss_mask"].numel(), seed=0)
    return dict(logprobs=x["logprobs"], old_logprobs=x["old_logprobs"], advantages=x["advantages"],
                loss_mask=b["loss_mask"]), dict(cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"])


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda t, k: t.update(loss_mask=t["loss_mask"].int()), TypeError, "loss_mask"),
    (lambda t, k: t.update(logprobs=t["logprobs"].long()), TypeError, "logprobs"),
    (lambda t, k: t.update(old_logprobs=t["old_logprobs"][:-1]), ValueError, "old_logprobs"),
    (lambda t, k: t.update(advantages=t["advantages"][None]), ValueError, "advantages"),
    (lambda t, k: t.update(advantages=[0.0]), TypeError, "advantages"),
    (lambda t, k: k.update(cu_seqlens=k["cu_seqlens"].flip(0)), ValueError, "cu_seqlens"),
    (lambda t, k: k.update(cu_seqlens=k["cu_seqlens"].float()), TypeError, "cu_seqlens"),
    (lambda t, k: k.update(cu_segments=k["cu_segments"][:-1]), ValueError, "cu_segments"),
    (lambda t, k: k.update(cu_seqlens=None), ValueError, "cu_segments"),
    (lambda t, k: k.update(rollout_logprobs=torch.zeros(3)), ValueError, "rollout_logprobs"),
    (lambda t, k: k.update(tis_cap=2.0), ValueError, "tis_cap"),
    (lambda t, k: k.update(rollout_logprobs=t["old_logprobs"], tis_cap=0.0), ValueError, "tis_cap"),
    (lambda t, k: k.update(clip_low=1.5), ValueError, "clip_low"),
    (lambda t, k: k.update(clip_high=-0.1), ValueError, "clip_high"),
    (lambda t, k: k.update(clip_high="0.2"), TypeError, "clip_high"),
    (lambda t, k: k.update(dual_clip=1.0), ValueError, "dual_clip"),
    (lambda t, k: k.update(reduction="mean"), ValueError, "reduction"),
    (lambda t, k: k.update(reduction="sum", denominator=3), ValueError, "denominator"),
    (lambda t, k: k.update(denominator=-1.0), ValueError, "denominator"),
    (lambda t, k: k.update(denominator=torch.ones(2)), ValueError, "denominator"),
    (lambda t, k: k.update(backend="gpu"), ValueError, "backend"),
    (lambda t, k: k.update(backend="cuda"), ValueError, "cuda"),
])
def test_bad_inputs_raise(mutate, exc, match):
    t, k = _good()
    mutate(t, k)
    with pytest.raises(exc, match=match):
        crf.ppo_policy_loss(*t.values(), **k)


def test_device_mismatch_raises():
    t, k = _good()
    t["advantages"] = t["advantages"].to("meta")
    with pytest.raises(ValueError, match="advantages"):
        crf.ppo_policy_loss(*t.values(), **k)


# ---------------------------------------------------------------- above the block and thread thresholds


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_over_blocks(backend):
    """Several C++ blocks and Triton programs, segments across their boundaries: a block that stops a
    token early (or starts one late) shows here."""
    b = packed_batch(OVER_BLOCKS, seed=5, index_dtype=torch.int64)
    x = policy_inputs(b["loss_mask"].numel(), seed=5)
    for clip, red, denominator in SWEEP[::2]:
        check_against_reference(backend, b, x, CLIPS[clip], reduction=red,
                                **(dict(denominator=1234) if denominator else {}))


# ---------------------------------------------------------------- the torch backend's wrapper


def test_torch_backend_wrapper_is_the_reference_with_every_argument():
    """backend="torch" must hand every argument to the reference: compare with the reference called
    directly, on inputs where each argument changes the result (so a dropped one shows)."""
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=3)
    x = policy_inputs(b["loss_mask"].numel(), seed=3)
    x["logprobs"][::5] += 2.0  # ratios ~7 with A < 0: the dual clip binds
    kw = dict(cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"], clip_low=0.15, clip_high=0.35,
              dual_clip=3.0, rollout_logprobs=x["rollout_logprobs"], tis_cap=1.1, reduction="rollout-mean",
              denominator=7)
    args = (x["logprobs"], x["old_logprobs"], x["advantages"], b["loss_mask"])
    got, gm = crf.ppo_policy_loss(*args, backend="torch", **kw)
    want, wm = ref.ppo_policy_loss(*args, **kw)
    assert got.dtype == torch.float32 and got.item() == want.float().item()
    assert all(gm[k].item() == wm[k].float().item() for k in wm)
    for k, other in [("cu_seqlens", None), ("cu_segments", None), ("clip_low", 0.2), ("clip_high", 0.2),
                     ("dual_clip", None), ("rollout_logprobs", None), ("tis_cap", None),
                     ("reduction", "segment-mean"), ("denominator", None)]:
        changed = dict(kw, **{k: other})
        if k == "cu_seqlens":
            changed.update(cu_segments=None, reduction="token-mean")
        if k == "rollout_logprobs":
            changed.update(tis_cap=None)
        alt, alt_m = ref.ppo_policy_loss(*args, **changed)
        assert alt.item() != want.item() or any(alt_m[m].item() != wm[m].item() for m in wm), k


# ---------------------------------------------------------------- extreme values and non-finite inputs


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_zero_advantage_with_a_ratio_past_float32(backend, dual_clip):
    """log-ratio 100 (exp overflows float32) with A = 0: the loss term is 0, not 0 * inf = NaN (as in the
    float64 reference and verl). The metrics report the float32 ratio, inf, on every backend."""
    lp = torch.tensor([100.0, 0.0], requires_grad=True)
    loss, m = crf.ppo_policy_loss(lp, torch.zeros(2), torch.tensor([0.0, 1.0]), torch.ones(2, dtype=torch.bool),
                                  clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, backend=backend)
    loss.backward()
    assert loss.item() == -0.5 and lp.grad.tolist() == [0.0, -0.5]
    assert m["ratio_max"].item() == float("inf") and m["approx_kl"].item() == float("inf")
    assert m["clip_fraction"].item() == 0.0 and m["dual_clip_fraction"].item() == 0.0
    # the same through the truncated importance weight, whose exp overflows too
    lp = torch.tensor([0.0, 0.0], requires_grad=True)
    loss, _ = crf.ppo_policy_loss(lp, torch.tensor([100.0, 0.0]), torch.tensor([0.0, 1.0]),
                                  torch.ones(2, dtype=torch.bool), rollout_logprobs=torch.zeros(2),
                                  dual_clip=dual_clip, backend=backend)
    loss.backward()
    assert loss.item() == -0.5 and lp.grad.tolist() == [0.0, -0.5]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tis", [False, True])
def test_zero_advantage_past_float32_leaves_the_other_tokens_bits(backend, tis):
    """The C++ loop's fast pass gets such a token's loss as NaN and redoes its chunk exactly: every other
    token's gradient keeps its bits, that token's gradient is 0 and the loss stays finite (20K tokens:
    several chunks and blocks)."""
    x = policy_inputs(20000, seed=9)
    mask = torch.rand(20000, generator=torch.Generator().manual_seed(9)) < 0.8
    i = 12345
    mask[i] = True
    kw = dict(rollout_logprobs=x["rollout_logprobs"], tis_cap=2.0) if tis else {}

    def grad(lp, adv):
        lp = lp.clone().requires_grad_()
        loss, _ = crf.ppo_policy_loss(lp, x["old_logprobs"], adv, mask, backend=backend, **kw)
        loss.backward()
        return loss, lp.grad

    _, want = grad(x["logprobs"], x["advantages"])
    lp, adv = x["logprobs"].clone(), x["advantages"].clone()
    lp[i], adv[i] = x["old_logprobs"][i] + 100.0, 0.0
    loss, got = grad(lp, adv)
    assert loss.isfinite() and got[i].item() == 0.0
    others = torch.arange(20000) != i
    assert torch.equal(got[others].view(torch.int32), want[others].view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("where", ["logprobs", "old_logprobs", "advantages", "rollout_logprobs"])
def test_nan_on_a_trainable_token_propagates(backend, where):
    x = policy_inputs(40, seed=6)
    x[where][7] = float("nan")
    mask = torch.ones(40, dtype=torch.bool)
    loss, m = crf.ppo_policy_loss(x["logprobs"], x["old_logprobs"], x["advantages"], mask,
                                  rollout_logprobs=x["rollout_logprobs"], backend=backend)
    assert loss.isnan()
    if where in ("logprobs", "old_logprobs"):  # a NaN ratio must not hide behind the max
        assert m["ratio_max"].isnan() and m["approx_kl"].isnan()


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_at_masked_positions_changes_nothing(backend, value):
    """inf/NaN at non-trainable positions of any input: loss, gradient and metrics equal those of the
    same batch with finite values there (no NaN gradient through 0 * NaN either)."""
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=7)
    x = policy_inputs(b["loss_mask"].numel(), seed=7)
    off = ~b["loss_mask"]
    dirty = {k: torch.where(off, value, t) for k, t in x.items()}
    kw = dict(cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"], reduction="segment-mean", dual_clip=3.0,
              tis_cap=2.0, backend=backend)
    out = []
    for inp in (x, dirty):
        lp = inp["logprobs"].clone().requires_grad_()
        loss, m = crf.ppo_policy_loss(lp, inp["old_logprobs"], inp["advantages"], b["loss_mask"],
                                      rollout_logprobs=inp["rollout_logprobs"], **kw)
        loss.backward()
        out.append((loss, m, lp.grad))
    (l0, m0, g0), (l1, m1, g1) = out
    assert torch.isfinite(l1) and torch.isfinite(g1).all() and (g1[off] == 0).all()
    assert torch.equal(l0, l1) and torch.equal(g0, g1) and all(torch.equal(m0[k], m1[k]) for k in m0)


# ---------------------------------------------------------------- bad offsets without the Python checks

_BAD_OFFSETS_SCRIPT = r"""
import sys, types
import torch
import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from tests.ops import _losses_cuda_host as host

if len(sys.argv) > 1:  # the CUDA kernels, run on the host, in place of the C++ loss ops
    host.route_cpp_to_cuda_host(types.SimpleNamespace(setattr=setattr), host.load(sys.argv[1]))
T = 10
ops = torch.ops.compactionrl_fast
backends = [b for b in ("cpp", "triton") if b in available(torch.device("cpu"))]
for cu in ([0, 4, 1 << 40, 10], [0, 7, 4, 10], [0, 4, 7, 1 << 30], [5, 4, 7, 10], [0, 4, 7, 8], [0, -3, 7, 10],
           [0, 1 << 62, -(1 << 62), 10], [0]):
    c = torch.tensor(cu)
    t, m, sc = torch.rand(T), torch.ones(T, dtype=torch.bool), torch.rand(c.numel() - 1, dtype=torch.float64)
    calls = {
        "op ppo_policy_loss": lambda: ops.ppo_policy_loss(t, t, t, m, None, c, sc, 0.2, 0.2, 3.0, 1e30, True),
        "op value_loss": lambda: ops.value_loss(t, t, t, m, c, sc, 0.2, True),
        "op segment_counts": lambda: ops.segment_counts(m, c),
    }
    for b in backends:
        calls[f"compiled ppo_policy_loss {b}"] = lambda: torch.compile(
            lambda lp, cu: crf.ppo_policy_loss(lp, lp.detach(), torch.ones(T), m, cu_seqlens=cu, backend=b,
                                               reduction="segment-mean"), backend="eager")(t.requires_grad_(), c)
        calls[f"compiled value_loss {b}"] = lambda: torch.compile(
            lambda v, cu: crf.value_loss(v, v.detach(), torch.ones(T), m, cu_seqlens=cu, clip=0.2, backend=b,
                                         reduction="rollout-mean"), backend="eager")(t.requires_grad_(), c)
    for name, call in calls.items():
        try:
            call()
            print(name, cu, "returned", flush=True)
        except (ValueError, RuntimeError) as e:
            assert "cu_seqlens" in str(e), (name, cu, str(e)[:500])
            print(name, cu, type(e).__name__, str(e).splitlines()[0][:150], flush=True)
print("DONE")
"""


def _run_bad_offsets(*args):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, COMPACTIONRL_FAST_CHECKS="0", PYTHONPATH=root)
    p = subprocess.run([sys.executable, "-c", _BAD_OFFSETS_SCRIPT, *args], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    # a crash (signal: negative return code) or an unclear error fails here, with the calls that ran
    assert p.returncode == 0 and p.stdout.rstrip().endswith("DONE"), (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p.stdout


@pytest.mark.slow
@pytest.mark.skipif("cpp" not in BACKENDS, reason="needs the compiled extension")
def test_bad_offsets_never_crash_the_cpp_ops():
    """cu_seqlens past T, decreasing, 2^40, negative, not starting at 0: called directly as torch ops or
    under torch.compile (where the Python checks are skipped), with COMPACTIONRL_FAST_CHECKS=0: a clear
    ValueError naming cu_seqlens, or numbers; never a crash (run in a subprocess so a crash fails the test)."""
    out = _run_bad_offsets()
    assert out.count("ValueError") >= 3 * 8  # the C++ ops check on the host


@pytest.mark.slow
@pytest.mark.skipif("cpp" not in BACKENDS, reason="the cpp backend defines the op schema")
def test_bad_offsets_never_crash_the_cuda_kernels_on_host(cuda_host_lib):
    """The CUDA loss kernels read offsets only through a bounded binary search: bad ones give wrong
    numbers, never an out-of-bounds access (no device checks run on CUDA)."""
    lib, threads = cuda_host_lib
    if threads > 32:
        pytest.skip("one block shape is enough")
    out = _run_bad_offsets(lib._name)
    assert "op ppo_policy_loss [0, 4, 1099511627776, 10] returned" in out


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_no_dual_clip_stays_off_for_an_infinite_loss(backend):
    """dual_clip=None is passed to the kernels as float32's max: with A < 0 and a ratio past float32 the
    token loss is +inf, and the dual clip must not switch on (it would cap the loss at 3.4e38 * |A|)."""
    lp = torch.tensor([600.0, 0.0], requires_grad=True)
    loss, m = crf.ppo_policy_loss(lp, torch.zeros(2), torch.tensor([-0.5, 1.0]), torch.ones(2, dtype=torch.bool),
                                  backend=backend)
    assert loss.item() == float("inf") and m["dual_clip_fraction"].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
def test_clip_boundary_tie_takes_the_unclipped_gradient(backend):
    """ratio exactly 1 + clip_high with A > 0: both branches equal; every backend and the reference give
    the unclipped branch's gradient -A * ratio (not torch.maximum's half)."""
    lp = torch.tensor([0.0, 0.0], requires_grad=True)
    loss, _ = crf.ppo_policy_loss(lp, torch.zeros(2), torch.tensor([1.0, 2.0]), torch.ones(2, dtype=torch.bool),
                                  clip_low=0.0, clip_high=0.0, backend=backend)
    loss.backward()
    assert lp.grad.tolist() == [-0.5, -1.0]


# ---------------------------------------------------------------- a zero denominator


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_denominator_is_zero_where_float32_overflows(backend):
    """denominator=0 weights every token 0: loss and gradient are 0, also on a token whose float32 loss
    overflows (log-ratio 600 with A < 0: ratio = inf in float32, finite in the float64 reference, so
    0 * inf must not turn into NaN); a NaN input still gives a NaN loss, as in the reference."""
    _check_zero_denominator(backend)


@pytest.mark.skipif("cpp" not in BACKENDS, reason="the cpp backend defines the op schema")
def test_zero_denominator_cuda_kernels_on_host(monkeypatch, cuda_host_lib):
    host.route_small_block(monkeypatch, cuda_host_lib)
    _check_zero_denominator("cpp")


def _check_zero_denominator(backend):
    T = 6
    old = torch.full((T,), -2.0)
    lp = old.clone()
    lp[2] = old[2] + 600.0
    adv = torch.tensor([0.5, -1.0, -1.0, 2.0, 0.3, -0.2])
    mask = torch.ones(T, dtype=torch.bool)
    cu, cs = torch.tensor([0, 4, 6]), torch.tensor([0, 2])
    for den in (0.0, torch.tensor(0.0)):
        for kw in ({}, dict(cu_seqlens=cu, cu_segments=cs, reduction="segment-mean")):
            want, _ = ref.ppo_policy_loss(lp.double(), old, adv, mask, denominator=den, dual_clip=None, **kw)
            assert want.item() == 0.0  # the float64 reference: exp(600) is finite there
            x = lp.clone().requires_grad_()
            loss, _ = crf.ppo_policy_loss(x, old, adv, mask, denominator=den, dual_clip=None, backend=backend, **kw)
            loss.backward()
            assert loss.item() == 0.0, (backend, den, kw, loss.item())
            assert torch.equal(x.grad, torch.zeros(T)), (backend, den, kw, x.grad)
    lp[4] = float("nan")
    loss, _ = crf.ppo_policy_loss(lp, old, adv, mask, denominator=0.0, backend=backend)
    assert ref.ppo_policy_loss(lp.double(), old, adv, mask, denominator=0.0)[0].isnan()
    assert loss.isnan(), backend


# ---------------------------------------------------------------- the Python entry on the cpp and torch backends, fast


ENTRY_BACKENDS = ("cpp", "torch")
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


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
@pytest.mark.parametrize("reduction", REDS)
def test_reductions_match_reference(backend, reduction):
    _compare(backend, _inputs(), reduction=reduction)


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
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


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
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


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
@pytest.mark.parametrize("layout", ["no_segments", "no_seqlens"])
def test_layout_defaults(backend, layout):
    inp = _inputs()
    inp["cu_segments"] = None
    if layout == "no_seqlens":
        inp["cu_seqlens"] = None
    _compare(backend, inp, reduction="rollout-mean" if layout == "no_segments" else "segment-mean")


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
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


@pytest.mark.parametrize("backend", ENTRY_BACKENDS)
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
    # routing only (8 tokens under the interpreter); the kernels: the tests above
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
