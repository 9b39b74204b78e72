"""The float64 loss oracles (compactionrl_fast.reference.losses) on hand-computed tokens: every backend
is tested against them, so they are checked here against numbers worked out by hand."""
import math

import pytest
import torch

from compactionrl_fast.reference import losses as Lo


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


M = _t([False, True, True, False, True], torch.bool)  # segments [0, 3) (2 trainable) and [3, 5) (1 trainable)
CU = _t([0, 3, 5], torch.int64)


def test_token_weights_every_reduction():
    third, q, h = 1 / 3, 0.25, 0.5
    assert Lo.token_weights(M).tolist() == pytest.approx([0, third, third, 0, third])  # defaults: token-mean
    assert Lo.token_weights(M, CU, reduction="sum").tolist() == [0, 1, 1, 0, 1]
    assert Lo.token_weights(M, CU, reduction="segment-mean").tolist() == pytest.approx([0, q, q, 0, h])
    # rollout-mean: one rollout of both segments; one rollout per segment (the default cu_segments)
    assert Lo.token_weights(M, CU, _t([0, 2], torch.int64), "rollout-mean").tolist() == \
        pytest.approx([0, third, third, 0, third])
    assert Lo.token_weights(M, CU, None, "rollout-mean").tolist() == pytest.approx([0, q, q, 0, h])
    # an empty rollout and a rollout without trainable tokens count for nothing
    m = M.clone()
    m[4] = False
    assert Lo.token_weights(m, CU, _t([0, 0, 1, 2], torch.int64), "rollout-mean").tolist() == [0, h, h, 0, 0]
    assert Lo.token_weights(m, CU, reduction="segment-mean").tolist() == [0, h, h, 0, 0]
    # denominator replaces D; D = 0 gives weight 0
    assert Lo.token_weights(M, CU, reduction="token-mean", denominator=4).tolist() == [0, q, q, 0, q]
    assert Lo.token_weights(M, CU, reduction="segment-mean", denominator=4).tolist() == \
        pytest.approx([0, 1 / 8, 1 / 8, 0, q])
    assert not Lo.token_weights(M, CU, reduction="token-mean", denominator=0).any()
    assert not Lo.token_weights(torch.zeros(3, dtype=torch.bool)).any()
    assert Lo.token_weights(M).dtype == torch.float64


# token 0: A=1, r=e^0.5 (upper clip); 1: A=-1, r=e^2 (past the dual clip 3); 2: A=-2, r=e^-0.5 (lower clip);
# 3: A=0.5, r=1 (a tie: unclipped)
OLD = _t([0.0, 0.0, 0.0, -1.0])
LP = _t([0.5, 2.0, -0.5, -1.0])
ADV = _t([1.0, -1.0, -2.0, 0.5])


def test_ppo_token_losses_by_hand():
    e = math.exp
    loss, ratio, clipped, dual = Lo.ppo_token_losses(LP, OLD, ADV)
    assert loss.tolist() == pytest.approx([-1.2, e(2), 1.6, -0.5])
    assert ratio.tolist() == pytest.approx([e(0.5), e(2), e(-0.5), 1.0])
    assert clipped.tolist() == [True, False, True, False] and not dual.any()
    loss, _, clipped, dual = Lo.ppo_token_losses(LP, OLD, ADV, clip_low=0.1, clip_high=0.5, dual_clip=3.0)
    assert loss.tolist() == pytest.approx([-1.5, 3.0, 1.8, -0.5])
    assert clipped.tolist() == [True, False, True, False] and dual.tolist() == [False, True, False, False]
    rl = _t([0.0, -1.0, 0.5, -1.0])  # importance weights e^(old - rollout): 1, e, e^-0.5, 1
    loss, *_ = Lo.ppo_token_losses(LP, OLD, ADV, rollout_logprobs=rl)
    assert loss.tolist() == pytest.approx([-1.2, e(2) * e(1), 1.6 * e(-0.5), -0.5])
    loss, *_ = Lo.ppo_token_losses(LP, OLD, ADV, rollout_logprobs=rl, tis_cap=2.0)
    assert loss.tolist() == pytest.approx([-1.2, e(2) * 2.0, 1.6 * e(-0.5), -0.5])


