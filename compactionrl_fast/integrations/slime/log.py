"""What users watch: the recipe's numbers per rollout step, logged with slime's own tracking.

    --custom-rollout-log-function-path compactionrl_fast.integrations.slime.log_rollout
    --custom-eval-rollout-log-function-path compactionrl_fast.integrations.slime.log_eval_rollout

Each logs the recipe's vocabulary (docs/metrics.md), `compaction/...` (eval: `eval/<dataset>/compaction/...`),
through slime's `logging_utils.log` (wandb, tensorboard, whichever is on) and one `compaction <rollout_id>: {...}`
(`compaction eval <rollout_id>: {...}`) line with Python's logging, then returns False so that slime logs its own
metrics as well. Read from the samples `generate` returns (`metadata["compaction"]`, `["round_number"]`,
`loss_mask`); samples of another generate function are not counted. The cross-segment scale of a train step comes
from the GAE options in slime's args (what `compute_advantages` reads); eval logs no token-based names.
"""
from __future__ import annotations

import logging

from ...rollout.metrics import SegmentFact, compaction_metrics
from ._options import advantage_options

logger = logging.getLogger(__name__)


def _facts(samples, tokens=True) -> list:
    """One SegmentFact per sample of our generate (`metadata["compaction"]`, `["round_number"]`): the rollout
    is `rollout_id` (else `index`), the trainable tokens the sum of `loss_mask` (None with tokens=False); a
    sample of an episode whose environment failed at reset has kind None (a rollout with no segment)."""
    out = []
    for s in samples:
        meta = s.metadata or {}
        info = meta.get("compaction")
        if info is None:
            continue
        out.append(SegmentFact(s.rollout_id if s.rollout_id is not None else s.index, int(meta["round_number"]),
                               info["kind"], sum(s.loss_mask or ()) if tokens else None, info["compactions"],
                               info["finish_reason"]))
    return out


def gae_from_args(args):
    """The GAE options `compute_advantages` reads from slime's args (`--gamma`, the `compaction_*` keys,
    `_options.advantage_options`), or None without args."""
    return None if args is None else advantage_options(args)[0]


def rollout_metrics(samples, args=None) -> dict:
    """The vocabulary of docs/metrics.md (`rollout.metrics.compaction_metrics`) of one rollout step's samples
    (a rollout: the samples sharing rollout_id). `args`: slime's args, whose GAE options give the
    cross-segment scale; None leaves the scale out."""
    return compaction_metrics(_facts(samples), gae_from_args(args))


def eval_metrics(data) -> dict:
    """The vocabulary of each eval dataset's samples (slime's eval data: {name: {"samples": [...], ...}}), keys
    prefixed `eval/<name>/`. With `generate(..., evaluation=True)` each rollout returns its last segment only,
    which carries the rollout's counts, finish reason and segment index; the names that need every segment's
    trainable tokens (per-kind tokens and shares, summary tokens, the cross-segment scale) are left out."""
    out = {}
    for name, d in data.items():
        m = compaction_metrics(_facts(d.get("samples") or [], tokens=False))
        out |= {f"eval/{name}/{k}": v for k, v in m.items()}
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
    _log(args, rollout_id, rollout_metrics(samples, args), "rollout/step", "compaction")
    return False


def log_eval_rollout(rollout_id, args, data, extra_metrics=None):
    """slime's --custom-eval-rollout-log-function-path target (`eval_metrics` of slime's eval data)."""
    _log(args, rollout_id, eval_metrics(data), "eval/step", "compaction eval")
    return False
