"""What users watch: the recipe's numbers per rollout step, logged with slime's own tracking.

    --custom-rollout-log-function-path compactionrl_fast.integrations.slime.log_rollout
    --custom-eval-rollout-log-function-path compactionrl_fast.integrations.slime.log_eval_rollout

Each logs `compaction/...` (eval: `eval/<dataset>/compaction/...`) through slime's `logging_utils.log` (wandb,
tensorboard, whichever is on) and one `compaction <rollout_id>: {...}` (`compaction eval <rollout_id>: {...}`)
line with Python's logging, then returns False so that slime logs its own metrics as well. Read from the
samples `generate` returns (`metadata["compaction"]`, `loss_mask`); samples of another generate function are
not counted.
"""
from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger(__name__)


def rollout_metrics(samples) -> dict:
    """Per rollout (samples sharing rollout_id): compactions, segments and summary tokens (mean); per segment
    kind: trainable tokens per segment (mean); finish reasons (fraction of rollouts); rollouts counted."""
    by = {}
    for s in samples:
        info = (s.metadata or {}).get("compaction")
        if info is not None:
            by.setdefault(s.rollout_id if s.rollout_id is not None else s.index, []).append((s, info))
    if not by:
        return {}
    trainable, reasons = {}, Counter()
    per_rollout = {"compactions": [], "segments": [], "summary_tokens": []}
    for segs in by.values():
        info = segs[0][1]
        per_rollout["compactions"].append(info["compactions"])
        per_rollout["segments"].append(info["segments"])
        per_rollout["summary_tokens"].append(sum(sum(s.loss_mask or ()) for s, i in segs if i["kind"] == "summary"))
        reasons[info["finish_reason"]] += 1
        for s, i in segs:
            if i["kind"] is not None:  # None: an episode whose environment failed at reset
                trainable.setdefault(i["kind"], []).append(sum(s.loss_mask or ()))
    n = len(by)
    out = {f"compaction/{k}_per_rollout": sum(v) / n for k, v in per_rollout.items()}
    out |= {f"compaction/trainable_tokens_per_{kind}_segment": sum(v) / len(v) for kind, v in trainable.items()}
    out |= {f"compaction/finish_reason/{r}": c / n for r, c in sorted(reasons.items())}
    out["compaction/rollouts"] = n
    return out


def eval_metrics(data) -> dict:
    """rollout_metrics of each eval dataset's samples (slime's eval data: {name: {"samples": [...], ...}}), keys
    prefixed `eval/<name>/`. With `generate(..., evaluation=True)` each rollout returns its last segment only,
    which carries the rollout's counts and finish reason; the per-kind and summary token counts are left out."""
    out = {}
    for name, d in data.items():
        m = rollout_metrics(d.get("samples") or [])
        out |= {f"eval/{name}/{k}": v for k, v in m.items() if "tokens" not in k}
    return out


def _log(args, rollout_id, metrics, step_key, label):
    from slime.observability import logging_utils
    from slime.observability.rollout_metrics import compute_rollout_step

    logger.info(f"{label} {rollout_id}: {metrics}")
    if metrics:
        logging_utils.log(args, dict(metrics, **{step_key: compute_rollout_step(args, rollout_id)}),
                          step_key=step_key)


def log_rollout(rollout_id, args, samples, rollout_extra_metrics=None, rollout_time=None):
    """slime's --custom-rollout-log-function-path target (the train rollouts of one step)."""
    _log(args, rollout_id, rollout_metrics(samples), "rollout/step", "compaction")
    return False


def log_eval_rollout(rollout_id, args, data, extra_metrics=None):
    """slime's --custom-eval-rollout-log-function-path target (`eval_metrics` of slime's eval data)."""
    _log(args, rollout_id, eval_metrics(data), "eval/step", "compaction eval")
    return False