def test_ppo_policy_loss_reduction_metrics_and_gradient():
    m = _t([True, True, True, True, False], torch.bool)
    lp = torch.cat([LP, _t([float("nan")])]).requires_grad_()
    old, adv = torch.cat([OLD, _t([float("inf")])]), torch.cat([ADV, _t([float("nan")])])
    loss, met = Lo.ppo_policy_loss(lp, old, adv, m, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.2 + 3.0 + 1.6 - 0.5) / 4)
    (g,) = torch.autograd.grad(loss, lp)
    # clipped and dual-clipped tokens: no gradient; unclipped: -A * ratio / 4 (the tie takes that branch)
    assert g.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5 / 4, 0.0])
    r = [math.exp(0.5), math.exp(2), math.exp(-0.5), 1.0]
    assert met["clip_fraction"].item() == pytest.approx(0.5) and met["dual_clip_fraction"].item() == 0.25
    assert met["ratio_max"].item() == pytest.approx(math.exp(2))
    assert met["approx_kl"].item() == pytest.approx(sum((x - 1) - math.log(x) for x in r) / 4)
    assert met["log_ratio"].item() == pytest.approx(sum(math.log(x) for x in r) / 4)
    s, _ = Lo.ppo_policy_loss(lp, old, adv, m, dual_clip=3.0, reduction="sum")
    assert s.item() == pytest.approx(-1.2 + 3.0 + 1.6 - 0.5)
    seg, _ = Lo.ppo_policy_loss(lp, old, adv, m, cu_seqlens=_t([0, 1, 5], torch.int64), dual_clip=3.0,
                                reduction="segment-mean", denominator=4.0)
    assert seg.item() == pytest.approx(-1.2 / 4 + (3.0 + 1.6 - 0.5) / (3 * 4))
    loss, met = Lo.ppo_policy_loss(lp, old, adv, torch.zeros(5, dtype=torch.bool))
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in met.values())
    loss, _ = Lo.ppo_policy_loss(lp, old, adv, m, rollout_logprobs=torch.full((5,), -1.0), tis_cap=1.5)
    # weights e^(old + 1): e (capped at 1.5) on tokens 0-2, 1 on token 3
    assert loss.item() == pytest.approx((1.5 * (-1.2 + math.exp(2) + 1.6) - 0.5) / 4)


def test_value_token_losses_by_hand():
    v, old, ret = _t([1.0, 0.2, 2.0, 1.2]), _t([0.0, 1.0, 1.0, 1.0]), _t([0.0, 1.5, 2.0, 1.0])
    loss, clipped = Lo.value_token_losses(v, old, ret)
    assert loss.tolist() == pytest.approx([0.5, 0.845, 0.0, 0.02]) and not clipped.any()
    loss, clipped = Lo.value_token_losses(v, old, ret, clip=0.5)
    # v_clip: 0.5, 0.5, 1.5, 1.2 (inside the range: v itself)
    assert loss.tolist() == pytest.approx([0.5, 0.845, 0.125, 0.02])
    assert clipped.tolist() == [False, False, True, False]
    loss, _ = Lo.value_token_losses(_t([1.0]), _t([float("nan")]), _t([0.0]), clip=0.5)
    assert math.isnan(loss.item())  # a NaN of the clipped side stays NaN


