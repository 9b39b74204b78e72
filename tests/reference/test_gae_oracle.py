"""The float64 GAE oracle (compactionrl_fast.reference.gae) against hand-derived closed forms on tiny
batches: every backend is tested against the oracle, so the oracle itself is checked here by formulas
that do not share its loops (advantages as discounted sums of TD errors, lambda-1 returns as discounted
sums of rewards)."""
import math

import pytest
import torch

from compactionrl_fast.reference import gae as G


def _closed_form(r, v, gamma, lam):
    """A_k = sum_j (gamma*lam)^(j-k) delta_j, delta_j = r_j + gamma*V_{j+1} - V_j, V after the end = 0."""
    n = len(r)
    d = [r[j] + gamma * (v[j + 1] if j + 1 < n else 0.0) - v[j] for j in range(n)]
    return [sum((gamma * lam) ** (j - k) * d[j] for j in range(k, n)) for k in range(n)]


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# two rollouts: rollout 0 = segments [0, 4) (obs token at 1) and [4, 7); rollout 1 = segment [7, 9)
MASK = _t([False, False, True, True, False, True, True, True, True], torch.bool)
MASK[0] = True
R = _t([0.5, 9.0, -1.0, 2.0, 9.0, 0.0, 1.0, 3.0, -2.0])
V = _t([0.1, 9.0, 0.3, -0.2, 9.0, 0.4, 0.5, 1.0, 0.25])
CU = _t([0, 4, 7, 9], torch.int64)
CS = _t([0, 2, 3], torch.int64)
SEG_POS = [[0, 2, 3], [5, 6], [7, 8]]  # trainable positions per segment


@pytest.mark.parametrize("mode", ["paper", "none", "stitched"])
def test_segment_gae_closed_forms(mode):
    gamma, lam = 0.9, 0.8
    adv, ret = G.segment_gae(R, V, MASK, CU, CS, gamma=gamma, lam=lam, cross_segment=mode, lam_critic=None)
    assert adv.dtype == ret.dtype == torch.float64
    want = torch.zeros(9, dtype=torch.float64)
    groups = [SEG_POS[0] + SEG_POS[1], SEG_POS[2]] if mode == "stitched" else SEG_POS
    for g in groups:
        a = _closed_form([float(R[p]) for p in g], [float(V[p]) for p in g], gamma, lam)
        for p, x in zip(g, a):
            want[p] = x
    if mode == "paper":  # the first segment of rollout 0 is scaled by (gamma*lam)^(tokens after it)
        want[SEG_POS[0]] *= (gamma * lam) ** 2
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    assert not adv[~MASK].any() and not ret[~MASK].any()
    # lam_critic None: returns from the unscaled advantages
    unscaled = want.clone()
    if mode == "paper":
        unscaled[SEG_POS[0]] /= (gamma * lam) ** 2
    torch.testing.assert_close(ret[MASK], (unscaled + V)[MASK], rtol=1e-12, atol=1e-12)


def test_lambda_one_returns_are_discounted_reward_sums():
    gamma = 0.5
    _, ret = G.segment_gae(R, V, MASK, CU, CS, gamma=gamma, lam=0.3, lam_critic=1.0, cross_segment="none")
    for g in SEG_POS:
        for i, p in enumerate(g):
            want = sum(gamma ** (j - i) * float(R[q]) for j, q in enumerate(g) if j >= i)
            assert float(ret[p]) == pytest.approx(want, abs=1e-12)


def test_default_cu_segments_is_one_rollout_per_segment():
    a1, r1 = G.segment_gae(R, V, MASK, CU, gamma=0.9, lam=0.8)
    a2, r2 = G.segment_gae(R, V, MASK, CU, torch.arange(4), gamma=0.9, lam=0.8)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    p1 = G.place_final_rewards(_t([1.0, 2.0, 3.0]), MASK, CU)
    assert p1.tolist() == [0, 0, 0, 1.0, 0, 0, 2.0, 0, 3.0]
    assert torch.equal(G.segment_params(MASK, CU, gamma=0.9, lam=0.8),
                       G.segment_params(MASK, CU, torch.arange(4), gamma=0.9, lam=0.8))


