"""ppo_policy_loss: reference vs hand-computed values and the common trainers' token-mean and
per-sequence-mean formulations; every backend vs the float64 reference (loss, gradient, metrics) on packed
batches from the shape table, every reduction with and without a denominator, every clip variant;
fully-masked and empty batches; determinism; torch.compile; bad inputs."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import losses as ref
from tests.ops import _losses_cuda_host as host
from tests.utils import SHAPE_TABLE, packed_batch, random_case

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
    b = packed_batch(SHAPE_TABLE["long_multiblock"], seed=2)
    x = policy_inputs(b["loss_mask"].numel(), seed=2)
    runs = []
    threads = torch.get_num_threads()
    for n_threads in (1, threads, 1):
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
def test_repeated_backward_is_right_or_fails_loudly(backend, scale):
    """The backward hands out the saved gradient buffer itself (one [T] buffer in all), scaled in place
    unless the incoming gradient is 1. Backward passes through a retained graph must then give the
    right accumulated gradient or raise (autograd's version counter), never a wrong one."""
    b = packed_batch(SHAPE_TABLE["odd_lengths"], seed=1)
    x = policy_inputs(b["loss_mask"].numel(), seed=1)
    lp = x["logprobs"].clone().requires_grad_()
    loss, _ = crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], b["loss_mask"], backend=backend)
    (scale * loss).backward(retain_graph=True)
    g1 = lp.grad.clone()
    for k in (2, 3):
        try:
            (scale * loss).backward(retain_graph=True)
        except RuntimeError as e:
            assert "inplace" in str(e)
            break
        torch.testing.assert_close(lp.grad, k * g1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_and_half_precision_inputs(backend):
    b = packed_batch(SHAPE_TABLE["odd_lengths"], seed=1)
    x = policy_inputs(b["loss_mask"].numel(), seed=1)
    with torch.no_grad():
        loss, _ = crf.ppo_policy_loss(x["logprobs"], x["old_logprobs"], x["advantages"], b["loss_mask"],
                                      backend=backend)
    want, _ = ref.ppo_policy_loss(x["logprobs"], x["old_logprobs"], x["advantages"], b["loss_mask"])
    assert abs(loss.item() - float(want)) < 1e-5
    lp = x["logprobs"].to(torch.bfloat16).requires_grad_()
    loss, _ = crf.ppo_policy_loss(lp, x["old_logprobs"], x["advantages"], b["loss_mask"], backend=backend)
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and lp.grad.shape == lp.shape


# ---------------------------------------------------------------- CUDA kernels, run on the host


@pytest.mark.skipif("cpp" not in BACKENDS, reason="the cpp backend defines the op schema")
@pytest.mark.parametrize("case", ["single_token", "empty_segments", "no_trainable", "long_multiblock"])
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
