"""CompactionRL inside slime (docs/slime.md): the paper's advantages and returns as slime's
--custom-advantage-function-path (`compute_advantages`), and the compaction loop as its
--custom-generate-function-path (`generate`) against slime's SGLang router.

    --advantage-estimator ppo \\
    --custom-advantage-function-path compactionrl_fast.integrations.slime.compute_advantages \\
    --custom-generate-function-path compactionrl_fast.integrations.slime.generate \\
    --custom-config-path compaction.yaml      # the compaction_* options
    --custom-rollout-log-function-path compactionrl_fast.integrations.slime.log_rollout   # what to watch

Nothing here imports slime, megatron or sglang at import time.
"""
from .advantages import compute_advantages
from .engine import RolloutAborted, SGLangEngine, parse_generate_response
from .generate import generate, rollout_config, samples_from_calls, samples_from_rollout
from .log import eval_metrics, log_eval_rollout, log_rollout, rollout_metrics

__all__ = ["RolloutAborted", "SGLangEngine", "compute_advantages", "eval_metrics", "generate", "log_eval_rollout",
           "log_rollout", "parse_generate_response", "rollout_config", "rollout_metrics", "samples_from_calls",
           "samples_from_rollout"]