def test_value_loss_reduction_and_metrics():
    v = _t([1.0, 0.2, 2.0, 1.2, float("inf")]).requires_grad_()
    old, ret = _t([0.0, 1.0, 1.0, 1.0, 0.0]), _t([0.0, 1.5, 2.0, 1.0, float("nan")])
    m = _t([True, True, True, True, False], torch.bool)
    loss, met = Lo.value_loss(v, old, ret, m, clip=0.5)
    assert loss.item() == pytest.approx((0.5 + 0.845 + 0.125 + 0.02) / 4)
    (g,) = torch.autograd.grad(loss, v)
    assert g.tolist() == pytest.approx([1.0 / 4, -1.3 / 4, 0.0, 0.2 / 4, 0.0])
    vm, rm = _t([1.0, 0.2, 2.0, 1.2]), _t([0.0, 1.5, 2.0, 1.0])
    assert met["clip_fraction"].item() == 0.25 and met["value_mean"].item() == pytest.approx(1.1)
    ev = 1 - (rm - vm).var(unbiased=False) / rm.var(unbiased=False)
    assert met["explained_variance"].item() == pytest.approx(ev.item())
    _, met = Lo.value_loss(v, old, torch.ones(5), m)
    assert met["explained_variance"].item() == 0.0  # constant returns: no variance to explain
    s, _ = Lo.value_loss(v, old, ret, m, reduction="sum")
    assert s.item() == pytest.approx(0.5 + 0.845 + 0.0 + 0.02)
    loss, met = Lo.value_loss(v, old, ret, torch.zeros(5, dtype=torch.bool))
    assert loss.item() == 0.0 and all(x.item() == 0.0 for x in met.values())


def test_value_head_and_padded_formulations():
    h = _t([[1.0, 2.0], [3.0, -1.0]], torch.float32)
    w = _t([0.5, 0.25], torch.float32)
    assert Lo.value_head(h, w).tolist() == [1.0, 1.25] and Lo.value_head(h, w).dtype == torch.float64
    assert Lo.value_head(h, w, _t([2.0])).tolist() == [3.0, 3.25]
    lp, old, adv = LP.view(2, 2), OLD.view(2, 2), ADV.view(2, 2)
    tok = Lo.padded_ppo_token_losses(lp, old, adv)
    assert tok.flatten().tolist() == pytest.approx([-1.2, math.exp(2), 1.6, -0.5])
    assert Lo.padded_ppo_token_losses(lp, old, adv, 0.1, 0.5).flatten().tolist() == \
        pytest.approx([-1.5, math.exp(2), 1.8, -0.5])
    mat, mask = _t([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]]), _t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert Lo.padded_token_mean(mat, mask).item() == pytest.approx(7 / 3)
    assert Lo.padded_seq_mean_token_mean(mat, mask).item() == pytest.approx((1.5 + 4.0) / 2)


def test_token_weights_edges():
    q, h = 0.25, 0.5
    m = _t([True, False, True, False, True], torch.bool)
    # token-mean ignores the segments; segment-mean ignores the rollouts
    assert Lo.token_weights(M, CU).tolist() == pytest.approx([0, 1 / 3, 1 / 3, 0, 1 / 3])
    assert Lo.token_weights(M, CU, _t([0, 2], torch.int64), "segment-mean").tolist() == pytest.approx([0, q, q, 0, h])
    assert Lo.token_weights(M, denominator=4).tolist() == [0, q, q, 0, q]  # the default reduction is token-mean
    assert Lo.token_weights(m, reduction="segment-mean").tolist() == pytest.approx([1 / 3, 0, 1 / 3, 0, 1 / 3])
    # empty rollouts first and last (one with no segment past the end) count for nothing
    w = Lo.token_weights(m, CU, _t([0, 0, 1, 2, 2], torch.int64), "rollout-mean")
    assert w.tolist() == pytest.approx([q, 0, q, 0, h])


