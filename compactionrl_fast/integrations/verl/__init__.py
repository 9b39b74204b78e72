"""CompactionRL inside verl (docs/verl.md), one module a part:

- `adapter`: the advantage estimator `compaction_gae` and the policy loss `compaction` for verl's registries
  (and `compute_advantage` / `patch_compute_advantage` for the legacy trainer);
- `agent_loop`: the agent loop `compaction_agent` (our compaction loop on verl's rollout servers);
- `engine`: `ServerManagerEngine`, the `Engine` over verl's `server_manager` that the loop samples with;
- `advantages`: the paper's advantages over verl's V1 batch (rows keyed `{uid}_{session}_{index}`);
- `log`: the recipe's `compaction/...` metrics of a step;
- `trainer`: the V1 trainer mode `compaction_sync`;
- `plugin`: the `verl.plugins` entry point that registers the three verl-facing parts at `import verl`;
- `_options`: the `algorithm.compaction_gae` keys, checked with the full key in the error.

Importing this package registers the estimator and the loss when verl is importable (so
`VERL_USE_EXTERNAL_MODULES=compactionrl_fast.integrations.verl` still works); `agent_loop`, `trainer` and
`plugin` import verl and are imported only by name.
"""
from ._options import ADV_ESTIMATOR, GAE_DEFAULTS, POLICY_LOSS, compaction_options, gae_options
from .adapter import (REGISTERED, compute_advantage, compute_compaction_gae, compute_policy_loss_compaction,
                      patch_compute_advantage, register)
from .advantages import check_row_lengths, compaction_advantages, session_rows
from .engine import ServerManagerEngine
from .log import compaction_metrics

__all__ = ["ADV_ESTIMATOR", "GAE_DEFAULTS", "POLICY_LOSS", "REGISTERED", "ServerManagerEngine", "check_row_lengths",
           "compaction_advantages", "compaction_metrics", "compaction_options", "compute_advantage",
           "compute_compaction_gae", "compute_policy_loss_compaction", "gae_options", "patch_compute_advantage",
           "register", "session_rows"]

from .._registry import IntegrationSpec, declare  # noqa: E402

SPEC = declare(IntegrationSpec(
    name="verl", framework="verl",
    reference_tests=("tests/integrations/verl/test_agent.py::test_trainer_mode_compute_advantage_on_verl_layout",
                     "tests/integrations/verl/job/test_job.py::test_advantages_and_returns_equal_the_float64_reference"),
    job_test="tests/integrations/verl/job/test_job.py", make_target="test-verl-job",
    bad_input_tests=("tests/integrations/verl/job/test_job.py::test_a_short_values_row_at_dp2_stops_the_job_with_the_error",
                     "tests/integrations/verl/test_agent.py::test_trainer_mode_rejects_a_row_of_another_length"),
    metrics="compactionrl_fast.integrations.verl.log:compaction_metrics",
    metrics_tests=("tests/integrations/verl/test_agent.py::test_compaction_metrics_keys_are_exactly_the_vocabularys",
                   "tests/integrations/verl/job/test_job.py::test_the_job_runs_and_logs_what_users_watch"),
))
