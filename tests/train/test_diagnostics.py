"""Diagnostics against hand counts, hand examples and the float64 reference GAE."""
import math

import torch

from compactionrl_fast.reference.gae import power, segment_lambdas
from compactionrl_fast.train import diagnostics as D
from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.readout import read

from ._tiny import hand_batch


def _mb(b, cfg):
    """The part of a `micro_batch.MicroBatch` the diagnostics read."""
    from types import SimpleNamespace

    idx = b.loss_mask.nonzero()[:, 0]
    return SimpleNamespace(batch=b, idx=idx, diag=D.layout_part(b, cfg, idx, D.segment_ids(b)))


def _diagnostics(b, adv, values, ret, cfg):
    return read(D.batch_diagnostics(_mb(b, cfg), adv, values, ret))


def _gap(b, values, cfg):
    return read(D.advantage_gap(_mb(b, cfg), values, cfg))


def test_segment_ids_and_summary_index():
    b = hand_batch(rollouts=((9, 5, 6, 4, 3), (12,), (7, 4)))
    seg, roll, n = D.segment_ids(b)
    assert roll.tolist() == [0, 0, 0, 0, 0, 1, 2, 2]
    assert n.tolist() == [int(b.loss_mask[a:c].sum()) for a, c in zip(b.cu_seqlens[:-1], b.cu_seqlens[1:])]
    assert D.summary_index(b, roll).tolist() == [0, 1, 0, 2, 0, 0, 0, 1]


def test_cross_segment_factors_match_the_reference_definition():
    b = hand_batch(rollouts=((9, 5, 6, 4, 3), (12,), (7, 4)))
    _, roll, n = D.segment_ids(b)
    for lam, length in (("adaptive", "rollout"), ("adaptive", "segment"), (0.9, "rollout")):
        cfg = TrainConfig(lam=lam, adaptive_length=length, gamma=0.99)
        lams = segment_lambdas(lam, b.loss_mask, b.cu_seqlens, b.cu_segments, 1.5, length)
        cs = b.cu_segments.tolist()
        ref = []
        for r in range(len(cs) - 1):
            for s in range(cs[r], cs[r + 1]):
                ref.append(power(0.99 * lams[s], int(n[s + 1:cs[r + 1]].sum())))
        torch.testing.assert_close(D.cross_segment_factors(b, cfg), torch.tensor(ref, dtype=torch.float64))
    assert bool((D.cross_segment_factors(b, TrainConfig(cross_segment="none")) == 1).all())


def test_batch_diagnostics_counts_and_calibration():
    b = hand_batch(rollouts=((9, 5, 6), (12,)))
    _, _, n = D.segment_ids(b)
    ret = torch.randn(b.loss_mask.numel())
    out = _diagnostics(b, torch.randn_like(ret), ret.clone(), ret, TrainConfig())
    assert out["tokens_summary_per_rollout"] == float(n[1]) / 2
    assert out["tokens_exec_per_rollout"] == float(n[0] + n[2] + n[3]) / 2
    assert out["compactions_per_rollout"] == 0.5 and out["summary_length"] == float(n[1])
    assert out["value_explained_variance"] == 1.0  # perfect predictions
    assert out["value_decile_pred"] == out["value_decile_real"] and len(out["value_decile_pred"]) == 10
    assert sum(out["segment_factor_hist"]) == int((n > 0).sum())


def test_advantage_gap_is_zero_without_compaction_and_not_with_it():
    single = hand_batch(rollouts=((12,), (9,)))
    v = torch.randn(single.loss_mask.numel())
    assert _gap(single, v, TrainConfig())["gap_abs_mean"] < 1e-6
    multi = hand_batch(rollouts=((9, 5, 6), (12, 7)))
    v = torch.randn(multi.loss_mask.numel())
    g = _gap(multi, v, TrainConfig())
    assert g["gap_abs_mean"] > 1e-3 and math.isfinite(g["gap_corr"])
    # against the paper's and the stitched advantages of the float64 reference, called directly
    from compactionrl_fast.reference import place_final_rewards as ref_place, segment_gae as ref_gae

    m = multi.loss_mask
    a, s = (ref_gae(ref_place(multi.rollout_rewards, m, multi.cu_seqlens, multi.cu_segments, mode=mode), v, m,
                    multi.cu_seqlens, multi.cu_segments, cross_segment=mode)[0][m] for mode in ("paper", "stitched"))
    assert abs(g["gap_abs_mean"] - float((a - s).abs().mean())) < 1e-6
    assert abs(g["gap_rel"] - float((a - s).abs().mean() / s.abs().mean())) < 1e-5
    assert g["sign_agreement"] == float(((a > 0) == (s > 0)).double().mean())


def test_advantage_gap_on_a_hand_example():
    """One rollout, an exec and a summary segment with one trainable token each; reward 1, values 0.5 and
    0.25, gamma 1, lambda 0.5. Paper: rewards on both tokens, A = (1 - 0.5) * 0.5^1 = 0.25 and 1 - 0.25 = 0.75.
    Stitched: reward on the last token only, A1 = 0.75, A0 = (0.25 - 0.5) + 0.5 * 0.75 = 0.125."""
    from types import SimpleNamespace

    b = SimpleNamespace(loss_mask=torch.tensor([False, True, False, True]), cu_seqlens=torch.tensor([0, 2, 4]),
                        cu_segments=torch.tensor([0, 2]), segment_kind=torch.tensor([0, 1], dtype=torch.int8),
                        rollout_rewards=torch.tensor([1.0]))
    g = _gap(b, torch.tensor([0.0, 0.5, 0.0, 0.25]), TrainConfig(gamma=1.0, lam=0.5))
    assert abs(g["gap_abs_mean"] - 0.0625) < 1e-7  # (|0.25 - 0.125| + |0.75 - 0.75|) / 2
    assert abs(g["gap_rel"] - 0.0625 / 0.4375) < 1e-6
    assert abs(g["gap_exec_abs_mean"] - 0.125) < 1e-7 and abs(g["gap_summary_abs_mean"]) < 1e-7
    assert g["sign_agreement"] == 1.0
