"""OpenRLHF adapter: `get_advantages_and_returns`, `PolicyLoss`, `ValueLoss` with OpenRLHF's signatures.

On one-segment (right-padded) batches they equal OpenRLHF's own functions on trainable tokens, restated
in tests/integrations/peers.py from openrlhf 0.11.2; on compacted batches they equal the packed ops.
OpenRLHF itself does not install here (flash-attn==2.8.3 needs a CUDA toolchain to build, and
DeepSpeed); the tests against it run where `openrlhf.models.loss` imports and skip with the reason
elsewhere.
"""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.integrations import openrlhf as O
from tests.integrations import peers
from tests.integrations._batches import padded_from_packed, prefix_rows
from tests.utils import SHAPE_TABLE, packed_batch, random_case

REASON = "OpenRLHF is not installable on this CPU machine (flash-attn==2.8.3 needs CUDA to build; DeepSpeed)"
LENGTHS = [0, 1, 37, 60, 2, 59]


def _batch(seed=0, L=60):
    g = torch.Generator().manual_seed(seed)
    mask = prefix_rows(LENGTHS, L).float()  # OpenRLHF keeps float/long action masks
    B = len(LENGTHS)
    return (torch.randn(B, L, generator=g), torch.randn(B, L, generator=g) * (torch.rand(B, L, generator=g) < .3),
            mask, g)


@pytest.mark.parametrize("gamma,lambd", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.9, 0.0)])
def test_gae_equals_openrlhf_on_one_segment_batches(gamma, lambd):
    values, rewards, mask, _ = _batch()
    adv, ret = O.get_advantages_and_returns(values, rewards, mask, gamma, lambd)
    want_adv, want_ret = peers.openrlhf_gae(values, rewards, mask, gamma, lambd)
    m = mask.bool()
    torch.testing.assert_close(adv[m].double(), want_adv[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret[m].double(), want_ret[m], rtol=1e-5, atol=1e-5)
    assert not adv.requires_grad and not adv[~m].any()


@pytest.mark.parametrize("case", ["four_segments", "no_trainable", "random"])
def test_gae_on_compacted_batches_equals_packed_op(case):
    b = packed_batch(random_case(7, n_rollouts=5, max_len=150) if case == "random" else SHAPE_TABLE[case], seed=3)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=4)
    adv, ret = O.get_advantages_and_returns(pad["values"], pad["rewards"], pad["mask"].float(), 1.0, 0.95,
                                            rollout_ids=ids, segment_index=pos)
    want_adv, want_ret = crf.segment_gae(**b, gamma=1.0, lam=0.95, lam_critic=None, cross_segment="paper")
    torch.testing.assert_close(adv[rows, cols], want_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret[rows, cols], want_ret, rtol=1e-6, atol=1e-6)


LOSS_SETTINGS = {
    "symmetric": dict(),
    # clip_eps_low differs from every default; the dual clip binds (ratios up to ~2.5 with A < 0)
    "asymmetric_dual": dict(clip_eps_low=0.1, clip_eps_high=0.28, dual_clip=1.5),
    "seq_mean": dict(token_level_loss=False),
    "tis": dict(is_correction_level="token", is_correction_mode="clip", is_correction_gating="ratio",
                is_correction_threshold=(0.0, 1.2)),
}


def _loss_inputs(seed=0):
    _, _, mask, g = _batch(seed)
    old = torch.randn(mask.shape, generator=g) - 1.0
    logp = (old + 0.3 * torch.randn(mask.shape, generator=g)).requires_grad_()
    adv = torch.randn(mask.shape, generator=g)
    roll = old + 0.2 * torch.randn(mask.shape, generator=g)
    return old, logp, adv, roll, mask


def _restated_kwargs(setting):
    s = LOSS_SETTINGS[setting]
    kw = dict(clip_low=s.get("clip_eps_low", 0.2), clip_high=s.get("clip_eps_high", 0.2), dual_clip=s.get("dual_clip"))
    if "is_correction_threshold" in s:
        kw["tis_cap"] = s["is_correction_threshold"][1]
    return kw, s.get("token_level_loss", True)


