"""slime's own train.py on CPU, the job test_job.py launches:

    python -m tests.integrations.slime.job.job <train.py's flags>

starts a local Ray (in $CRF_JOB_RAY_DIR) with one logical GPU (slime's --debug-rollout-only still places its
Megatron actor and critic, which then do nothing, on a GPU bundle; Ray's GPUs are labels, nothing runs on one),
with _stubs.install_job in every Ray worker, then runs slime's train.py as `python train.py` would. Also here:
the job's environment factory (compaction_env) and a --rollout-sample-hook-path hook that records every Sample
generate returned, aborted ones included (slime drops those before its rollout data)."""
from __future__ import annotations

import json
import os
import runpy
import sys

from compactionrl_fast.envs.memory import MemoryEnv

HOLD_EVERY = 3  # the prompts whose index % 3 == 2 wait at the server until slime aborts them (job_serve.HOLD)
FAIL_AT_RESET = 4  # in the second step


class HeldEnv(MemoryEnv):
    def reset(self, seed):
        system, task = super().reset(seed)
        return system, task + " none none none"


class ResetFails(MemoryEnv):
    def reset(self, seed):
        raise RuntimeError("the task's environment did not start")


def make_env(args, sample):
    """compaction_env: the memory task (3 digits), its budget forcing compactions; every HOLD_EVERY-th prompt
    is one the server holds until slime aborts it, and prompt FAIL_AT_RESET's environment fails at reset."""
    if sample.index == FAIL_AT_RESET:
        return ResetFails()
    cls = HeldEnv if sample.index % HOLD_EVERY == HOLD_EVERY - 1 else MemoryEnv
    return cls(n_digits=3, n_fillers=6)


def record(args, sample, rollout_id=None, evaluation=False):
    """--rollout-sample-hook-path: one JSON line per Sample generate returned (to $CRF_JOB_SAMPLES)."""
    info = (sample.metadata or {}).get("compaction", {})
    with open(os.environ["CRF_JOB_SAMPLES"], "a") as f:
        f.write(json.dumps(dict(rollout_id=rollout_id, evaluation=evaluation, index=sample.index,
                                rid=sample.rollout_id, status=sample.status.value,
                                finish_reason=info.get("finish_reason"))) + "\n")


def main(argv):
    from .. import _stubs

    _stubs.install_job()
    import ray
    import slime

    # a Ray of its own (never one already running here); the workers' logs stay in $CRF_JOB_RAY_DIR (what the
    # driver receives of them can miss the last lines)
    ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False,
             _temp_dir=os.environ.get("CRF_JOB_RAY_DIR"),
             runtime_env={"worker_process_setup_hook": "tests.integrations.slime._stubs.install_job"})
    train_py = os.path.join(os.path.dirname(os.path.dirname(slime.__file__)), "train.py")
    sys.argv = [train_py] + argv
    try:
        runpy.run_path(train_py, run_name="__main__")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
