"""rollout.metrics: the recipe's metric vocabulary (docs/metrics.md) from per-segment facts, numbers worked out
by hand; the cross-segment scale against the reference op on real masks; the keys against the table; the docs
page against the table."""
import os
import random
import re

import pytest
import torch

from compactionrl_fast.reference import gae as ref
from compactionrl_fast.rollout import Rollout, Segment
from compactionrl_fast.rollout.metrics import (REASON, VOCABULARY, SegmentFact, compaction_metrics, entry, names,
                                               rollout_facts)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F = SegmentFact
# rollout a: exec 3, summary 2, exec 1 trainable tokens, 1 compaction, max_turns; b: exec 4, done; c: failed at reset
FACTS = [F("a", 0, "exec", 3, 1, "max_turns"), F("a", 1, "summary", 2, 1, "max_turns"), F("b", 0, "exec", 4, 0, "done"),
         F("a", 2, "exec", 1, 1, "max_turns"), F("c", 0, None, 0, 0, "error")]
COUNTS = {"compaction/rollouts": 3, "compaction/compactions_per_rollout/mean": 1 / 3,
          "compaction/compactions_per_rollout/max": 1, "compaction/segments_per_rollout/mean": 4 / 3,
          "compaction/segments_per_rollout/max": 3, "compaction/finish_reason/done": 1 / 3,
          "compaction/finish_reason/error": 1 / 3, "compaction/finish_reason/max_turns": 1 / 3}
TOKENS = {"compaction/summary_tokens_per_rollout/mean": 2 / 3, "compaction/summary_tokens_per_rollout/max": 2,
          "compaction/trainable_tokens_per_segment/exec/mean": 8 / 3,
          "compaction/trainable_tokens_per_segment/summary/mean": 2.0,
          "compaction/trainable_tokens_share/exec": 0.8, "compaction/trainable_tokens_share/summary": 0.2}


def test_by_hand():
    m = compaction_metrics(FACTS, {"lam": 0.5})  # gamma 1: scales 0.5^3, 0.5^1, 1 (rollout a) and 1 (b)
    assert m == pytest.approx(COUNTS | TOKENS | {"compaction/cross_segment_scale/mean": 2.625 / 4,
                                                  "compaction/cross_segment_scale/min": 0.125})
    assert all(isinstance(v, float) for v in m.values())
    assert compaction_metrics(FACTS) == pytest.approx(COUNTS | TOKENS)  # no GAE options: no scale
    assert compaction_metrics(reversed(FACTS), {"lam": 0.5}) == pytest.approx(m)  # any order
    assert compaction_metrics([]) == {} and compaction_metrics([], {"lam": 0.5}) == {}


def test_a_rollout_seen_by_its_last_segment_counts_every_segment():
    """slime's eval: the last segment only, tokens unknown: the counts of the whole rollouts, no token names."""
    last = [F("a", 2, "exec", None, 1, "max_turns"), F("b", 0, "exec", None, 0, "done"),
            F("c", 0, None, None, 0, "error")]
    assert compaction_metrics(last, {"lam": 0.5}) == pytest.approx(COUNTS)
    # one unknown segment is enough to leave every token name out
    assert compaction_metrics(FACTS[:-1] + [FACTS[-1]._replace(tokens=None)]) == pytest.approx(COUNTS | TOKENS)
    assert set(compaction_metrics([f._replace(tokens=None) if f.rollout == "b" else f for f in FACTS])) \
        == set(COUNTS)


def test_kinds_are_checked_and_absent_kinds_left_out():
    with pytest.raises(ValueError, match="segment kind"):
        compaction_metrics([F("a", 0, "tool", 1, 0, "done")])
    m = compaction_metrics([F("a", 0, "exec", 2, 0, "done")], {})
    assert set(m) == names(kinds=("exec",), reasons=("done",))
    assert m["compaction/trainable_tokens_share/exec"] == 1.0 and m["compaction/cross_segment_scale/min"] == 1.0
    # no trainable token at all: shares 0, the scale still defined
    z = compaction_metrics([F("a", 0, "exec", 0, 0, "done"), F("a", 1, "summary", 0, 1, "done")], {"lam": 0.5})
    assert z["compaction/trainable_tokens_share/exec"] == 0.0 and z["compaction/cross_segment_scale/min"] == 1.0


def _random_rollouts(rng, n):
    """Rollouts of random segments (kinds alternating exec/summary), each with observation tokens in between
    its trainable ones; a few without segments."""
    out = []
    for _ in range(n):
        segs = []
        for k in range(rng.choice([0, 1, 2, 3, 5])):
            mask = [False] + [rng.random() < 0.7 for _ in range(rng.randrange(0, 9))]
            segs.append(Segment("summary" if k % 2 else "exec", [0] * len(mask), mask, [0.0] * len(mask)))
        out.append(Rollout(segments=segs, compactions=len(segs) // 2,
                           finish_reason=rng.choice(["done", "max_turns", "context_full", "error"])))
    return out


