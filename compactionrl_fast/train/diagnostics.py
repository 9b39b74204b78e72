"""Per-step training diagnostics the paper does not report.

What depends on the packed layout alone (docs/layout.md) is derived once per step on the host
(`layout_part`, kept in the step's `micro_batch.MicroBatch`); what depends on advantages, values and returns [T]
stays on the device as [] tensors until the step's one read (`readout.read`). The result: flat dicts of
floats (lists for histograms and deciles) ready for the JSONL log.
"""
from __future__ import annotations

import math

import torch

from ..rollout.records import SEGMENT_KINDS, SUMMARY

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
    is_sum = (batch.segment_kind.long() == SEGMENT_KINDS[SUMMARY]).long()
    csum = is_sum.cumsum(0)
    start = batch.cu_segments[:-1].long()[roll]  # first segment of each segment's rollout
    return (csum - (csum[start] - is_sum[start])) * is_sum


def cross_segment_factors(batch, cfg):
    """The paper's per-segment advantage factor (gamma*lam_s)^N_{>s} [S] float64, for the histogram: the
    advantage scale `segment_gae` itself resolves (row 2 of `segment_params`, the code its scans read), so the
    logged factor is the one the advantages carry; 1 everywhere for cross_segment "none"/"stitched"."""
    from ..ops import segment_params

    return segment_params(batch.loss_mask, batch.cu_seqlens, batch.cu_segments, gamma=cfg.gamma, lam=cfg.lam,
                          cross_segment=cfg.cross_segment, lam_critic=cfg.lam_critic,
                          adaptive_alpha=cfg.adaptive_alpha, adaptive_length=cfg.adaptive_length)[2]


def _mean(x, n: int):
    """x.mean() [] as a tensor, NaN for an empty x: `n` is its size, known on the host."""
    return x.mean() if n else float("nan")


def explained_variance(pred, target):
    """1 - Var(target - pred) / Var(target) [] (a tensor); nan for fewer than 2 points or constant targets."""
    if target.numel() < 2:
        return float("nan")
    var = target.double().var()
    return torch.where(var > 0, 1.0 - (target.double() - pred.double()).var() / var, float("nan"))


def calibration_deciles(pred, target, bins: int = 10):
    """Mean predicted and mean realised value ([] tensors) in `bins` equal-count bins of the prediction."""
    if pred.numel() < bins:
        return [], []
    order = pred.double().argsort()
    chunks = torch.tensor_split(order, bins)
    return [pred.double()[c].mean() for c in chunks], [target.double()[c].mean() for c in chunks]


def layout_part(batch, cfg, idx, ids) -> dict:
    """What the diagnostics read of the layout alone, derived where the batch is (the host, once per step):
    the compaction-shape numbers and the cross-segment factors (host values), and the positions in the
    trainable tokens `idx` [N] of exec tokens, summary tokens and the tokens of a rollout's k-th summary.
    ids: `segment_ids(batch)`."""
    seg, roll, n = ids
    R = batch.cu_segments.numel() - 1
    mask = batch.loss_mask
    kind = batch.segment_kind.long()
    out = {"rollouts": R, "tokens_total": int(mask.numel()), "tokens_trainable": int(mask.sum())}
    for name, k in SEGMENT_KINDS.items():
        out[f"tokens_{name}_per_rollout"] = float(n[kind == k].sum()) / max(R, 1)
        out[f"segments_{name}_per_rollout"] = float((kind == k).sum()) / max(R, 1)
    out["compactions_per_rollout"] = out["segments_summary_per_rollout"]
    sums = n[kind == SEGMENT_KINDS[SUMMARY]]
    out["summary_length"] = float(sums.double().mean()) if sums.numel() else 0.0

    # segment weights in the loss: the cross-segment factor, and each segment's share of the tokens
    f = cross_segment_factors(batch, cfg)
    has = n > 0
    hist = torch.histc(f[has].float(), bins=FACTOR_BINS, min=0.0, max=1.0) if bool(has.any()) else torch.zeros(FACTOR_BINS)
    factors = {"segment_factor_hist": [int(x) for x in hist.tolist()]}
    for name, k in SEGMENT_KINDS.items():
        sel = f[has & (kind == k)]
        factors[f"segment_factor_{name}_mean"] = float(sel.mean()) if sel.numel() else float("nan")
    share = n[has].double() / max(int(n.sum()), 1)
    factors["segment_token_share_max"] = float(share.max()) if share.numel() else 0.0

    kind_t = kind[seg][idx]
    sidx = summary_index(batch, roll)[seg][idx]
    pos = {name: (kind_t == k).nonzero()[:, 0] for name, k in SEGMENT_KINDS.items()}
    pos.update({f"summary{i}": (sidx == i).nonzero()[:, 0] for i in (1, 2, 3)})
    return {"shape": out, "factors": factors, "pos": pos}


