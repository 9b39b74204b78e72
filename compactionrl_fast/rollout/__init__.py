"""The compaction rollout runtime: config, the batched loop, async episodes, compaction, records, engines
(the server engine included), segments from call logs."""
from .calls import Call, calls_from_rollout, loop_summary_suffix, rollout_from_calls
from .compaction import ChatFormat, needs_compaction, rebuild
from .config import RESUME_TEMPLATE, SUMMARY_INSTRUCTION, RolloutConfig
from .engines import Engine, Generation, TransformersEngine, VLLMEngine, vllm_available
from .engines.server_engine import ServerEngine, ServerFleetError
from .episodes import arun_episodes, run_episodes
from .loop import Environment, arun_rollouts, run_rollouts
from .records import Rollout, Segment, Turn

__all__ = ["RolloutConfig", "SUMMARY_INSTRUCTION", "RESUME_TEMPLATE", "ChatFormat", "needs_compaction", "rebuild",
           "Engine", "Generation", "TransformersEngine", "VLLMEngine", "vllm_available", "Environment",
           "run_rollouts", "arun_rollouts", "Rollout", "Segment", "Turn",
           "Call", "rollout_from_calls", "calls_from_rollout", "loop_summary_suffix",
           "ServerEngine", "ServerFleetError", "run_episodes", "arun_episodes"]
