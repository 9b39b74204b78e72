"""What verl users watch: the recipe's numbers of a step, the vocabulary of docs/metrics.md under `compaction/`."""
from __future__ import annotations

from ...rollout.metrics import SegmentFact
from ...rollout.metrics import compaction_metrics as vocabulary_metrics
from ..padded import as_bool_mask
from ._options import compaction_options
from .advantages import session_rows


def compaction_metrics(keys, response_mask, extra_fields, config=None):
    """The recipe's numbers for verl's metrics, as the paper tracks them (its Figures 3-4): the vocabulary of
    `rollout.metrics` (docs/metrics.md), every name of it, computed from the step's rows.

    Args:
        keys: [B] batch keys `{uid}_{session}_{index}` (a row is one segment: its rollout and index).
        response_mask: [B, L] 0/1 (a row's trainable tokens).
        extra_fields: [B] dicts of the rows (`segment_kind`, `compactions`, `finish_reason`; padding rows
            without them are skipped).
        config: verl's `algorithm` config: the cross-segment scale uses its gamma and `compaction_gae` keys
            (None: their defaults).
    Returns a dict of floats under `compaction/` ({} when no row is real)."""
    mask = as_bool_mask("response_mask", response_mask)
    real = [i for i, e in enumerate(extra_fields) if isinstance(e, dict) and "segment_kind" in e]
    if not real:
        return {}
    ids, pos = session_rows([keys[i] for i in real])
    n_tok = mask.sum(-1).tolist()
    kw, _ = compaction_options(config)
    facts = [SegmentFact(rid, k, extra_fields[i]["segment_kind"], int(n_tok[i]), extra_fields[i]["compactions"],
                         extra_fields[i]["finish_reason"]) for i, rid, k in zip(real, ids, pos)]
    return vocabulary_metrics(facts, kw)
