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

from .._registry import IntegrationSpec, declare  # noqa: E402

SPEC = declare(IntegrationSpec(
    name="slime", framework="slime",
    reference_tests=("tests/integrations/slime/test_advantages.py::test_world1_matches_packed_gae_and_reference",
                     "tests/integrations/slime/test_distributed.py::test_dp2_split_rollouts_equal_one_rank"),
    job_test="tests/integrations/slime/job/test_job.py", make_target="test-slime-job",
    bad_input_tests=("tests/integrations/slime/test_distributed.py::test_dp2_bad_input_raises_on_every_rank",
                     "tests/integrations/slime/test_distributed.py::test_cp_rank_bad_values_raise_on_every_rank"),
    metrics="compactionrl_fast.integrations.slime.log:rollout_metrics",
    metrics_tests=("tests/integrations/slime/test_log.py::test_the_keys_are_exactly_the_vocabularys",),
))
