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


def test_rollout_metrics_by_hand():
    from compactionrl_fast.rollout import Rollout, Segment
    from compactionrl_fast.train.trainer import rollout_metrics

    summ = lambda n: Segment("summary", [0] * (n + 1), [False] + [True] * n, [0.0] * (n + 1))  # noqa: E731
    a = Rollout(segments=[summ(3), summ(5)], reward=1.0, compactions=2, turns=[1, 2, 3],
                info={"acc": 1, "name": "x", "flag": True})
    b = Rollout(reward=0.0, finish_reason="error", error="boom", info={"acc": 0.5, "steps": 4})
    c = Rollout(reward=0.5, finish_reason="max_turns", turns=[1], info={"success": False})
    m = rollout_metrics([a, b, c], prefix="train/")
    assert m == pytest.approx({"train/reward": 0.5, "train/success": 1 / 3, "train/compactions": 2 / 3,
                               "train/truncated": 1 / 3, "train/errors": 1 / 3, "train/turns": 4 / 3,
                               "train/summary_tokens": 4.0, "train/info/acc": 0.75, "train/info/steps": 4.0})
    assert rollout_metrics([]) == {"reward": 0.0, "success": 0.0, "compactions": 0.0, "truncated": 0.0,
                                   "errors": 0.0, "turns": 0.0, "summary_tokens": 0.0}


def test_concat_layout_and_denominator_over_micro_batches():
    from compactionrl_fast.packing import pack
    from compactionrl_fast.rollout import Rollout, Segment
    from compactionrl_fast.train.trainer import concat_layout, denominator

    seg = lambda n, on=True: Segment("exec", [0] * (n + 1), [False] + [on] * n, [0.0] * (n + 1))  # noqa: E731
    b1 = pack([Rollout(segments=[seg(2), seg(1, on=False)]), Rollout(segments=[seg(3)])])  # T 9, S 3, R 2
    b2 = pack([Rollout(segments=[seg(1), seg(2)])])  # T 5, S 2, R 1
    masks = [b1.loss_mask, b2.loss_mask.clone()]
    mask, cu_seq, cu_seg = concat_layout([b1, b2], masks)
    assert mask.tolist() == b1.loss_mask.tolist() + b2.loss_mask.tolist()
    assert cu_seq.tolist() == [0, 3, 5, 9, 11, 14] and cu_seg.tolist() == [0, 2, 3, 5]
    assert cu_seq.dtype == cu_seg.dtype == torch.int64
    assert denominator([b1, b2], masks, "sum") is None
    assert denominator([b1, b2], masks, "token-mean") == 8
    assert denominator([b1, b2], masks, "segment-mean") == 4  # the masked-out segment does not count
    assert denominator([b1, b2], masks, "rollout-mean") == 3
    masks[1][:] = False
    assert denominator([b1, b2], masks, "rollout-mean") == 2
    off = [torch.zeros_like(m) for m in masks]
    assert denominator([b1, b2], off, "token-mean") == denominator([b1, b2], off, "segment-mean") == 1  # >= 1
    mask, cu_seq, cu_seg = concat_layout([], [torch.zeros(0, dtype=torch.bool)])
    assert cu_seq.tolist() == cu_seg.tolist() == [0]
