"""Adapters that drop the ops into existing trainers.

- `layout`: padded `[B, L]` batches + response mask <-> the packed layout, with per-row rollout ids
  for compacted rollouts (`packed_layout`, `PackedLayout`, `segment_gae_padded`).
- `verl`: registers the `compaction_gae` advantage estimator and the `compaction` policy loss with
  verl's registries on import (when verl is importable).
- `openrlhf`: `get_advantages_and_returns`, `PolicyLoss`, `ValueLoss` with OpenRLHF's signatures.
- `trl`: `compute_advantages`, `policy_loss`, `value_loss` with the variables of TRL's PPOTrainer.

The trainer modules are imported explicitly (`import compactionrl_fast.integrations.verl`); importing
this package imports none of them.
"""
from .padded import PackedLayout, packed_layout, segment_gae_padded

__all__ = ["PackedLayout", "packed_layout", "segment_gae_padded"]
