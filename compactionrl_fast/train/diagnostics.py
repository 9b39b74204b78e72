"""Per-step training diagnostics the paper does not report.

All functions read the packed layout (docs/layout.md) plus per-token advantages/values/returns [T] and
return flat dicts of floats (lists for histograms and deciles) ready for the JSONL log.
"""
from __future__ import annotations

import math

import torch

EXEC, SUMMARY = 0, 1
FACTOR_BINS = 10  # histogram of the cross-segment factors over [0, 1]


def segment_ids(batch):
    """(segment of each token [T], rollout of each segment [S], trainable tokens per segment [S])."""
    T, S, R = batch.loss_mask.numel(), batch.cu_seqlens.numel() - 1, batch.cu_segments.numel() - 1
    dev = batch.loss_mask.device
    seg = torch.repeat_interleave(torch.arange(S, device=dev), batch.cu_seqlens.diff().long(), output_size=T)
    roll = torch.repeat_interleave(torch.arange(R, device=dev), batch.cu_segments.diff().long(), output_size=S)
    n = torch.zeros(S, dtype=torch.long, device=dev).index_add_(0, seg, batch.loss_mask.long())
    return seg, roll, n


def summary_index(batch, roll):
    """For each segment [S]: 1 for a rollout's first summary, 2 for its second, ...; 0 for exec segments."""
    is_sum = (batch.segment_kind.long() == SUMMARY).long()
    csum = is_sum.cumsum(0)
    start = batch.cu_segments[:-1].long()[roll]  # first segment of each segment's rollout
    return (csum - (csum[start] - is_sum[start])) * is_sum


def cross_segment_factors(batch, cfg, n=None, roll=None):
    """The paper's per-segment advantage factor (gamma*lam_s)^N_{>s} [S] float64, for the histogram.

    Mirrors the definition in docs/method.md (not used for training: the advantages come from
    `segment_gae`); 1 everywhere for cross_segment "none"/"stitched".
    """
    if n is None:
        _, roll, n = segment_ids(batch)
    R = batch.cu_segments.numel() - 1
    per_roll = torch.zeros(R, dtype=torch.long, device=n.device).index_add_(0, roll, n)
    # trainable tokens in later segments of the same rollout: rollout total minus the inclusive prefix
    cs = n.cumsum(0)
    start = batch.cu_segments[:-1].long()[roll]
    incl = cs - (cs[start] - n[start])
    later = per_roll[roll] - incl
    if cfg.cross_segment != "paper":
        return torch.ones_like(later, dtype=torch.float64)
    if isinstance(cfg.lam, str):
        length = per_roll[roll] if cfg.adaptive_length == "rollout" else n
        lam = (1.0 - 1.0 / (cfg.adaptive_alpha * length.clamp(min=1).double())).clamp(0.0, 1.0)
    else:
        lam = torch.full_like(later, float(cfg.lam), dtype=torch.float64)
    base = cfg.gamma * lam
    out = torch.where(base > 0, torch.exp(later.double() * torch.log(base.clamp(min=1e-300))),
                      (later == 0).double())
    return out


def explained_variance(pred, target) -> float:
    """1 - Var(target - pred) / Var(target); nan for fewer than 2 points or constant targets."""
    if target.numel() < 2:
        return float("nan")
    var = target.double().var()
    if var <= 0:
        return float("nan")
    return float(1.0 - (target.double() - pred.double()).var() / var)


def calibration_deciles(pred, target, bins: int = 10):
    """Mean predicted and mean realised value in `bins` equal-count bins of the prediction."""
    if pred.numel() < bins:
        return [], []
    order = pred.double().argsort()
    chunks = torch.tensor_split(order, bins)
    return ([float(pred.double()[c].mean()) for c in chunks], [float(target.double()[c].mean()) for c in chunks])


