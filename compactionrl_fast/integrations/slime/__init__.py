"""CompactionRL inside slime (docs/slime.md): the paper's advantages and returns as slime's
--custom-advantage-function-path (`compute_advantages`), and the compaction loop as its
--custom-generate-function-path (`generate`) against slime's SGLang router.

    --advantage-estimator ppo \\
    --custom-advantage-function-path compactionrl_fast.integrations.slime.compute_advantages \\
    --custom-generate-function-path compactionrl_fast.integrations.slime.generate \\
    --custom-config-path compaction.yaml      # the compaction_* options

Nothing here imports slime, megatron or sglang at import time.
"""
from .advantages import compute_advantages
from .engine import RolloutAborted, SGLangEngine, parse_generate_response
from .generate import generate, rollout_config, samples_from_calls, samples_from_rollout

__all__ = ["RolloutAborted", "SGLangEngine", "compute_advantages", "generate", "parse_generate_response",
           "rollout_config", "samples_from_calls", "samples_from_rollout"]
