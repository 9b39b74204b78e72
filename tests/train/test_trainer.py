"""One trainer step on hand-made batches: directions, micro-batch exactness, the ablation mask."""
import copy
import math

import pytest
import torch

from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.model import action_index, actor_logprobs, critic_values
from compactionrl_fast.train.micro_batch import policy_mask
from compactionrl_fast.train.trainer import advantages, make_state, train_step

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
    assert outs[0][2]["critic/value_loss"] == pytest.approx(outs[1][2]["critic/value_loss"], rel=1e-5)


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
    from compactionrl_fast.train.log import rollout_metrics

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


def test_compaction_metrics_by_hand():
    """train.log.compaction_metrics: the recipe's vocabulary (docs/metrics.md) of Rollout records, the scale from
    the config's GAE options; a rollout without segments counts with 0 segments."""
    from types import SimpleNamespace

    from compactionrl_fast.rollout import Rollout, Segment
    from compactionrl_fast.rollout.metrics import names
    from compactionrl_fast.train.log import compaction_metrics

    seg = lambda kind, n: Segment(kind, [0] * (n + 1), [False] + [True] * n, [0.0] * (n + 1))  # noqa: E731
    a = Rollout(segments=[seg("exec", 3), seg("summary", 2), seg("exec", 1)], compactions=1, finish_reason="max_turns")
    b = Rollout(segments=[seg("exec", 4)], finish_reason="done")
    c = Rollout(finish_reason="error", error="boom")
    cfg = SimpleNamespace(gamma=1.0, lam=0.5, cross_segment="paper", adaptive_alpha=1.5, adaptive_length="rollout")
    m = compaction_metrics([a, b, c], cfg)
    assert set(m) == names(reasons=("done", "error", "max_turns"))
    assert m == pytest.approx({
        "compaction/rollouts": 3, "compaction/compactions_per_rollout/mean": 1 / 3,
        "compaction/compactions_per_rollout/max": 1, "compaction/segments_per_rollout/mean": 4 / 3,
        "compaction/segments_per_rollout/max": 3, "compaction/summary_tokens_per_rollout/mean": 2 / 3,
        "compaction/summary_tokens_per_rollout/max": 2, "compaction/trainable_tokens_per_segment/exec/mean": 8 / 3,
        "compaction/trainable_tokens_per_segment/summary/mean": 2, "compaction/trainable_tokens_share/exec": 0.8,
        "compaction/trainable_tokens_share/summary": 0.2, "compaction/cross_segment_scale/mean": 2.625 / 4,
        "compaction/cross_segment_scale/min": 0.125, "compaction/finish_reason/done": 1 / 3,
        "compaction/finish_reason/error": 1 / 3, "compaction/finish_reason/max_turns": 1 / 3})
    assert set(compaction_metrics([a, b, c])) == names(reasons=("done", "error", "max_turns"), scale=False)
    assert compaction_metrics([]) == {}


def test_concat_layout_and_denominator_over_micro_batches():
    from compactionrl_fast.packing import pack
    from compactionrl_fast.rollout import Rollout, Segment
    from compactionrl_fast.train.micro_batch import concat_layout, denominator

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


def _grad_norm(params):
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None)))


def _token_rollout(b, idx):
    """Rollout index [N] of each selected position."""
    seg = torch.searchsorted(b.cu_seqlens, idx, right=True) - 1
    return torch.searchsorted(b.cu_segments, seg, right=True) - 1


@pytest.mark.parametrize("reduction,tis_cap,summaries", [("token-mean", None, True), ("rollout-mean", 1.1, True),
                                                        ("token-mean", 1.1, True), ("token-mean", 1.1, False)])
