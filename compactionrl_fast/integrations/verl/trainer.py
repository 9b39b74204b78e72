"""verl trainer mode `compaction_sync`: verl's synchronous V1 PPO trainer with the paper's advantages
(docs/verl.md).

Imports verl's V1 trainer (it needs TransferQueue); the plug-in (plugin.py) registers the class.
Selected with `trainer.v1.trainer_mode=compaction_sync`; its options are the `algorithm.compaction_gae`
keys (_options.py, plus `critic_target`), and `compaction.train_summary_tokens` (default true; false: the
ablation, summary tokens out of the policy loss as in our trainer: the critic and the advantages still see
them, the actor's update does not, token-mean over the execution tokens). Everything but these is verl's sync
trainer: the replay buffer, refill and checkpoint behaviour (verl compares `trainer_mode` with "sync";
this class answers "sync" there), the critic and actor updates, `loss_agg_mode`.
"""
from __future__ import annotations

import numpy as np
import torch

from verl.trainer.ppo.v1 import trainer_base as tb  # its tq, DataProto and helpers, read at call time
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from .._common import cfg_get
from .advantages import check_row_lengths, compaction_advantages
from .log import compaction_metrics

TRAINER_MODE = "compaction_sync"
ESTIMATORS = ("gae", "compaction_gae")  # the critic-based estimators this mode stands in for


def _row_lengths(t):
    """[B] lengths of the rows of verl's unpadded (jagged nested) field; a padded [B, L] field: all L."""
    if getattr(t, "is_nested", False):
        return t.offsets().diff()
    return [t.shape[-1]] * t.shape[0]


class CompactionSyncTrainer(PPOTrainerSync):
    """PPOTrainerSync whose `_compute_advantage` computes the paper's advantages and returns over the rows
    of each `{uid}_{session_id}` (a compacted rollout, its outputs in index order) with our ops."""

    @property
    def trainer_mode(self):
        # verl reads trainer_mode for sync-vs-async decisions and for its `trainer.v1.<mode>` section: "sync"
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value):  # PPOTrainer.__init__ assigns the configured name
        self.registered_mode = value

    def _compute_advantage(self, batch, metrics):
        """verl's advantage step (KL-in-reward and rollout correction as verl does them), with the
        advantages and returns of `compaction_advantages`, written back where verl's GAE writes them."""
        algo = self.config.algorithm
        if str(algo.adv_estimator) not in ESTIMATORS:
            raise ValueError(f"algorithm.adv_estimator={algo.adv_estimator!r} with trainer.v1.trainer_mode="
                             f"{TRAINER_MODE}: this mode computes the paper's GAE; set it to one of {ESTIMATORS}")
        fields = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values",
                  "extra_fields"]
        td = tb.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        if "values" not in td.keys():
            raise ValueError(f"trainer.v1.trainer_mode={TRAINER_MODE} needs the critic's values: "
                             "set critic.enable=True")
        extra = td.pop("extra_fields").tolist() if "extra_fields" in td.keys() else [None] * len(batch)
        # rows verl adds to fill data-parallel groups copy real rows' fields: not counted in the metrics
        extra = [None if t.get("is_padding", False) else e for e, t in zip(extra, batch.tags)]
        response_mask = td["response_mask"]
        check_row_lengths(list(batch.keys), _row_lengths(response_mask),
                          **{f: _row_lengths(td[f]) for f in fields[2:-1] if f in td.keys()})
        data = tb.DataProto(batch=td.to_padded_tensor())
        metrics.update(compaction_metrics(list(batch.keys), data.batch["response_mask"], extra, algo))
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
        if algo.use_kl_in_reward:
            data, kl_metrics = tb.apply_kl_penalty(data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=algo.kl_penalty)
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]
        corr = algo.get("rollout_correction", None)
        correction = (corr is not None and "rollout_log_probs" in data.batch
                      and not corr.get("bypass_mode", False))
        if correction:
            data, is_metrics = tb.compute_rollout_correction_and_add_to_batch(data, corr)
            metrics.update(is_metrics)

        adv, ret = compaction_advantages(list(batch.keys), data.batch["token_level_scores"], data.batch["values"],
                                         data.batch["response_mask"], algo,
                                         token_level_rewards=data.batch["token_level_rewards"])
        data.batch["advantages"], data.batch["returns"] = adv, ret

        out_fields = ["advantages", "returns"]
        if algo.use_kl_in_reward:
            out_fields.append("token_level_rewards")
        if correction:
            out_fields.append("response_mask")
            if "rollout_is_weights" in data.batch:
                out_fields.append("rollout_is_weights")
        out = {f: tb.response_to_nested(data.batch[f], response_mask) for f in out_fields}
        return tb.tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                  fields=tb.TensorDict(out, batch_size=len(batch)))

    def _update_actor(self, batch, metrics):
        """verl's actor update; with `compaction.train_summary_tokens=false` the summary rows' masks (verl's
        `response_mask`, and the `loss_mask` its workers count tokens with) are 0 while the actor trains, so its
        loss and token count leave them out, then restored for what follows (metrics, the next step)."""
        train = cfg_get(cfg_get(self.config, "compaction") or {}, "train_summary_tokens", True)
        if not isinstance(train, bool):
            raise ValueError(f"compaction.train_summary_tokens must be true or false, got {train!r}")
        if train:
            return super()._update_actor(batch, metrics)
        td = tb.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                select_fields=["response_mask", "loss_mask", "extra_fields"])
        summary = [isinstance(e, dict) and e.get("segment_kind") == "summary" for e in td.pop("extra_fields").tolist()]
        kept = td.clone()

        def policy(field):
            rows = [torch.zeros_like(m) if s else m for m, s in zip(td[field].unbind(0), summary)]
            return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

        fields = [f for f in ("response_mask", "loss_mask") if f in td.keys()]
        tb.tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                           fields=tb.TensorDict({f: policy(f) for f in fields}, batch_size=len(batch)))
        try:
            return super()._update_actor(batch, metrics)
        finally:
            tb.tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=kept.select(*fields))
