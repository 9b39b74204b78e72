"""One trainer step on hand-made batches: directions, micro-batch exactness, the ablation mask."""
import copy

import pytest
import torch

from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.model import action_index, actor_logprobs, critic_values
from compactionrl_fast.train.trainer import advantages, make_state, policy_mask, train_step

from ._tiny import hand_batch, tiny_models, tiny_rollouts


def _cfg(**kw):
    base = dict(actor_lr=1e-3, critic_lr=1e-2, critic_updates_per_step=1, max_grad_norm=None, lam=1.0)
    base.update(kw)
    return TrainConfig(**base)


def test_actor_step_raises_logprobs_of_positive_advantage_tokens():
    actor, critic = tiny_models()
    b = hand_batch()
    state = make_state(_cfg(), actor, critic)
    idx = action_index(b.loss_mask, b.cu_attn)
    with torch.no_grad():
        before = actor_logprobs(actor, b, idx)
        values = torch.zeros(b.loss_mask.numel()).index_put_((idx,), critic_values(critic, b, idx))
    adv, _ = advantages(b, values, state.cfg)
    train_step(state, [b], diagnose=False)
    with torch.no_grad():
        after = actor_logprobs(actor, b, idx)
    a = adv[idx]
    assert bool((a > 0).any()) and bool((a < 0).any())
    # the surrogate objective sum(A * ratio) went up: first-order improvement of the policy loss
    assert float((a * torch.exp(after - before)).sum()) > float(a.sum())
    assert float((after - before)[a > 0].mean()) > 0 > float((after - before)[a < 0].mean())


def test_value_pretraining_lowers_value_loss():
    actor, critic = tiny_models()
    b = hand_batch()
    state = make_state(_cfg(critic_lr=3e-3), actor, critic)
    actor_before = copy.deepcopy(actor.state_dict())
    losses = [train_step(state, [b], update_actor=False, diagnose=False)["critic/value_loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]
    # critic-only steps leave the actor alone
    for k, v in actor.state_dict().items():
        assert torch.equal(v, actor_before[k])


def test_micro_batches_equal_one_batch():
    rollouts = tiny_rollouts(6)
    from compactionrl_fast.packing import pack

    outs = []
    for groups in ([rollouts], [rollouts[:1], rollouts[1:4], rollouts[4:]]):
        actor, critic = tiny_models()
        state = make_state(_cfg(critic_updates_per_step=2, loss_reduction="token-mean"), actor, critic)
        m = train_step(state, [pack(g, prefix_sharing=True) for g in groups], diagnose=False)
        # gradients of the last update, then weights (Adam alone would hide a wrong gradient scale)
        outs.append(({k: p.grad.clone() for k, p in [*actor.named_parameters(), *critic.named_parameters()]},
                     {**actor.state_dict(), **{"c." + k: v for k, v in critic.state_dict().items()}}, m))
    for k in outs[0][0]:
        torch.testing.assert_close(outs[0][0][k], outs[1][0][k], atol=1e-6, rtol=1e-5)
    for k in outs[0][1]:
        torch.testing.assert_close(outs[0][1][k], outs[1][1][k], atol=1e-6, rtol=1e-5)
    assert abs(outs[0][2]["actor/policy_loss"] - outs[1][2]["actor/policy_loss"]) < 1e-6


def test_ablation_takes_summary_tokens_out_of_the_policy_loss_only():
    b = hand_batch()
    full = policy_mask(b, _cfg())
    abl = policy_mask(b, _cfg(train_summary_tokens=False))
    kind = torch.repeat_interleave(b.segment_kind.long(), b.cu_seqlens.diff())
    assert torch.equal(full, b.loss_mask)
    assert torch.equal(abl, b.loss_mask & (kind == 0))
    # the actor's summary-token log-probs get no direct gradient: a step with only summary tokens
    # carrying advantage leaves the actor unchanged
    actor, critic = tiny_models()
    state = make_state(_cfg(train_summary_tokens=False), actor, critic)
    b.rollout_rewards.zero_()
    before = copy.deepcopy(actor.state_dict())
    train_step(state, [b], diagnose=False)  # zero rewards, zero values: zero advantages everywhere
    for k, v in actor.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)


@pytest.mark.parametrize("cfg", [
    dict(cross_segment="paper"), dict(cross_segment="none"), dict(cross_segment="stitched"),
    dict(gamma=0.97, lam="adaptive", adaptive_alpha=2.5, adaptive_length="segment", lam_critic=0.9),
    dict(gamma=0.99, lam=0.8, lam_critic=None, cross_segment="paper"),
])
def test_advantages_equal_the_reference_with_every_config_knob(cfg):
    """trainer.advantages against the float64 reference called directly, with the config's knobs spelled out
    (a trainer that dropped gamma, lam, alpha, adaptive_length, lam_critic or the reward mode fails here)."""
    from compactionrl_fast.reference import place_final_rewards as ref_place, segment_gae as ref_gae

    b = hand_batch(rollouts=((9, 5, 6), (12,), (7, 4, 10, 6)))
    values = torch.randn(b.loss_mask.numel(), generator=torch.Generator().manual_seed(3))
    c = TrainConfig(**cfg)
    adv, ret = advantages(b, values, c)
    mode = "stitched" if c.cross_segment == "stitched" else "paper"
    rew = ref_place(b.rollout_rewards, b.loss_mask, b.cu_seqlens, b.cu_segments, mode=mode)
    ref_adv, ref_ret = ref_gae(rew, values, b.loss_mask, b.cu_seqlens, b.cu_segments, gamma=cfg.get("gamma", 1.0),
                               lam=cfg.get("lam", "adaptive"), cross_segment=cfg.get("cross_segment", "paper"),
                               lam_critic=cfg.get("lam_critic", 1.0), adaptive_alpha=cfg.get("adaptive_alpha", 1.5),
                               adaptive_length=cfg.get("adaptive_length", "rollout"))
    m = b.loss_mask
    assert bool((ref_adv[m] != 0).all())
    torch.testing.assert_close(adv.double()[m], ref_adv[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double()[m], ref_ret[m], atol=1e-5, rtol=1e-5)


def test_ppo_epochs_and_minibatches_use_frozen_old_logprobs():
    from compactionrl_fast.packing import pack

    actor, critic = tiny_models()
    rollouts = tiny_rollouts(4)
    state = make_state(_cfg(ppo_epochs=2, ppo_minibatches=2, actor_lr=3e-3), actor, critic)
    batches = [pack(rollouts[:2], prefix_sharing=True), pack(rollouts[2:], prefix_sharing=True)]
    m = train_step(state, batches, minibatches=[[0], [1]], diagnose=False)
    # after the first of 4 actor steps the policy moved away from the frozen behaviour policy
    assert m["actor/approx_kl"] > 0 and m["actor/ratio_max"] > 1