@pytest.mark.parametrize("gae", [dict(gamma=1.0, lam="adaptive"), dict(gamma=0.9, lam=0.8),
                                 dict(gamma=1.0, lam="adaptive", adaptive_length="segment", adaptive_alpha=3.0),
                                 dict(gamma=0.7, lam=0.9, cross_segment="none"),
                                 dict(gamma=0.7, lam="adaptive", cross_segment="stitched")])
def test_cross_segment_scale_is_the_reference_ops_on_the_real_masks(gae):
    """The scale from token counts equals the reference segment_params on the rollouts' packed masks (with their
    observation tokens), for fixed and adaptive lambda, rollout and segment lengths, the three cross modes."""
    rng = random.Random(5)
    ro = _random_rollouts(rng, 12)
    segs = [s for r in ro for s in r.segments]
    mask = torch.tensor([m for s in segs for m in s.loss_mask], dtype=torch.bool)
    cu_seqlens = torch.tensor([0] + [len(s) for s in segs]).cumsum(0)
    cu_segments = torch.tensor([0] + [len(r.segments) for r in ro]).cumsum(0)
    want = ref.segment_params(mask, cu_seqlens, cu_segments, **gae)[2]
    m = compaction_metrics(rollout_facts(ro), gae)
    assert m["compaction/cross_segment_scale/mean"] == pytest.approx(float(want.mean()), rel=1e-12)
    assert m["compaction/cross_segment_scale/min"] == pytest.approx(float(want.min()), rel=1e-12)
    if gae.get("cross_segment", "paper") != "paper":
        assert m["compaction/cross_segment_scale/min"] == 1.0
    else:
        assert m["compaction/cross_segment_scale/min"] < 1.0


def test_rollout_facts():
    seg = lambda kind, n: Segment(kind, [0] * (n + 1), [False] + [True] * n, [0.0] * (n + 1))  # noqa: E731
    a = Rollout(segments=[seg("exec", 3), seg("summary", 2)], compactions=1, finish_reason="max_turns")
    b = Rollout(finish_reason="error")
    assert rollout_facts([a, b]) == [F(0, 0, "exec", 3, 1, "max_turns"), F(0, 1, "summary", 2, 1, "max_turns"),
                                     F(1, 0, None, 0, 0, "error")]
    assert [f.rollout for f in rollout_facts([a, b], ids=["x", "y"])] == ["x", "x", "y"]


def test_keys_are_the_vocabularys_names_for_the_data_seen():
    """On random batches: the keys are exactly `names` of the kinds and reasons present, every key an entry of
    VOCABULARY; `entry` reads prefixed keys and refuses others."""
    rng = random.Random(11)
    for trial in range(40):
        ro = _random_rollouts(rng, rng.randrange(1, 6))
        facts = rollout_facts(ro)
        gae = {"lam": 0.9} if trial % 2 else None
        m = compaction_metrics(facts, gae)
        kinds = {f.kind for f in facts if f.kind is not None}
        assert set(m) == names(kinds=kinds, reasons={r.finish_reason for r in ro}, scale=gae is not None)
        assert all(entry(k) in VOCABULARY for k in m)
    assert entry("eval/mem/compaction/finish_reason/done") == f"compaction/finish_reason/{REASON}"
    assert entry("eval/mem/compaction/rollouts") == "compaction/rollouts"
    for bad in ("compactions", "compaction/compactions_per_rollout", "compaction/finish_reason/",
                "compaction/trainable_tokens_share/tool", "compaction/rollouts/mean"):
        assert entry(bad) is None, bad
    assert names(kinds=(), reasons=("error",)) == {n for n in VOCABULARY if "_per_rollout/" in n or n.endswith(
        "/rollouts")} | {"compaction/finish_reason/error"}


def _listed(page):
    """The backquoted first cells of the markdown table rows of a docs page."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", f.read(), re.M)]


def test_the_docs_page_lists_exactly_the_vocabulary():
    assert _listed("metrics.md") == list(VOCABULARY)


def test_no_other_docs_page_lists_a_name():
    """The vocabulary is listed once: the other pages link to metrics.md instead of naming its metrics."""
    found = []
    for page in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        if page.endswith(".md") and page != "metrics.md":
            with open(os.path.join(ROOT, "docs", page)) as f:
                found += [(page, n) for n in re.findall(r"`([^`\s]*compaction/[a-z][^`\s]*)`", f.read())]
    assert not found
    for page in ("README.md", "verl.md", "slime.md"):
        with open(os.path.join(ROOT, "docs", page)) as f:
            assert "(metrics.md)" in f.read(), page