def test_train_step_metric_values_equal_a_direct_computation(reduction, tis_cap, summaries):
    """Every metric of one step (one micro-batch, one epoch: ratio 1) against the losses written out by hand on
    copies of the models taken before the step; the clipped gradients after it have norm max_grad_norm. Without
    summary tokens in the policy loss (the ablation) the actor's metrics cover exec tokens only."""
    actor, critic = tiny_models()
    b = hand_batch()
    g = torch.Generator().manual_seed(1)
    # sampler log-probs from -7 to -1 around the actor's (~-3.5): the weight cap binds on some tokens only
    b.rollout_logprobs = -6 * torch.rand(b.loss_mask.numel(), generator=g) - 1.0
    cfg = _cfg(temperature=0.7, max_grad_norm=1e-3, tis_cap=tis_cap, loss_reduction=reduction,
               train_summary_tokens=summaries)
    state = make_state(cfg, actor, critic)
    a0, c0 = copy.deepcopy(actor), copy.deepcopy(critic)
    idx = action_index(b.loss_mask, b.cu_attn)
    m = b.loss_mask[idx]
    # critic: 0.5 * token mean of (v - R)^2 (the old values are v: no clipping)
    v = critic_values(c0, b, idx)
    adv, ret = advantages(b, torch.zeros(b.loss_mask.numel()).index_put_((idx,), v.detach()), cfg)
    vl = 0.5 * ((v - ret[idx]) ** 2)[m].sum() / m.sum()
    vl.backward()
    m = policy_mask(b, cfg)[idx]
    assert summaries or 0 < int(m.sum()) < int(b.loss_mask.sum())
    # actor: ratio 1, loss -(w * A * ratio) reduced per token or per rollout; w the truncated importance weight
    logp, ent = actor_logprobs(a0, b, idx, temperature=0.7, return_entropy=True)
    roll = b.rollout_logprobs[idx]
    w = torch.ones_like(logp) if tis_cap is None else torch.clamp(torch.exp(logp.detach() - roll), max=tis_cap)
    if tis_cap is not None:
        assert bool((w[m] == tis_cap).any()) and bool((w[m] < tis_cap).any())
    per_tok = -(w * adv[idx] * torch.exp(logp - logp.detach()))
    if reduction == "token-mean":
        pl = per_tok[m].sum() / m.sum()
    else:
        r = _token_rollout(b, idx)[m]
        R = int(r.max()) + 1
        n_r = torch.zeros(R).index_add_(0, r, torch.ones(r.numel()))
        s_r = torch.zeros(R).index_add_(0, r, per_tok[m])
        pl = (s_r[n_r > 0] / n_r[n_r > 0]).sum() / int((n_r > 0).sum())
    pl.backward()
    lr = logp.detach()[m] - roll[m]

    out = train_step(state, [b], diagnose=False)
    assert out["critic/value_loss"] == pytest.approx(float(vl.detach()), rel=1e-5)
    assert out["critic_grad_norm"] == pytest.approx(_grad_norm(c0.parameters()), rel=1e-4)
    assert out["actor/policy_loss"] == pytest.approx(float(pl.detach()), rel=1e-5, abs=1e-7)
    assert out["actor/grad_norm"] == pytest.approx(_grad_norm(a0.parameters()), rel=1e-4)
    assert out["actor/rollout_kl"] == pytest.approx(float((torch.expm1(lr) - lr).mean()), rel=1e-5)
    assert out["actor/rollout_logp_absdiff_max"] == pytest.approx(float(lr.abs().max()), rel=1e-6)
    assert out["actor/entropy"] == pytest.approx(float(ent.detach()[m].mean()), rel=1e-5)
    assert out["actor/clip_fraction"] == 0.0 and out["actor/ratio_max"] == pytest.approx(1.0)
    assert "critic/clip_fraction" in out
    # the step clipped both gradients (left in place) to max_grad_norm
    assert out["actor/grad_norm"] > 1e-3 and out["critic_grad_norm"] > 1e-3
    assert _grad_norm(actor.parameters()) == pytest.approx(1e-3, rel=1e-4)
    assert _grad_norm(critic.parameters()) == pytest.approx(1e-3, rel=1e-4)


