"""compactionrl-fast: fused ops, a compaction rollout runtime and a PPO trainer for CompactionRL.

The public API is re-exported here; see the README for the list.
"""
from .ops import place_final_rewards, segment_gae
from .ops import linear_logprobs, linear_logprobs_loss
from .ops._dispatch import available as available_backends

__version__ = "0.1.0"
__all__ = ["segment_gae", "place_final_rewards", "available_backends", "__version__"]
__all__ += ["linear_logprobs", "linear_logprobs_loss"]
