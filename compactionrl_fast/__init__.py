"""compactionrl-fast: fused ops, a compaction rollout runtime and a PPO trainer for CompactionRL.

The public API is re-exported here; see the README for the list.
"""
from .ops import place_final_rewards, segment_gae
from .ops import linear_logprobs, linear_logprobs_loss
from .ops import (global_denominator, global_token_count, ppo_policy_loss, value_head, value_head_loss,
                  value_loss)
from .ops._dispatch import available as available_backends
from .packing import PackedBatch, pack
from .rollout import (Rollout, RolloutConfig, Segment, TransformersEngine, VLLMEngine, arun_rollouts,
                      run_rollouts)
from .envs import MemoryEnv, ScriptedExpert, expert_rollouts, memory_config, memory_tokenizer

__version__ = "0.1.0"
__all__ = ["segment_gae", "place_final_rewards", "available_backends", "__version__"]
__all__ += ["linear_logprobs", "linear_logprobs_loss"]
__all__ += ["ppo_policy_loss", "value_loss", "value_head", "value_head_loss", "global_token_count",
            "global_denominator"]
__all__ += ["PackedBatch", "pack", "RolloutConfig", "Rollout", "Segment", "run_rollouts", "arun_rollouts",
            "TransformersEngine", "VLLMEngine", "MemoryEnv", "ScriptedExpert", "expert_rollouts", "memory_config",
            "memory_tokenizer"]
