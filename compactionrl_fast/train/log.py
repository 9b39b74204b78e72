"""The metrics of a run: rollout statistics, the recipe's `compaction/...` vocabulary (docs/metrics.md), and
metrics.jsonl (plus TensorBoard) written by rank 0."""
from __future__ import annotations

import json
import math
import os

from ..rollout.metrics import GAE_KEYS, rollout_facts
from ..rollout.metrics import compaction_metrics as vocabulary_metrics
from . import atomic, diagnostics, dist


def rollout_metrics(rollouts: list, prefix: str = "") -> dict:
    """Reward, success, compactions, summary length, finish reasons, and the environments' numeric info."""
    n = max(len(rollouts), 1)
    out = {"reward": sum(r.reward for r in rollouts) / n, "success": sum(r.success for r in rollouts) / n,
           "compactions": sum(r.compactions for r in rollouts) / n,
           "truncated": sum(r.truncated for r in rollouts) / n,
           "errors": sum(r.finish_reason == "error" for r in rollouts) / n,
           "turns": sum(len(r.turns) for r in rollouts) / n}
    lens = [x for r in rollouts for x in r.summary_lengths]
    out["summary_tokens"] = sum(lens) / len(lens) if lens else 0.0
    keys = {k for r in rollouts for k, v in r.info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for k in sorted(keys):
        vals = [float(r.info[k]) for r in rollouts if isinstance(r.info.get(k), (int, float))]
        out["info/" + k] = sum(vals) / len(vals)
    return {prefix + k: v for k, v in out.items()}


def compaction_metrics(rollouts: list, cfg=None, group=None) -> dict:
    """The recipe's vocabulary (`compaction/...`, docs/metrics.md) of a step's rollouts on every rank: each rank's
    SegmentFacts are gathered (all_gather_object over `group`), so every rank returns the same numbers of the
    whole step. cfg: the TrainConfig whose GAE options give the cross-segment scale (None: left out)."""
    rank, ws = dist.world()
    facts = rollout_facts(rollouts, ids=[(rank, i) for i in range(len(rollouts))])
    if ws > 1:
        import torch.distributed

        parts = [None] * ws
        torch.distributed.all_gather_object(parts, facts, group=group)
        facts = [f for p in parts for f in p]
    gae = None if cfg is None else {k: getattr(cfg, k) for k in GAE_KEYS}
    return vocabulary_metrics(facts, gae)


def read_rows(path: str) -> list:
    """The rows of a metrics.jsonl, skipping lines that do not parse (a write cut by a kill)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


class MetricsLog:
    """JSON lines in run_dir/metrics.jsonl (rank 0), and TensorBoard scalars when it is installed."""

    def __init__(self, run_dir: str, *, resume_step: int | None = None, tensorboard: bool = True):
        self.rank = dist.world()[0]
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        if self.rank != 0:
            return
        os.makedirs(run_dir, exist_ok=True)
        atomic.remove_stale_temps(run_dir)  # temporary files of a run killed mid-write
        if resume_step is not None and os.path.isfile(self.path):
            # drop rows logged after the checkpoint (those steps are redone) and a line cut by a kill
            rows = [json.dumps(r) + "\n" for r in read_rows(self.path) if r.get("step", -1) < resume_step]
            atomic.write_text(self.path, "".join(rows))
        elif os.path.isfile(self.path):
            os.remove(self.path)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except Exception:  # noqa: BLE001 -- tensorboard is optional
                self.tb = None

    def log(self, step: int, metrics: dict) -> None:
        if self.rank != 0:
            return
        row = {"step": step, **diagnostics.finite(metrics)}
        line = json.dumps(row) + "\n"
        with open(self.path, "a") as f:  # one line appended and synced; a line cut by a kill is dropped on resume
            size = f.tell()
            try:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                f.truncate(size)  # no partial line left behind
                if atomic.is_no_space(e):
                    raise OSError(e.errno, f"no space left on device while writing {self.path}") from e
                raise
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