def test_defaults_are_gamma_one_adaptive_paper_lam_critic_one():
    adv, ret = G.segment_gae(R, V, MASK, CU, CS)
    want_a, want_r = G.segment_gae(R, V, MASK, CU, CS, gamma=1.0, lam="adaptive", cross_segment="paper",
                                   lam_critic=1.0, adaptive_alpha=1.5, adaptive_length="rollout")
    assert torch.equal(adv, want_a) and torch.equal(ret, want_r)
    lam0 = 1 - 1 / (1.5 * 5)  # rollout 0: 5 trainable tokens
    seg1 = _closed_form([float(R[p]) for p in SEG_POS[1]], [float(V[p]) for p in SEG_POS[1]], 1.0, lam0)
    torch.testing.assert_close(adv[SEG_POS[1]], _t(seg1), rtol=1e-12, atol=1e-12)


def test_adaptive_lambda_and_power():
    assert G.adaptive_lambda(4, 0.5) == 0.5
    assert G.adaptive_lambda(0, 1.5) == G.adaptive_lambda(1, 1.5) == pytest.approx(1 / 3)
    assert G.adaptive_lambda(1, 0.5) == 0.0  # clamped at 0
    assert G.adaptive_lambda(10, 2.0) == pytest.approx(0.95)
    assert G.adaptive_lambda(10 ** 9, 1e9) == 1.0  # clamped at 1 (1 - 1e-18 rounds to 1)
    assert G.power(0.5, 3) == pytest.approx(0.125) and G.power(0.0, 0) == 1.0 and G.power(0.7, 0) == 1.0
    assert G.power(0.0, 5) == 0.0 and G.power(1.0, 10 ** 12) == 1.0
    assert G.power(0.9, 10 ** 6) == pytest.approx(math.exp(10 ** 6 * math.log(0.9)))
    assert G.power(0.999, 10) == pytest.approx(0.999 ** 10, rel=1e-14)


def test_segment_lambdas_kinds():
    n = [3, 2, 2]
    assert G.segment_lambdas(0.7, MASK, CU, CS) == [0.7] * 3
    assert G.segment_lambdas(torch.tensor([0.1, 0.2, 0.3]), MASK, CU, CS) == pytest.approx([0.1, 0.2, 0.3])
    rollout = G.segment_lambdas("adaptive", MASK, CU, CS, alpha=2.0)
    assert rollout == pytest.approx([1 - 1 / (2.0 * 5)] * 2 + [1 - 1 / (2.0 * 2)])
    seg = G.segment_lambdas("adaptive", MASK, CU, CS, alpha=2.0, length="segment")
    assert seg == pytest.approx([1 - 1 / (2.0 * k) for k in n])
    assert G.segment_lambdas("adaptive", MASK, CU, CS) == pytest.approx([1 - 1 / 7.5] * 2 + [1 - 1 / 3.0])


@pytest.mark.parametrize("mode", ["paper", "none", "stitched"])
def test_segment_params_rows(mode):
    gamma, lam = 0.9, 0.8
    p = G.segment_params(MASK, CU, CS, gamma=gamma, lam=lam, cross_segment=mode, lam_critic=0.5)
    assert p.shape == (4, 3) and p.dtype == torch.float64
    torch.testing.assert_close(p[0], _t([gamma * lam] * 3))
    torch.testing.assert_close(p[1], _t([gamma * 0.5] * 3))
    scale0 = (gamma * lam) ** 2 if mode == "paper" else 1.0
    torch.testing.assert_close(p[2], _t([scale0, 1.0, 1.0]))
    assert p[3].tolist() == ([0.0, 1.0, 1.0] if mode == "stitched" else [1.0, 1.0, 1.0])
    p = G.segment_params(MASK, CU, CS, gamma=gamma, lam=lam, lam_critic=None)
    torch.testing.assert_close(p[1], p[0])
    # stitched: reset only where a later segment of the rollout has tokens (trainable or not)
    m = torch.tensor([False, True, True, False])
    p = G.segment_params(m, _t([0, 3, 3, 4], torch.int64), _t([0, 3], torch.int64), cross_segment="stitched")
    assert p[3].tolist() == [0.0, 0.0, 1.0] and p[2].tolist() == [1.0, 1.0, 1.0]
    p = G.segment_params(m[:3], _t([0, 3, 3], torch.int64), _t([0, 2], torch.int64), cross_segment="stitched")
    assert p[3].tolist() == [1.0, 1.0]