def batch_diagnostics(mb, advantages, values, returns) -> dict:
    """Compaction shape, advantage structure and value calibration of one micro-batch.

    Args:
        mb: a `micro_batch.MicroBatch`; advantages, values, returns: [T] float (trainable positions read).
    Returns host numbers for what the layout decides and [] tensors for the rest (`readout.read` reads them).
    """
    pos, idx = mb.diag["pos"], mb.idx
    out = dict(mb.diag["shape"])
    # advantages by segment kind and by summary order (early vs late summaries)
    adv_t = advantages.double()[idx]
    for name in ("exec", "summary"):
        out[f"adv_{name}_mean"] = _mean(adv_t[pos[name]], pos[name].numel())
    for i in (1, 2, 3):
        p = pos[f"summary{i}"]
        out[f"adv_summary{i}_mean"] = _mean(adv_t[p], p.numel())
    out["adv_abs_mean"] = _mean(adv_t.abs(), adv_t.numel())
    out.update(mb.diag["factors"])

    # value calibration on trainable tokens: explained variance, predicted vs realised return by decile
    v, ret = values.double()[idx], returns.double()[idx]
    out["value_explained_variance"] = explained_variance(v, ret)
    out["value_mean"] = _mean(v, v.numel())
    out["return_mean"] = _mean(ret, ret.numel())
    out["value_decile_pred"], out["value_decile_real"] = calibration_deciles(v, ret)
    return out


def _corrcoef(x):
    """torch.corrcoef of x [2, n] float64, n >= 2, in its own steps (the same numbers) minus its host check
    of the normalisation factor (a sync on CUDA)."""
    n = x.shape[1]
    xm = x - (x.sum(1) / n).unsqueeze(1)
    c = torch.mm(xm, xm.t()) / (n - 1)
    sd = c.diagonal().sqrt()
    return (c / sd.view(-1, 1) / sd.view(1, -1)).clamp(-1, 1)


def advantage_gap(mb, values, cfg) -> dict:
    """Gap between the paper's and the stitched advantages on the same micro-batch and values ([] tensors).

    Both come from `segment_gae`; the rewards of the micro-batch's own placement are reused, the other mode's
    are placed with `place_final_rewards`.
    """
    from ..ops import place_final_rewards, segment_gae

    batch, idx = mb.batch, mb.idx
    mask = batch.loss_mask
    adv = {}
    for mode in ("paper", "stitched"):
        rewards = mb.rewards if mode == getattr(mb, "reward_mode", None) else place_final_rewards(
            batch.rollout_rewards.float(), mask, batch.cu_seqlens, batch.cu_segments, mode=mode)
        adv[mode], _ = segment_gae(rewards, values.float(), mask, batch.cu_seqlens, batch.cu_segments,
                                   gamma=cfg.gamma, lam=cfg.lam, cross_segment=mode, lam_critic=cfg.lam_critic,
                                   adaptive_alpha=cfg.adaptive_alpha, adaptive_length=cfg.adaptive_length)
    a, b = adv["paper"].double()[idx], adv["stitched"].double()[idx]
    out = {}
    if a.numel() == 0:
        return out
    diff = (a - b).abs()
    out["gap_abs_mean"] = diff.mean()
    out["gap_rel"] = diff.mean() / b.abs().mean().clamp(min=1e-12)
    out["gap_corr"] = torch.where((a.std() > 0) & (b.std() > 0), _corrcoef(torch.stack([a, b]))[0, 1],
                                  float("nan")) if a.numel() > 1 else float("nan")
    pos = mb.diag["pos"]
    for name in ("exec", "summary"):
        out[f"gap_{name}_abs_mean"] = _mean(diff[pos[name]], pos[name].numel())
    out["sign_agreement"] = ((a > 0) == (b > 0)).double().mean()
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