def test_dual_clip_tie_keeps_the_unclipped_branch():
    lp = _t([1.0]).requires_grad_()
    c = float(torch.exp(_t(1.0)))  # ratio == dual_clip exactly
    loss, _, _, dual = Lo.ppo_token_losses(lp, _t([0.0]), _t([-1.0]), dual_clip=c)
    assert not dual.any() and loss.item() == c
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert g.item() == pytest.approx(c)  # d(-A * ratio)/dlp, not the constant l3's 0


def test_ppo_policy_loss_passes_every_option():
    m = _t([True, True, True, True], torch.bool)
    tok, *_ = Lo.ppo_token_losses(LP, OLD, ADV, clip_low=0.1, clip_high=0.5)
    loss, _ = Lo.ppo_policy_loss(LP, OLD, ADV, m, clip_low=0.1, clip_high=0.5)
    assert loss.item() == pytest.approx(tok.mean().item())
    cu = _t([0, 1, 4], torch.int64)
    tok, *_ = Lo.ppo_token_losses(LP, OLD, ADV)
    loss, _ = Lo.ppo_policy_loss(LP, OLD, ADV, m, cu_seqlens=cu)  # default: token-mean over the batch
    assert loss.item() == pytest.approx(tok.mean().item())
    loss, _ = Lo.ppo_policy_loss(LP, OLD, ADV, m, cu_seqlens=cu, cu_segments=_t([0, 2], torch.int64),
                                 reduction="rollout-mean")
    assert loss.item() == pytest.approx(tok.mean().item())  # one rollout of 4 tokens
    loss, met = Lo.ppo_policy_loss(LP, OLD, ADV, torch.zeros(4, dtype=torch.bool))
    assert {k: v.dtype for k, v in met.items()} == dict.fromkeys(
        ["clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_max", "log_ratio"], torch.float64)


def test_value_clip_edges():
    # the lower clip binds: v_clip = old - clip
    loss, clipped = Lo.value_token_losses(_t([0.2]), _t([1.0]), _t([0.0]), clip=0.5)
    assert loss.item() == pytest.approx(0.125) and clipped.tolist() == [True]
    assert Lo.value_token_losses(_t([0.2]), _t([1.0]), _t([0.0]))[1].dtype == torch.bool
    # |v - old| == clip exactly: v itself, although old + (v - old) rounds to another number here
    v, old = _t([3.2230769230769227]), _t([0.5428571428571429])
    d = float(v - old)
    assert float(old + d) != float(v)
    loss, clipped = Lo.value_token_losses(v, old, _t([3.3]), clip=d)  # old + d < v: farther from 3.3
    assert not clipped.any() and loss.item() == 0.5 * (float(v) - 3.3) ** 2


def test_value_loss_passes_every_option():
    v, old, ret = _t([1.0, 0.2, 2.0, 1.2]), _t([0.0, 1.0, 1.0, 1.0]), _t([0.0, 1.5, 2.0, 1.0])
    m = _t([True] * 4, torch.bool)
    tok, _ = Lo.value_token_losses(v, old, ret)
    cu = _t([0, 1, 4], torch.int64)
    assert Lo.value_loss(v, old, ret, m, cu_seqlens=cu)[0].item() == pytest.approx(tok.mean().item())
    seg = Lo.value_loss(v, old, ret, m, cu_seqlens=cu, reduction="segment-mean")[0].item()
    assert seg == pytest.approx((tok[0] + tok[1:].mean()).item() / 2)
    roll = Lo.value_loss(v, old, ret, m, cu_seqlens=cu, cu_segments=_t([0, 2], torch.int64),
                         reduction="rollout-mean")[0].item()
    assert roll == pytest.approx(tok.mean().item())
    assert Lo.value_loss(v, old, ret, m, denominator=8.0)[0].item() == pytest.approx(tok.sum().item() / 8)
    _, met = Lo.value_loss(v, old, ret, torch.zeros(4, dtype=torch.bool))
    assert {k: x.dtype for k, x in met.items()} == dict.fromkeys(
        ["clip_fraction", "value_mean", "explained_variance"], torch.float64)