@pytest.mark.parametrize("setting", list(LOSS_SETTINGS))
@pytest.mark.parametrize("agg", [{}, dict(dp_size=2, batch_num_tokens=180.0, global_batch_size=7.0),
                                 dict(batch_num_tokens=90.0, global_batch_size=3.0)])
def test_policy_loss_equals_openrlhf(setting, agg):
    old, logp, adv, roll, mask = _loss_inputs()
    loss, clip_ratio, ppo_kl, vllm_kl, filtered = O.PolicyLoss(**LOSS_SETTINGS[setting])(
        logp, old, adv, action_mask=mask, rollout_log_probs=roll, **agg)
    (g,) = torch.autograd.grad(loss, logp)
    kw, token_level = _restated_kwargs(setting)
    want, want_clip, want_kl = peers.openrlhf_policy_loss(logp, old, adv, mask, rollout_logp=roll,
                                                          token_level_loss=token_level, **kw, **agg)
    (wg,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g.double(), wg.double(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(clip_ratio.double(), want_clip, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ppo_kl.double(), want_kl, rtol=1e-5, atol=1e-7)
    assert (vllm_kl is None) == (setting != "tis") and (filtered is None) == (setting != "tis")
    if setting == "tis":
        m = mask.bool()
        torch.testing.assert_close(vllm_kl.double(), (roll - old)[m].double().mean(), rtol=1e-5, atol=1e-7)
        frac = ((old - roll).exp() > 1.2)[m].double().mean()
        assert 0 < float(frac) < 1
        torch.testing.assert_close(filtered.double(), frac, rtol=1e-6, atol=1e-7)


def test_every_clip_binds_on_the_test_batch():
    """The restated loss changes when any clip of the settings is removed: the comparisons above see each."""
    old, logp, adv, roll, mask = _loss_inputs()
    kw, _ = _restated_kwargs("asymmetric_dual")
    base = peers.openrlhf_policy_loss(logp, old, adv, mask, **kw)[0]
    for change in (dict(dual_clip=None), dict(clip_low=0.2), dict(clip_high=0.2)):
        assert not torch.allclose(peers.openrlhf_policy_loss(logp, old, adv, mask, **{**kw, **change})[0], base)


def test_policy_loss_without_action_mask_uses_every_token():
    old, logp, adv, _, _ = _loss_inputs()
    loss_fn = O.PolicyLoss()
    got = loss_fn(logp, old, adv)
    want = loss_fn(logp, old, adv, action_mask=torch.ones(logp.shape))
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b)


def test_filter_ratio_counts_weights_strictly_above_the_cap():
    old, logp, adv, _, mask = _loss_inputs()
    roll = old.clone()
    roll[:, ::2] -= 0.5  # weight e^0.5 > 1 here; exactly 1 (= the cap) elsewhere
    out = O.PolicyLoss(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 1.0))(
        logp, old, adv, action_mask=mask, rollout_log_probs=roll)
    m = mask.bool()
    want = torch.zeros(mask.shape, dtype=torch.bool)
    want[:, ::2] = True
    torch.testing.assert_close(out[4].double(), want[m].double().mean())


def test_policy_loss_settings_accepted_and_refused():
    # gating defaults to "ratio"; the dual clip only needs to exceed 1
    p = O.PolicyLoss(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0, 2.0],
                     dual_clip=1.01)
    assert p.tis_cap == 2.0 and p.is_correction_threshold == (0, 2.0) and p.dual_clip == 1.01
    with pytest.raises(ValueError, match="dual_clip"):
        O.PolicyLoss(dual_clip=1.0)
    for kw in (dict(is_correction_level="seq", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0)),
               dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.5, 2.0))):
        with pytest.raises(ValueError, match="is_correction"):
            O.PolicyLoss(**kw)


