"""rollout_metrics / eval_metrics (what log_rollout and log_eval_rollout log) on hand-made samples, numbers
worked out by hand; needs neither slime nor torch (the job test, test_job.py, reads them from slime's log)."""
from types import SimpleNamespace

import pytest

from compactionrl_fast.integrations.slime import eval_metrics, rollout_metrics


def _sample(rid, kind, mask, segments, reason, compactions):
    return SimpleNamespace(rollout_id=rid, index=rid, loss_mask=mask, metadata={"compaction": dict(
        kind=kind, segments=segments, finish_reason=reason, compactions=compactions)})


def _batch():
    # rollout 0: exec (3 trainable), summary (2), exec (1): 1 compaction, max_turns
    # rollout 1: one exec window (4 trainable), done; rollout 2: its environment failed at reset
    return [_sample(0, "exec", [1, 1, 0, 1], 3, "max_turns", 1), _sample(0, "summary", [1, 1], 3, "max_turns", 1),
            _sample(1, "exec", [1, 1, 1, 1], 1, "done", 0), _sample(0, "exec", [0, 1], 3, "max_turns", 1),
            _sample(2, None, [], 0, "error", 0)]


def test_rollout_metrics_by_hand():
    assert rollout_metrics(_batch()) == pytest.approx({
        "compaction/compactions_per_rollout": 1 / 3, "compaction/segments_per_rollout": 4 / 3,
        "compaction/summary_tokens_per_rollout": 2 / 3, "compaction/trainable_tokens_per_exec_segment": 8 / 3,
        "compaction/trainable_tokens_per_summary_segment": 2.0, "compaction/finish_reason/done": 1 / 3,
        "compaction/finish_reason/error": 1 / 3, "compaction/finish_reason/max_turns": 1 / 3,
        "compaction/rollouts": 3})
    assert rollout_metrics([SimpleNamespace(rollout_id=0, index=0, loss_mask=[1], metadata={})]) == {}


def test_eval_metrics_by_hand():
    last = [s for s in _batch() if s.rollout_id != 0] + [_batch()[3]]  # eval: each rollout's last segment
    assert eval_metrics({"mem": {"samples": last, "rewards": [0, 1, 0]}}) == pytest.approx({
        "eval/mem/compaction/compactions_per_rollout": 1 / 3, "eval/mem/compaction/segments_per_rollout": 4 / 3,
        "eval/mem/compaction/finish_reason/done": 1 / 3, "eval/mem/compaction/finish_reason/error": 1 / 3,
        "eval/mem/compaction/finish_reason/max_turns": 1 / 3, "eval/mem/compaction/rollouts": 3})