def test_place_final_rewards_modes():
    rr = _t([2.0, -1.0])
    paper = G.place_final_rewards(rr, MASK, CU, CS)
    assert paper.tolist() == [0, 0, 0, 2.0, 0, 0, 2.0, 0, -1.0]
    st = G.place_final_rewards(rr, MASK, CU, CS, mode="stitched")
    assert st.tolist() == [0, 0, 0, 0, 0, 0, 2.0, 0, -1.0] and st.dtype == torch.float64
    # a segment without trainable tokens gets nothing; stitched puts the reward on the last one that has
    m = MASK.clone()
    m[5:7] = False
    assert G.place_final_rewards(rr, m, CU, CS, mode="stitched").tolist() == [0, 0, 0, 2.0, 0, 0, 0, 0, -1.0]


def test_masked_gae_is_the_per_row_oracle():
    g = torch.Generator().manual_seed(0)
    B, L = 3, 7
    r, v = torch.randn(B, L, generator=g, dtype=torch.float64), torch.randn(B, L, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) < 0.6
    mask[:, 0] = True
    adv, ret = G.masked_gae(r, v, mask, 0.9, 0.7)
    for b in range(B):
        pos = mask[b].nonzero().squeeze(1).tolist()
        want = _closed_form([float(r[b, p]) for p in pos], [float(v[b, p]) for p in pos], 0.9, 0.7)
        torch.testing.assert_close(adv[b, pos], _t(want), rtol=1e-12, atol=1e-12)
    assert not adv[~mask].any() and not ret[~mask].any()
    torch.testing.assert_close(ret[mask], (adv + v)[mask])


@pytest.mark.parametrize("mode", ["paper", "none", "stitched"])
def test_per_segment_lambdas_reach_their_own_tokens(mode):
    """A different lambda per segment (a tensor, or adaptive per segment length): each token's recurrence
    uses its own segment's lambda, in every rollout (not only the first)."""
    gamma = 0.9
    for lam, kw in ((_t([0.5, 0.6, 0.7]), {}), ("adaptive", {"adaptive_length": "segment"})):
        lams = [0.5, 0.6, 0.7] if kw == {} else [1 - 1 / (1.5 * k) for k in (3, 2, 2)]
        adv, _ = G.segment_gae(R, V, MASK, CU, CS, gamma=gamma, lam=lam, cross_segment=mode, lam_critic=None, **kw)
        groups = [(SEG_POS[0] + SEG_POS[1], [0, 0, 0, 1, 1]), (SEG_POS[2], [2, 2])] if mode == "stitched" else \
            [(p, [s] * len(p)) for s, p in enumerate(SEG_POS)]
        want = torch.zeros(9, dtype=torch.float64)
        for g, segs in groups:  # the recurrence A_k = delta_k + gamma * lam_k * A_{k+1}, unrolled by hand
            d = [float(R[p]) + gamma * (float(V[g[i + 1]]) if i + 1 < len(g) else 0.0) - float(V[p])
                 for i, p in enumerate(g)]
            for i, p in enumerate(g):
                want[p] = sum(math.prod(gamma * lams[segs[j]] for j in range(i, k)) * d[k] for k in range(i, len(g)))
        if mode == "paper":
            want[SEG_POS[0]] *= (gamma * lams[0]) ** 2
        torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)


def test_segment_params_defaults_and_adaptive_length():
    lam0, lam1 = 1 - 1 / 7.5, 1 - 1 / 3.0  # adaptive, alpha 1.5, rollout lengths 5 and 2
    p = G.segment_params(MASK, CU, CS)  # gamma 1, paper, lam_critic 1
    torch.testing.assert_close(p, _t([[lam0, lam0, lam1], [1.0] * 3, [lam0 ** 2, 1.0, 1.0], [1.0] * 3]))
    p = G.segment_params(MASK, CU, CS, adaptive_length="segment", adaptive_alpha=2.0)
    assert p[0].tolist() == pytest.approx([1 - 1 / 6, 1 - 1 / 4, 1 - 1 / 4])


def test_adaptive_lambda_is_clamped_for_any_alpha():
    assert G.adaptive_lambda(2, -1.0) == 1.0 and G.adaptive_lambda(2, 1e-9) == 0.0