def test_critic_updates_zero_and_value_clip():
    b = hand_batch()
    actor, critic = tiny_models()
    before = copy.deepcopy(critic.state_dict())
    out = train_step(make_state(_cfg(critic_updates_per_step=0), actor, critic), [b], diagnose=False)
    assert "critic_grad_norm" not in out and out["critic/value_loss"] > 0
    for k, v in critic.state_dict().items():
        assert torch.equal(v, before[k])
    # a second critic update sees old values != current ones: a binding value clip changes that update
    weights = []
    for clip in (None, 1e-4):
        actor, critic = tiny_models()
        train_step(make_state(_cfg(critic_updates_per_step=2, value_clip=clip), actor, critic), [b],
                   update_actor=False, diagnose=False)
        weights.append(critic.weight.detach().clone())
    assert not torch.equal(weights[0], weights[1])


def test_two_epochs_of_one_minibatch_move_off_the_behaviour_policy():
    b = hand_batch()
    actor, critic = tiny_models()
    m = train_step(make_state(_cfg(ppo_epochs=2, actor_lr=3e-3), actor, critic), [b], diagnose=False)
    assert m["actor/ratio_max"] > 1 and m["actor/approx_kl"] > 0
    # the behaviour log-probs are taken at the sampling temperature: with an actor that barely moves, the
    # ratio stays 1
    actor, critic = tiny_models()
    m = train_step(make_state(_cfg(ppo_epochs=2, actor_lr=1e-12, temperature=0.6), actor, critic), [b], diagnose=False)
    assert m["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)


def test_diagnostic_histograms_come_from_the_first_micro_batch():
    from compactionrl_fast.train import diagnostics
    from compactionrl_fast.train.micro_batch import MicroBatch
    from compactionrl_fast.train.readout import read

    b0, b1 = hand_batch(seed=0), hand_batch(seed=1, rollouts=((6, 8), (10, 5, 7)))
    actor, critic = tiny_models()
    cfg = _cfg()
    idx = action_index(b0.loss_mask, b0.cu_attn)
    with torch.no_grad():
        values = torch.zeros(b0.loss_mask.numel()).index_put_((idx,), critic_values(critic, b0, idx))
    adv, ret = advantages(b0, values, cfg)
    want = read(diagnostics.batch_diagnostics(MicroBatch.build(b0, cfg), adv, values, ret))
    lists = {k: v for k, v in want.items() if isinstance(v, list)}
    assert lists
    out = train_step(make_state(cfg, actor, critic), [b0, b1], update_actor=False)
    for k, v in lists.items():
        assert out[k] == v
    assert "gap_abs_mean" not in out  # the paper-vs-stitched gap only when asked


def test_split_rollouts_and_micro_batches(monkeypatch):
    from types import SimpleNamespace

    from compactionrl_fast.train import loop
    from compactionrl_fast.train.loop import micro_batches, split_rollouts

    monkeypatch.setattr(loop, "layout_on", lambda b, cfg, device: b.to(device))

    ro = lambda *segs: SimpleNamespace(segments=[[0] * n for n in segs], n=sum(segs))  # noqa: E731
    sizes = lambda groups: [[r.n for r in g] for g in groups]  # noqa: E731
    assert sizes(split_rollouts([ro(1, 2), ro(4), ro(2), ro(6), ro(1)], 7)) == [[3, 4], [2], [6, 1]]
    assert sizes(split_rollouts([ro(10), ro(1), ro(9)], 5)) == [[10], [1], [9]]  # alone when over the limit
    assert split_rollouts([], 5) == []

    class Packed:
        def __init__(self, g):
            self.sizes, self.device = [r.n for r in g], None

        def to(self, device):
            self.device = device
            return self

    rollouts = [ro(n) for n in (3, 3, 3, 3, 3)]
    for k, tokens, want_sizes, want_groups in [
        (2, 6, [[3, 3], [3, 3], [3]], [[0], [1, 2]]),
        (1, 9, [[3, 3, 3], [3, 3]], [[0, 1]]),
        (9, 100, [[3]] * 5, [[0], [1], [2], [3], [4]]),  # at most one mini-batch per rollout
    ]:
        cfg = SimpleNamespace(ppo_minibatches=k, micro_batch_tokens=tokens)
        batches, groups = micro_batches(rollouts, cfg, Packed, device="meta")
        assert [b.sizes for b in batches] == want_sizes and groups == want_groups
        assert all(b.device == "meta" for b in batches)


def test_make_state_passes_the_optimiser_settings():
    actor, critic = tiny_models()
    cfg = _cfg(actor_lr=2e-4, critic_lr=5e-3, adam_betas=(0.8, 0.9), adam_eps=1e-5, weight_decay=0.01)
    state = make_state(cfg, actor, critic, group="g")
    assert state.group == "g" and state.step == 0
    for opt, lr, model in ((state.opt_actor, 2e-4, actor), (state.opt_critic, 5e-3, critic)):
        pg = opt.param_groups[0]
        assert (pg["lr"], pg["betas"], pg["eps"], pg["weight_decay"]) == (lr, (0.8, 0.9), 1e-5, 0.01)
        assert [id(p) for p in pg["params"]] == [id(p) for p in model.parameters()]


def test_save_and_load_state_keep_the_extras(tmp_path):
    from compactionrl_fast.train import checkpoint
    from compactionrl_fast.train.trainer import load_state, save_state

    state = make_state(_cfg(), *tiny_models())
    state.step, state.extra = 5, {"sft_done": True}
    save_state(state, str(tmp_path))
    other = make_state(_cfg(), *tiny_models(seed=1))
    load_state(other, str(tmp_path))
    assert other.step == 5 and other.extra == {"sft_done": True}
    info = checkpoint.load(str(tmp_path), models={"actor": other.actor, "critic": other.critic},
                           optimizers={"actor": other.opt_actor, "critic": other.opt_critic})
    assert info["extra"]["config"]["actor_lr"] == 1e-3


def test_token_weighted_mean():
    from compactionrl_fast.train.readout import Means

    acc = Means()
    acc.add({"a": torch.tensor(1.0), "b": float("nan"), "c": 4.0}, 1.0)
    acc.add({"a": 3, "c": 1.0}, 3.0)
    acc.add({"d": 2.0}, 0.0)  # weight 0: no value
    assert acc.result("x/") == {"x/a": 2.5, "x/c": 1.75}


def test_read_rows_skips_cut_and_foreign_lines(tmp_path):
    from compactionrl_fast.train.log import read_rows

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1, "x"\n[1, 2]\n{"step": 2}\n')
    assert read_rows(str(p)) == [{"step": 0}, {"step": 2}]


def test_metrics_log_sends_finite_numbers_to_tensorboard(tmp_path):
    from compactionrl_fast.train.log import MetricsLog

    class TB:
        def __init__(self):
            self.calls = []

        def add_scalar(self, k, v, step):
            self.calls.append((k, v, step))

    log = MetricsLog(str(tmp_path), tensorboard=False)
    log.tb = TB()
    log.log(7, {"a": 1.5, "b": float("inf"), "c": True, "d": "x", "e": 2, "f": [1.0]})
    assert log.tb.calls == [("a", 1.5, 7), ("e", 2, 7)]


class _FakeWorld:
    """Rank `rank` of 2 for train/dist.world and torch.distributed: all_reduce adds the other rank's tensor,
    which is this one's plus 1, 2, 3, ... by position (known, so the sum tells where each value went);
    all_gather_object gives this rank's object for both."""

    def __init__(self, monkeypatch, rank=0, backend="gloo"):
        from compactionrl_fast.train import dist

        self.calls, self.backend_groups = [], []
        monkeypatch.setattr(dist, "world", lambda: (rank, 2))
        monkeypatch.setattr(torch.distributed, "get_backend",
                            lambda group=None: self.backend_groups.append(group) or backend)
        monkeypatch.setattr(torch.distributed, "all_reduce", self.all_reduce)
        # all_gather_object (the loop's compaction/... facts): every rank's object is this one's
        monkeypatch.setattr(torch.distributed, "all_gather_object",
                            lambda out, obj, group=None: self.calls.append(("object", "cpu", len(out), group))
                            or out.__setitem__(slice(None), [obj] * len(out)))

    def all_reduce(self, t, op=None, group=None):
        self.calls.append((t.dtype, t.device.type, t.numel(), group))
        other = t + torch.arange(1, t.numel() + 1, dtype=t.dtype)
        if op == torch.distributed.ReduceOp.MAX:
            t.copy_(torch.maximum(t, other))
        else:
            t.add_(other)


def test_global_max_in_a_two_rank_world(monkeypatch):
    from compactionrl_fast.train.dist import global_max

    assert global_max(2.5) == 2.5
    w = _FakeWorld(monkeypatch)
    assert global_max(3.0, group="g") == 4.0 and w.calls == [(torch.float64, "cpu", 1, "g")]
    assert global_max(float("nan")) == float("inf")  # a NaN gap on any rank fails the guard on every rank


def test_global_sum_and_all_reduce_grads_in_a_two_rank_world(monkeypatch):
    from compactionrl_fast.train.dist import all_reduce_grads, global_sum

    assert global_sum(2.5) == 2.5 and isinstance(global_sum(True), float)  # one process: itself
    p = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(1))]
    p[0].grad, p[2].grad = torch.full((2, 2), 1.0), torch.full((1,), 5.0)
    all_reduce_grads(p)
    assert p[1].grad is None  # one process: untouched
    w = _FakeWorld(monkeypatch)
    assert global_sum(3, group="g") == 7.0
    assert w.calls == [(torch.float64, "cpu", 1, "g")] and w.backend_groups == ["g"]
    all_reduce_grads(iter(p), group="g")  # one flat buffer [4 + 3 + 1]; the missing grad joins as zeros
    assert w.calls[-1] == (torch.float32, "cpu", 8, "g")
    assert p[0].grad.tolist() == [[3.0, 4.0], [5.0, 6.0]]
    assert p[1].grad.tolist() == [5.0, 6.0, 7.0]
    assert p[2].grad.tolist() == [18.0]
    n = len(w.calls)
    all_reduce_grads([])
    assert len(w.calls) == n  # nothing to reduce


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA tensor is asked for where none can be made")
@pytest.mark.parametrize("fn", ["global_sum", "global_max"])
def test_host_numbers_go_through_the_gpu_over_nccl(monkeypatch, fn):
    from compactionrl_fast.train import dist

    w = _FakeWorld(monkeypatch, backend="nccl")
    with pytest.raises((AssertionError, RuntimeError), match="(?i)compiled with cuda|nvidia driver|no cuda gpus"):
        getattr(dist, fn)(1.0, group="g")
    assert w.backend_groups == ["g"] and w.calls == []