def test_tensor_arguments_are_checked_by_name():
    old, logp, adv, roll, mask = _loss_inputs()
    tis = O.PolicyLoss(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0))
    bad = torch.zeros(2, 3)
    cases = [("log_probs", (bad, old, adv)), ("old_log_probs", (logp, bad, adv)), ("advantages", (logp, old, bad))]
    for name, args in cases:
        with pytest.raises(ValueError, match=f"^{name} must have shape"):
            tis(*args, action_mask=mask, rollout_log_probs=roll)
    with pytest.raises(ValueError, match="^rollout_log_probs must have shape"):
        tis(logp, old, adv, action_mask=mask, rollout_log_probs=bad)
    with pytest.raises(ValueError, match="^rollout_log_probs is required"):
        tis(logp, old, adv, action_mask=mask)
    with pytest.raises(ValueError, match="^action_mask"):
        tis(logp, old, adv, action_mask=mask * 2, rollout_log_probs=roll)


def test_policy_loss_unsupported_settings_raise():
    for kw, name in [(dict(policy_loss_type="gspo"), "policy_loss_type"), (dict(dual_clip=0.5), "dual_clip"),
                     (dict(is_correction_level="seq"), "is_correction"),
                     (dict(is_correction_level="token", is_correction_mode="mask"), "is_correction")]:
        with pytest.raises(ValueError, match=name):
            O.PolicyLoss(**kw)


@pytest.mark.parametrize("clip_eps", [None, 0.2])
@pytest.mark.parametrize("token_level_loss", [True, False])
def test_value_loss_equals_openrlhf(clip_eps, token_level_loss):
    values, returns, mask, g = _batch(seed=2)
    old = values + 0.3 * torch.randn(values.shape, generator=g)
    values.requires_grad_()
    loss = O.ValueLoss(clip_eps, token_level_loss)(values, old, returns, action_mask=mask)
    (gv,) = torch.autograd.grad(loss, values)
    want = peers.openrlhf_value_loss(values, old, returns, mask, clip_eps, token_level_loss=token_level_loss)
    (wg,) = torch.autograd.grad(want, values)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gv.double(), wg.double(), rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------- against the real OpenRLHF


@pytest.fixture(scope="module")
def openrlhf_loss():
    return pytest.importorskip("openrlhf.models.loss", reason=REASON)


@pytest.mark.parametrize("setting", list(LOSS_SETTINGS))
def test_restated_policy_loss_equals_real_openrlhf(openrlhf_loss, setting):
    old, logp, adv, roll, mask = _loss_inputs(seed=5)
    real = openrlhf_loss.PolicyLoss(**LOSS_SETTINGS[setting])(logp, old, adv, action_mask=mask, rollout_log_probs=roll)
    kw, token_level = _restated_kwargs(setting)
    want, want_clip, want_kl = peers.openrlhf_policy_loss(logp, old, adv, mask, rollout_logp=roll,
                                                          token_level_loss=token_level, **kw)
    torch.testing.assert_close(real[0].double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(real[1].double(), want_clip, rtol=1e-6, atol=1e-7)


def test_restated_gae_equals_real_openrlhf(openrlhf_loss):
    maker = pytest.importorskip("openrlhf.trainer.ppo_utils.experience_maker", reason=REASON)
    values, rewards, mask, _ = _batch(seed=6)
    # the method does not use `self`
    adv, ret = maker.RemoteExperienceMaker.get_advantages_and_returns(None, values.double(), rewards.double(),
                                                                      mask.double(), 0.99, 0.95)
    want_adv, want_ret = peers.openrlhf_gae(values, rewards, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


def test_scalar_arguments_are_checked_by_name():
    x = torch.randn(2, 5)
    with pytest.raises(TypeError, match="gamma must be a number, got str 'abc'"):
        O.get_advantages_and_returns(x, x, None, "abc", 0.95)
    with pytest.raises(TypeError, match="lambd must be a number"):
        O.get_advantages_and_returns(x, x, None, 1.0, [0.9])
    with pytest.raises(TypeError, match="clip_eps_low must be a number"):
        O.PolicyLoss(clip_eps_low=None)
    with pytest.raises(TypeError, match="dual_clip must be a number"):
        O.PolicyLoss(dual_clip="3")
    with pytest.raises(TypeError, match="^clip_eps_high must be a number"):
        O.PolicyLoss(clip_eps_high="0.2")
    with pytest.raises(TypeError, match=r"^is_correction_threshold\[1\] must be a number"):
        O.PolicyLoss(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, "2"))
    with pytest.raises(TypeError, match="clip_eps must be a number"):
        O.ValueLoss(clip_eps="0.2")