def batch_diagnostics(batch, advantages, values, returns, cfg) -> dict:
    """Compaction shape, advantage structure and value calibration of one packed batch.

    Args:
        batch: a PackedBatch; advantages, values, returns: [T] float (trainable positions read).
    """
    seg, roll, n = segment_ids(batch)
    R = batch.cu_segments.numel() - 1
    mask = batch.loss_mask
    kind = batch.segment_kind.long()
    out = {}
    out["rollouts"] = R
    out["tokens_total"] = int(mask.numel())
    out["tokens_trainable"] = int(mask.sum())
    for k, name in ((EXEC, "exec"), (SUMMARY, "summary")):
        out[f"tokens_{name}_per_rollout"] = float(n[kind == k].sum()) / max(R, 1)
        out[f"segments_{name}_per_rollout"] = float((kind == k).sum()) / max(R, 1)
    out["compactions_per_rollout"] = out["segments_summary_per_rollout"]
    sums = n[kind == SUMMARY]
    out["summary_length"] = float(sums.double().mean()) if sums.numel() else 0.0

    # advantages by segment kind and by summary order (early vs late summaries)
    adv_t = advantages.double()[mask]
    kind_t = kind[seg][mask]
    for k, name in ((EXEC, "exec"), (SUMMARY, "summary")):
        sel = adv_t[kind_t == k]
        out[f"adv_{name}_mean"] = float(sel.mean()) if sel.numel() else float("nan")
    sidx = summary_index(batch, roll)[seg][mask]
    for i in (1, 2, 3):
        sel = adv_t[sidx == i]
        out[f"adv_summary{i}_mean"] = float(sel.mean()) if sel.numel() else float("nan")
    out["adv_abs_mean"] = float(adv_t.abs().mean()) if adv_t.numel() else float("nan")

    # segment weights in the loss: the cross-segment factor, and each segment's share of the tokens
    f = cross_segment_factors(batch, cfg, n, roll)
    has = n > 0
    hist = torch.histc(f[has].float(), bins=FACTOR_BINS, min=0.0, max=1.0) if bool(has.any()) else torch.zeros(FACTOR_BINS)
    out["segment_factor_hist"] = [int(x) for x in hist.tolist()]
    for k, name in ((EXEC, "exec"), (SUMMARY, "summary")):
        sel = f[has & (kind == k)]
        out[f"segment_factor_{name}_mean"] = float(sel.mean()) if sel.numel() else float("nan")
    share = n[has].double() / max(int(n.sum()), 1)
    out["segment_token_share_max"] = float(share.max()) if share.numel() else 0.0

    # value calibration on trainable tokens: explained variance, predicted vs realised return by decile
    v, ret = values.double()[mask], returns.double()[mask]
    out["value_explained_variance"] = explained_variance(v, ret)
    out["value_mean"] = float(v.mean()) if v.numel() else float("nan")
    out["return_mean"] = float(ret.mean()) if ret.numel() else float("nan")
    out["value_decile_pred"], out["value_decile_real"] = calibration_deciles(v, ret)
    return out


def advantage_gap(batch, values, cfg) -> dict:
    """Gap between the paper's and the stitched advantages on the same batch and values.

    Both come from `segment_gae`; rewards are placed per mode with `place_final_rewards`.
    """
    from ..ops import place_final_rewards, segment_gae

    mask = batch.loss_mask
    adv = {}
    for mode in ("paper", "stitched"):
        rewards = place_final_rewards(batch.rollout_rewards.float(), mask, batch.cu_seqlens, batch.cu_segments,
                                      mode=mode)
        adv[mode], _ = segment_gae(rewards, values.float(), mask, batch.cu_seqlens, batch.cu_segments,
                                   gamma=cfg.gamma, lam=cfg.lam, cross_segment=mode, lam_critic=cfg.lam_critic,
                                   adaptive_alpha=cfg.adaptive_alpha, adaptive_length=cfg.adaptive_length)
    a, b = adv["paper"].double()[mask], adv["stitched"].double()[mask]
    out = {}
    if a.numel() == 0:
        return out
    diff = (a - b).abs()
    out["gap_abs_mean"] = float(diff.mean())
    out["gap_rel"] = float(diff.mean() / b.abs().mean().clamp(min=1e-12))
    out["gap_corr"] = float(torch.corrcoef(torch.stack([a, b]))[0, 1]) if a.numel() > 1 and a.std() > 0 and b.std() > 0 else float("nan")
    seg, _, _ = segment_ids(batch)
    kind_t = batch.segment_kind.long()[seg][mask]
    for k, name in ((EXEC, "exec"), (SUMMARY, "summary")):
        sel = kind_t == k
        out[f"gap_{name}_abs_mean"] = float(diff[sel].mean()) if bool(sel.any()) else float("nan")
    out["sign_agreement"] = float(((a > 0) == (b > 0)).double().mean())
    return out


def finite(d: dict) -> dict:
    """JSON-safe copy: NaN/inf floats become None."""
    def fix(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, list):
            return [fix(y) for y in x]
        return x
    return {k: fix(v) for k, v in d.items()}