def test_evaluate_splits_seeds_over_ranks_and_averages(monkeypatch):
    from types import SimpleNamespace

    from compactionrl_fast.rollout import loop
    from compactionrl_fast.train.loop import evaluate

    calls = []

    def run_rollouts(engine, envs, tok, c, seeds, chat=None):
        calls.append((list(seeds), c.seed, c.temperature, chat))
        return [SimpleNamespace(reward=1.0, success=True, compactions=2, truncated=False, finish_reason="stop",
                                turns=[1], summary_lengths=[4], info={"acc": 0.5}) for _ in seeds]

    cfg = SimpleNamespace(replace=lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(loop, "run_rollouts", run_rollouts)
    _FakeWorld(monkeypatch, rank=1)
    m, ro = evaluate(None, lambda n: [None] * n, None, cfg, 7, temperature=0.3, seed_base=10, chunk=2, chat="c")
    assert calls == [([11, 13], 11, 0.3, "c"), ([15], 11, 0.3, "c")]
    assert len(ro) == 3
    # the other rank holds 3 + 1 rollouts and the sums plus 1: fixed keys averaged over 7 rollouts,
    # the environments' keys stay this rank's
    assert m["reward"] == pytest.approx((3.0 + 4.0) / 7)
    assert m["compactions"] == pytest.approx((6.0 + 7.0) / 7) and m["summary_tokens"] == pytest.approx(25.0 / 7)
    assert m["info/acc"] == 0.5


@pytest.mark.parametrize("change", [dict(clip_low=0.01), dict(clip_high=0.01), dict(dual_clip=1.001)])
def test_each_clip_reaches_the_actor_loss(change):
    """Two epochs (the second one off-policy): changing one clip setting changes the actor's update."""
    b = hand_batch()
    weights = []
    for kw in ({}, change):
        actor, critic = tiny_models()
        train_step(make_state(_cfg(ppo_epochs=2, actor_lr=1e-2, **kw), actor, critic), [b], diagnose=False)
        weights.append(copy.deepcopy(actor.state_dict()))
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_optim_step_norm_and_reduction(monkeypatch):
    from compactionrl_fast.train.trainer import optim_step

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    assert optim_step([p], opt, 1.0, None) == 0.0  # no gradients: nothing to clip
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert float(optim_step([p], opt, None, None)) == 5.0 and p.tolist() == [-3.0, -4.0, 0.0]
    w = _FakeWorld(monkeypatch)
    p.grad = torch.tensor([0.0, 0.0, 0.0])
    assert float(optim_step(iter([p]), opt, None, "g")) == pytest.approx(float(torch.tensor([1.0, 2, 3]).norm()))
    assert w.calls == [(torch.float32, "cpu", 3, "g")]


def test_train_step_passes_the_group_to_every_reduction(monkeypatch):
    import compactionrl_fast.ops as ops

    groups = []
    real_count, real_den = ops.global_token_count, ops.global_denominator

    def count(mask, group=None, **kw):
        groups.append(("count", group))
        return real_count(mask, **kw)

    def den(reduction, mask, group=None, **kw):
        groups.append(("den", group))
        return real_den(reduction, mask, **kw)

    monkeypatch.setattr(ops, "global_token_count", count)
    monkeypatch.setattr(ops, "global_denominator", den)
    w = _FakeWorld(monkeypatch)
    actor, critic = tiny_models()
    train_step(make_state(_cfg(loss_reduction="segment-mean"), actor, critic, group="g"), [hand_batch()],
               diagnose=False)
    assert groups == [("den", "g"), ("den", "g")]  # critic (token-mean), actor (segment-mean): once per step
    assert len(w.calls) == 2 and all(c[3] == "g" for c in w.calls)  # the critic's and the actor's gradients


def test_micro_batches_default_to_cpu_and_one_rollout_metrics(monkeypatch):
    from types import SimpleNamespace

    from compactionrl_fast.rollout import Rollout
    from compactionrl_fast.train import loop
    from compactionrl_fast.train.log import rollout_metrics
    from compactionrl_fast.train.loop import micro_batches

    monkeypatch.setattr(loop, "layout_on", lambda b, cfg, device: b.to(device))

    devices = []
    pack = lambda g: SimpleNamespace(to=lambda d: devices.append(d) or d)  # noqa: E731
    micro_batches([SimpleNamespace(segments=[[0]])], SimpleNamespace(ppo_minibatches=1, micro_batch_tokens=5), pack)
    assert devices == ["cpu"]
    m = rollout_metrics([Rollout(reward=0.5, compactions=3)])
    assert m["reward"] == 0.5 and m["compactions"] == 3.0


def test_evaluate_default_chunk_and_a_rank_without_rollouts(monkeypatch):
    from types import SimpleNamespace

    from compactionrl_fast.rollout import loop
    from compactionrl_fast.train.loop import evaluate

    sizes = []

    def run_rollouts(engine, envs, tok, c, seeds, chat=None):
        sizes.append(len(seeds))
        return [SimpleNamespace(reward=1.0, success=True, compactions=0, truncated=False, finish_reason="stop",
                                turns=[], summary_lengths=[], info={}) for _ in seeds]

    monkeypatch.setattr(loop, "run_rollouts", run_rollouts)
    cfg = SimpleNamespace(replace=lambda **kw: SimpleNamespace(**kw))
    evaluate(None, lambda n: [None] * n, None, cfg, 129, temperature=0.0)
    assert sizes == [128, 1]
    _FakeWorld(monkeypatch, rank=1)
    m, ro = evaluate(None, lambda n: [None] * n, None, cfg, 1, temperature=0.0)  # rank 1 gets no seed of 1
    assert ro == [] and m["reward"] == 1.0  # the other rank's sums (0 + 1) over its count (0 + 1)


def test_denominators_stay_on_the_device_over_nccl(monkeypatch):
    """Over NCCL ranks the global count is all-reduced on the training device and stays a tensor there (no
    host read); the step takes it as the losses' denominator."""
    from compactionrl_fast.train.micro_batch import denominator

    b = hand_batch()
    assert denominator([b], [b.loss_mask], "token-mean") == int(b.loss_mask.sum())  # one process: an int
    _FakeWorld(monkeypatch, backend="nccl")
    d = denominator([b], [b.loss_mask], "token-mean", group="g", device="cpu")
    assert isinstance(d, torch.Tensor) and d.dim() == 0 and int(d) == int(b.loss_mask.sum())
    off = denominator([b], [torch.zeros_like(b.loss_mask)], "rollout-mean", group="g", device="cpu")
    assert int(off) == 1  # at least 1
    actor, critic = tiny_models()
    m = train_step(make_state(_cfg(), actor, critic, group="g"), [b], diagnose=False)
    assert math.isfinite(m["actor/policy_loss"]) and math.isfinite(m["critic/value_loss"])


def test_advantages_use_the_rewards_they_are_given():
    from compactionrl_fast.train.micro_batch import placed_rewards

    b = hand_batch()
    cfg = _cfg()
    zero = torch.zeros(b.loss_mask.numel())
    _, ret = advantages(b, zero, cfg)
    _, ret2 = advantages(b, zero, cfg, 2 * placed_rewards(b, cfg))
    assert bool(ret.abs().max() > 0) and torch.equal(ret2, 2 * ret)  # lam 1, zero values: returns are rewards-to-go


def test_a_step_reads_the_layout_it_is_given(monkeypatch):
    """On `micro_batch.MicroBatch`es the step derives no layout again: no placed rewards, segment ids or forward
    tables, in every branch (epochs, mini-batches, the gap diagnostics, a critic-only step measuring the gap)."""
    from compactionrl_fast.train import diagnostics, micro_batch, model
    from compactionrl_fast.train.micro_batch import MicroBatch

    cfg = _cfg(ppo_epochs=2, ppo_minibatches=2)
    mbs = [MicroBatch.build(hand_batch(seed=s), cfg) for s in (0, 1, 2)]

    def boom(*a, **k):
        raise AssertionError("layout derived again")
    for mod, name in ((micro_batch, "placed_rewards"), (model, "forward_tables"), (model, "action_index"),
                      (diagnostics, "segment_ids"), (micro_batch, "policy_mask")):
        monkeypatch.setattr(mod, name, boom)
    actor, critic = tiny_models()
    state = make_state(cfg, actor, critic)
    out = train_step(state, mbs, minibatches=[[0], [1, 2]], advantage_gap=True)
    assert math.isfinite(out["actor/policy_loss"]) and "gap_abs_mean" in out
    out = train_step(state, mbs, update_actor=False, measure_sampler_gap=True, diagnose=False)
    assert out["sampler/logp_absdiff_max"] > 0


def _logprob_calls(monkeypatch):
    """Record (batch, grad enabled) of every actor log-prob pass the step makes."""
    from compactionrl_fast.train import trainer

    calls, real = [], trainer.actor_logprobs

    def counted(actor, batch, *a, **k):
        calls.append((batch, torch.is_grad_enabled()))
        return real(actor, batch, *a, **k)
    monkeypatch.setattr(trainer, "actor_logprobs", counted)
    return calls


@pytest.mark.parametrize("epochs,minibatches,behaviour,updates", [
    (1, [[0], [1], [2]], [1, 2], 3),  # one epoch: the first mini-batch is trained before any step
    (1, [[0], [1]], [1], 2),  # a micro-batch in no mini-batch gets no pass
    # more epochs: the first mini-batch's live log-probs of the first epoch are kept as its behaviour ones
    (2, [[0], [1]], [1], 4),
    (2, [[1, 2]], [], 4),
    (3, [[2], [0, 1]], [0, 1], 9),
])
def test_behaviour_passes_only_where_a_step_came_before(monkeypatch, epochs, minibatches, behaviour, updates):
    bs = [hand_batch(seed=s) for s in (0, 1, 2)]
    calls = _logprob_calls(monkeypatch)
    actor, critic = tiny_models()
    train_step(make_state(_cfg(ppo_epochs=epochs), actor, critic), bs, minibatches=minibatches, diagnose=False)
    ids = [id(b) for b in bs]
    assert [ids.index(id(b)) for b, grad in calls if not grad] == behaviour
    assert sum(grad for _, grad in calls) == updates


def test_ppo_epochs_start_at_ppo_epochs_from(monkeypatch):
    """Actor updates before `ppo_epochs_from` make one pass (no behaviour pass: ratio 1), later ones ppo_epochs."""
    b = hand_batch()
    calls = _logprob_calls(monkeypatch)
    actor, critic = tiny_models()
    state = make_state(_cfg(ppo_epochs=3, ppo_epochs_from=1, value_pretrain_steps=1, actor_lr=3e-3), actor, critic)
    passes = []
    for step in range(1, 4):  # actor updates 0..2
        state.step = step
        calls.clear()
        m = train_step(state, [b], diagnose=False)
        passes.append(len(calls))
        assert (m["actor/ratio_max"] == pytest.approx(1.0)) == (step < 2)
    assert passes == [1, 3, 3]  # 3 epochs: 3 updates; the first one's log-probs are the behaviour ones


def test_the_sampler_gap_of_a_critic_only_step_only_when_asked():
    b = hand_batch()
    b.rollout_logprobs = -torch.rand(b.loss_mask.numel(), generator=torch.Generator().manual_seed(2)) - 3
    actor, critic = tiny_models()
    state = make_state(_cfg(temperature=0.8), actor, critic)
    assert "sampler/logp_absdiff_max" not in train_step(state, [b], update_actor=False, diagnose=False)
    idx = action_index(b.loss_mask, b.cu_attn)
    with torch.no_grad():
        want = float((actor_logprobs(actor, b, idx, temperature=0.8) - b.rollout_logprobs[idx]).abs().max())
    out = train_step(state, [b], update_actor=False, measure_sampler_gap=True, diagnose=False)
    assert out["sampler/logp_absdiff_max"] == pytest.approx(want, rel=1e-6)


def test_a_step_without_batches_is_an_error():
    actor, critic = tiny_models()
    with pytest.raises(ValueError, match="batches is empty"):
        train_step(make_state(_cfg(), actor, critic), [])
