"""The compaction rollout runtime: config, the batched loop, compaction, records, engines,
segments from call logs."""
from .calls import Call, calls_from_rollout, loop_summary_suffix, rollout_from_calls
from .compaction import ChatFormat, needs_compaction, rebuild
from .config import RESUME_TEMPLATE, SUMMARY_INSTRUCTION, RolloutConfig
from .engines import Engine, Generation, TransformersEngine, VLLMEngine, vllm_available
from .loop import Environment, arun_rollouts, run_rollouts
from .records import Rollout, Segment, Turn

__all__ = ["RolloutConfig", "SUMMARY_INSTRUCTION", "RESUME_TEMPLATE", "ChatFormat", "needs_compaction", "rebuild",
           "Engine", "Generation", "TransformersEngine", "VLLMEngine", "vllm_available", "Environment",
           "run_rollouts", "arun_rollouts", "Rollout", "Segment", "Turn",
           "Call", "rollout_from_calls", "calls_from_rollout", "loop_summary_suffix"]
