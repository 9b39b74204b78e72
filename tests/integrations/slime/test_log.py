"""rollout_metrics / eval_metrics (what log_rollout and log_eval_rollout log) on hand-made samples, numbers
worked out by hand; needs no slime (the job test, test_job.py, reads them from slime's log)."""
from types import SimpleNamespace

import pytest

from compactionrl_fast.integrations.slime import eval_metrics, rollout_metrics
from compactionrl_fast.rollout import metrics as vocabulary
from tests.rollout.test_metrics import COUNTS, TOKENS  # the same three rollouts as FACTS there, as slime samples


def _sample(rid, k, kind, mask, segments, reason, compactions):
    return SimpleNamespace(rollout_id=rid, index=rid, loss_mask=mask, metadata={"round_number": k, "compaction": dict(
        kind=kind, segments=segments, finish_reason=reason, compactions=compactions)})


def _batch():
    # tests/rollout/test_metrics.py's FACTS as slime samples: rollout 0 (its "a"): exec (3 trainable), summary (2),
    # exec (1), 1 compaction, max_turns; rollout 1 ("b"): one exec window (4), done; 2 ("c"): failed at reset
    return [_sample(0, 0, "exec", [1, 1, 0, 1], 3, "max_turns", 1), _sample(0, 1, "summary", [1, 1], 3, "max_turns", 1),
            _sample(1, 0, "exec", [1, 1, 1, 1], 1, "done", 0), _sample(0, 2, "exec", [0, 1], 3, "max_turns", 1),
            _sample(2, 0, None, [], 0, "error", 0)]


def test_rollout_metrics_by_hand():
    assert rollout_metrics(_batch()) == pytest.approx(COUNTS | TOKENS)
    assert rollout_metrics([SimpleNamespace(rollout_id=0, index=0, loss_mask=[1], metadata={})]) == {}


def test_rollout_metrics_with_slimes_args_add_the_cross_segment_scale():
    """The GAE options of slime's args (what compute_advantages reads): lam 0.5 gives rollout 0's segments
    0.5^3, 0.5^1, 1 and rollout 1's exec window 1; gamma 0.5 and lam 1 the same."""
    scale = {"compaction/cross_segment_scale/mean": (0.125 + 0.5 + 1 + 1) / 4,
             "compaction/cross_segment_scale/min": 0.125}
    for args in (SimpleNamespace(gamma=1.0, compaction_lam=0.5), SimpleNamespace(gamma=0.5, compaction_lam=1.0)):
        assert rollout_metrics(_batch(), args) == pytest.approx(COUNTS | TOKENS | scale)
    none = SimpleNamespace(gamma=1.0, compaction_lam=0.5, compaction_cross_segment="none")
    assert rollout_metrics(_batch(), none)["compaction/cross_segment_scale/min"] == 1.0
    with pytest.raises(ValueError, match="compaction_lam"):
        rollout_metrics(_batch(), SimpleNamespace(compaction_lam="adaptiv"))


def test_eval_metrics_by_hand():
    last = [s for s in _batch() if s.rollout_id != 0] + [_batch()[3]]  # eval: each rollout's last segment
    assert eval_metrics({"mem": {"samples": last, "rewards": [0, 1, 0]}}) == pytest.approx(
        {f"eval/mem/{k}": v for k, v in COUNTS.items()})


def test_the_keys_are_exactly_the_vocabularys():
    """The names of rollout.metrics.VOCABULARY (docs/metrics.md) for the data seen: both kinds, three finish
    reasons; the scale only with slime's args; eval: the count names only, under eval/<name>/."""
    reasons = ("done", "error", "max_turns")
    assert set(rollout_metrics(_batch())) == vocabulary.names(reasons=reasons, scale=False)
    assert set(rollout_metrics(_batch(), SimpleNamespace(gamma=1.0))) == vocabulary.names(reasons=reasons)
    ev = eval_metrics({"mem": {"samples": _batch()}})
    assert set(ev) == {f"eval/mem/{k}" for k in vocabulary.names(reasons=reasons, tokens=False)}
    assert all(vocabulary.entry(k) in vocabulary.VOCABULARY for k in ev)
    exec_only = [s for s in _batch() if s.rollout_id == 1]
    assert set(rollout_metrics(exec_only, SimpleNamespace())) == vocabulary.names(kinds=("exec",), reasons=("done",))
