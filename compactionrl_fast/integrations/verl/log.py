"""What verl users watch: the recipe's numbers of a step, under `compaction/` (docs/verl.md)."""
from __future__ import annotations

import torch

from ...ops import segment_params
from ..padded import as_bool_mask, row_table
from ._options import compaction_options
from .advantages import session_rows


def compaction_metrics(keys, response_mask, extra_fields, config=None):
    """The recipe's numbers for verl's metrics, as the paper tracks them (its Figures 3-4).

    Args:
        keys: [B] batch keys `{uid}_{session}_{index}`. response_mask: [B, L] 0/1.
        extra_fields: [B] dicts of the rows (`segment_kind`, `compactions`, `finish_reason`; padding rows
            without them are skipped).
        config: verl's `algorithm` config (the cross-segment scale uses its gamma and lambda).
    Returns a dict of floats under `compaction/`: per rollout, compactions, segments and summary tokens
    (mean, max); trainable tokens per segment of each kind (mean) and their share; the cross-segment scale
    `(gamma*lam)^N_later` of each segment (mean, min; 1 with cross_segment none/stitched); the fraction of
    rollouts with each finish reason."""
    mask = as_bool_mask("response_mask", response_mask)
    real = [i for i, e in enumerate(extra_fields) if isinstance(e, dict) and "segment_kind" in e]
    if not real:
        return {}
    keys = [keys[i] for i in real]
    extra = [extra_fields[i] for i in real]
    mask = mask[torch.tensor(real, device=mask.device)]
    ids, pos = session_rows(keys)
    B, L = mask.shape
    table = row_table(B, L, ids, pos, mask.device)
    order = table.order  # rows in segment order, rollout by rollout
    n_tok = mask.sum(-1).tolist()
    kw, _ = compaction_options(config)
    mask_o = mask.index_select(0, torch.tensor(order, device=mask.device)).reshape(B * L)
    scale = segment_params(mask_o, table.cu_seqlens, table.cu_segments, **kw)[2]  # [B] segments in order
    cu = table.cu_segments.tolist()
    rollouts = [order[a:b] for a, b in zip(cu[:-1], cu[1:])]  # each rollout's rows, in index order
    out = {}

    def stat(name, xs):
        xs = [float(x) for x in xs]
        if xs:
            out[f"compaction/{name}/mean"] = sum(xs) / len(xs)
            out[f"compaction/{name}/max"] = max(xs)

    stat("compactions_per_rollout", [extra[r[-1]]["compactions"] for r in rollouts])
    stat("segments_per_rollout", [len(r) for r in rollouts])
    stat("summary_tokens_per_rollout", [sum(n_tok[i] for i in r if extra[i]["segment_kind"] == "summary")
                                        for r in rollouts])
    total = sum(n_tok) or 1
    for kind in sorted({e["segment_kind"] for e in extra}):
        rows = [i for i, e in enumerate(extra) if e["segment_kind"] == kind]
        out[f"compaction/trainable_tokens_per_segment/{kind}/mean"] = sum(n_tok[i] for i in rows) / len(rows)
        out[f"compaction/trainable_tokens_share/{kind}"] = sum(n_tok[i] for i in rows) / total
    out["compaction/cross_segment_scale/mean"] = float(scale.mean())
    out["compaction/cross_segment_scale/min"] = float(scale.min())
    reasons = [str(extra[r[-1]]["finish_reason"]) for r in rollouts]
    for why in sorted(set(reasons)):
        out[f"compaction/finish_reason/{why}"] = reasons.count(why) / len(reasons)
    out["compaction/rollouts"] = float(len(rollouts))
    return out
