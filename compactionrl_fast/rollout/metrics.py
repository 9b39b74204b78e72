"""The recipe's metric vocabulary: the `compaction/...` numbers every trainer logs (docs/metrics.md).

verl's plug-in (`integrations.verl.compaction_metrics`), slime's rollout log (`integrations.slime.rollout_metrics`,
`eval_metrics`) and our own trainer (`train.log.compaction_metrics`) turn what they see into `SegmentFact`s, one
per segment, and log `compaction_metrics(facts, gae)`: the same names, computed by the same code. `VOCABULARY`
is the list of names with their meanings; docs/metrics.md lists exactly these (tests/test_docs.py checks it).

No framework is needed (neither verl nor slime): the facts are plain numbers and strings; the cross-segment
scale comes from the op `segment_params` (the numbers `segment_gae` reads), not from a restatement of its modes.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..ops import segment_params
from .records import EXEC, SEGMENT_KINDS, SUMMARY

PREFIX = "compaction/"
REASON = "<reason>"  # the one open part of a name: any finish reason (done, max_turns, context_full, error, ...)

# name -> meaning, in the order docs/metrics.md lists them. "Rollout" means a whole compacted episode (all its
# segments); "segment" an execution window or a summary generation; "trainable tokens" the tokens the policy
# sampled in a segment (the ones the loss sees).
VOCABULARY = {
    "compaction/rollouts": "rollouts counted (distinct rollout ids among the segments seen)",
    "compaction/compactions_per_rollout/mean": "summaries written per rollout, mean over rollouts",
    "compaction/compactions_per_rollout/max": "summaries written per rollout, max over rollouts",
    "compaction/segments_per_rollout/mean": "segments (execution windows and summaries) per rollout, mean",
    "compaction/segments_per_rollout/max": "segments (execution windows and summaries) per rollout, max",
    "compaction/summary_tokens_per_rollout/mean": "trainable tokens of a rollout's summaries together, mean",
    "compaction/summary_tokens_per_rollout/max": "trainable tokens of a rollout's summaries together, max",
    "compaction/trainable_tokens_per_segment/exec/mean": "trainable tokens per execution window, mean",
    "compaction/trainable_tokens_per_segment/summary/mean": "trainable tokens per summary, mean",
    "compaction/trainable_tokens_share/exec": "execution windows' share of all trainable tokens",
    "compaction/trainable_tokens_share/summary": "summaries' share of all trainable tokens",
    "compaction/cross_segment_scale/mean": "advantage scale (gamma*lam_s)^N_later of each segment, mean over "
                                           "segments (1 with cross_segment none / stitched)",
    "compaction/cross_segment_scale/min": "advantage scale (gamma*lam_s)^N_later of each segment, min",
    f"compaction/finish_reason/{REASON}": "fraction of rollouts that ended so (done, max_turns, context_full, "
                                          "error, ...)",
}
# names that need every segment's trainable tokens; and the ones that also need the GAE options
TOKEN_NAMES = tuple(n for n in VOCABULARY if "tokens" in n or "cross_segment_scale" in n)
SCALE_NAMES = tuple(n for n in VOCABULARY if "cross_segment_scale" in n)
GAE_KEYS = ("gamma", "lam", "cross_segment", "adaptive_alpha", "adaptive_length")


class SegmentFact(NamedTuple):
    """One segment as the metrics see it.

    rollout: the rollout's id (any hashable; equal for the segments of one rollout). index: the segment's
    index in its rollout, 0-based (segments per rollout = the largest index seen + 1, so a rollout seen only
    by its last segment, as slime's eval returns it, still counts all of them). kind: "exec", "summary", or
    None for a rollout without any segment (its environment failed at reset: counted as a rollout with 0
    segments). tokens: its trainable tokens, None where unknown (then every name of TOKEN_NAMES is left out).
    compactions, finish_reason: the rollout's.
    """
    rollout: object
    index: int
    kind: Optional[str]
    tokens: Optional[int]
    compactions: int
    finish_reason: str


def entry(key: str) -> Optional[str]:
    """The VOCABULARY name that a logged key is an instance of (an `eval/<name>/` prefix or any other prefix
    before `compaction/` is allowed), or None when the key is not one of the vocabulary."""
    i = key.find(PREFIX)
    if i < 0:
        return None
    name = key[i:]
    if name in VOCABULARY:
        return name
    head, _, reason = name.rpartition("/")
    if head == "compaction/finish_reason" and reason:
        return f"compaction/finish_reason/{REASON}"
    return None


def _kind(name: str) -> Optional[str]:
    """The segment kind a per-kind name is about (".../exec/mean", ".../summary"), else None."""
    parts = name.split("/")
    return next((k for k in SEGMENT_KINDS if k in parts[2:]), None)


def names(kinds=(EXEC, SUMMARY), reasons=(), *, tokens: bool = True, scale: bool = True) -> set:
    """The keys `compaction_metrics` returns for at least one rollout, segments of `kinds`, rollouts that ended
    with `reasons`, every segment's trainable tokens known (`tokens`) and the GAE options given (`scale`)."""
    out = set()
    for n in VOCABULARY:
        if n.endswith(REASON):
            out |= {n.replace(REASON, str(r)) for r in reasons}
        elif (n in TOKEN_NAMES and not tokens) or (n in SCALE_NAMES and not (scale and kinds)):
            continue
        elif _kind(n) is None or _kind(n) in kinds:
            out.add(n)
    return out


def cross_segment_scales(tokens_by_rollout, gae) -> list:
    """The advantage scale of each segment ([[float]] per rollout, segments in order) as `segment_gae`
    resolves it from the GAE options `gae` (gamma, lam, cross_segment, adaptive_alpha, adaptive_length): row 2 of
    the op `segment_params` on a layout with each segment's trainable tokens (the scale depends on nothing else)."""
    lens = [n for r in tokens_by_rollout for n in r]
    cu_seqlens = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    cu_segments = torch.tensor([0] + [len(r) for r in tokens_by_rollout], dtype=torch.int64).cumsum(0)
    mask = torch.ones(int(cu_seqlens[-1]), dtype=torch.bool)
    kw = {k: gae[k] for k in GAE_KEYS if k in gae}
    scale = segment_params(mask, cu_seqlens, cu_segments, **kw)[2].tolist()
    out, i = [], 0
    for r in tokens_by_rollout:
        out.append(scale[i:i + len(r)])
        i += len(r)
    return out


def compaction_metrics(facts, gae=None) -> dict:
    """The vocabulary's numbers (floats, keys of VOCABULARY; `<reason>` made concrete) of a batch of segments.

    Args:
        facts: iterable of SegmentFact (any order; a rollout's segments need not all be there, see `index`).
        gae: the GAE options (a mapping with gamma, lam (float or "adaptive"), cross_segment, adaptive_alpha,
            adaptive_length; others ignored, absent ones take segment_gae's defaults), or None: the
            cross-segment scale is left out.
    Returns {} without facts. Per-kind names only for the kinds present; token names only when every segment's
    tokens are known; the scale only with `gae` and at least one segment.
    Raises ValueError for a kind other than "exec", "summary" or None.
    """
    by = {}
    for f in facts:
        if f.kind is not None and f.kind not in SEGMENT_KINDS:
            raise ValueError(f"segment kind must be one of {sorted(SEGMENT_KINDS)} or None, got {f.kind!r}")
        by.setdefault(f.rollout, []).append(f)
    if not by:
        return {}
    rollouts = [sorted((f for f in fs if f.kind is not None), key=lambda f: f.index) for fs in by.values()]
    last = [max(fs, key=lambda f: (f.kind is not None, f.index)) for fs in by.values()]
    segs = [f for r in rollouts for f in r]
    out = {"compaction/rollouts": float(len(by))}

    def stat(name, xs, *aggs):
        xs = [float(x) for x in xs]
        for agg in aggs:
            out[f"compaction/{name}/{agg}"] = sum(xs) / len(xs) if agg == "mean" else \
                (max(xs) if agg == "max" else min(xs))

    stat("compactions_per_rollout", [f.compactions for f in last], "mean", "max")
    stat("segments_per_rollout", [r[-1].index + 1 if r else 0 for r in rollouts], "mean", "max")
    if all(f.tokens is not None for f in segs):
        stat("summary_tokens_per_rollout", [sum(f.tokens for f in r if f.kind == SUMMARY) for r in rollouts],
             "mean", "max")
        total = sum(f.tokens for f in segs)
        for kind in SEGMENT_KINDS:
            n = [f.tokens for f in segs if f.kind == kind]
            if n:
                out[f"compaction/trainable_tokens_per_segment/{kind}/mean"] = sum(n) / len(n)
                out[f"compaction/trainable_tokens_share/{kind}"] = sum(n) / total if total else 0.0
        if gae is not None and segs:
            stat("cross_segment_scale", [x for r in cross_segment_scales([[f.tokens for f in r] for r in rollouts],
                                                                         gae) for x in r], "mean", "min")
    reasons = [str(f.finish_reason) for f in last]
    for why in sorted(set(reasons)):
        out[f"compaction/finish_reason/{why}"] = reasons.count(why) / len(reasons)
    return out


def rollout_facts(rollouts, ids=None) -> list:
    """SegmentFacts of `Rollout` records (the compaction loop's): one per segment, its trainable tokens the ones
    the policy sampled in it (`Segment.num_trainable`); a rollout without segments gives one fact of kind None.
    ids: the rollouts' ids (default: their positions)."""
    out = []
    for i, r in enumerate(rollouts):
        rid = i if ids is None else ids[i]
        segs = [(s.kind, s.num_trainable) for s in r.segments] or [(None, 0)]
        out += [SegmentFact(rid, k, kind, n, r.compactions, r.finish_reason) for k, (kind, n) in enumerate(segs)]
    return out
