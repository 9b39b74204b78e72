"""slime's own train.py on CPU, the job test_job.py launches:

    python -m tests.integrations.slime.job.job <train.py's flags>

starts a local Ray (in $CRF_JOB_RAY_DIR) with one logical GPU (slime's --debug-rollout-only still places its
Megatron actor and critic, which then do nothing, on a GPU bundle; Ray's GPUs are labels, nothing runs on one),
with _stubs.install_job in every Ray worker, then runs slime's train.py as `python train.py` would. Also here:
the job's environment factory (compaction_env) and a --rollout-sample-hook-path hook that records every Sample
generate returned, aborted ones included (slime drops those before its rollout data) and slime's arguments once.

The environment is the memory task with partial credit (MemoryEnv(reward="accuracy"): the fraction of digits
right) for the SFT model the engines serve; it records every episode it ends, on its own, one JSON line to
$CRF_JOB_REWARDS: the reset seed, the prompt's index and rollout_id as generate got them, its reward (the sum of
its step rewards), its steps (one per response of the policy) and the final action."""
from __future__ import annotations

import json
import os
import runpy
import sys

from compactionrl_fast.envs.memory import MemoryEnv

HOLD_EVERY = 5  # the prompts whose index % 5 == 4 wait at the server until slime aborts them (job_serve.HOLD)
FAIL_AT_RESET = 6  # in the second step
EVAL_ENDLESS = 102  # the eval prompt of this seed never ends: the loop cuts it (context_full or max_turns)


def _append(path, row):
    with open(path, "a") as f:  # one short line per write: whole lines whatever process appends
        f.write(json.dumps(row) + "\n")


class RecordingEnv(MemoryEnv):
    """MemoryEnv with the partial-credit reward; every episode it ends is one line of $CRF_JOB_REWARDS (an
    episode the loop cuts gets the loop's truncated reward and no line)."""

    def __init__(self, sample, **kwargs):
        super().__init__(reward="accuracy", **kwargs)
        self.index, self.rollout_id = sample.index, sample.rollout_id
        self.seed, self.total, self.steps = None, 0.0, 0

    def reset(self, seed):
        self.seed, self.total, self.steps = int(seed), 0.0, 0
        return super().reset(seed)

    def step(self, action):
        out = super().step(action)
        self.total += out[2]
        self.steps += 1
        if out[1]:
            _append(os.environ["CRF_JOB_REWARDS"], dict(seed=self.seed, index=self.index, rollout_id=self.rollout_id,
                                                        reward=self.total, steps=self.steps, action=action))
        return out


class HeldEnv(RecordingEnv):
    def reset(self, seed):
        system, task = super().reset(seed)
        return system, task + " none none none"


class EndlessEnv(RecordingEnv):
    def step(self, action):
        self.steps += 1
        return "none la lo li", False, 0.0


class ResetFails(MemoryEnv):
    def reset(self, seed):
        raise RuntimeError("the task's environment did not start")


def make_env(args, sample):
    """compaction_env: the memory task as the SFT model learnt it (6 digits; its budget forces compactions),
    recording its rewards; every HOLD_EVERY-th prompt is one the server holds until slime aborts it, prompt
    FAIL_AT_RESET's environment fails at reset, and the eval prompt of seed EVAL_ENDLESS never ends."""
    if (sample.metadata or {}).get("seed") == EVAL_ENDLESS:
        return EndlessEnv(sample)
    if sample.index == FAIL_AT_RESET:
        return ResetFails()
    return (HeldEnv if sample.index % HOLD_EVERY == HOLD_EVERY - 1 else RecordingEnv)(sample)


def record(args, sample, rollout_id=None, evaluation=False):
    """--rollout-sample-hook-path: one JSON line per Sample generate returned (to $CRF_JOB_SAMPLES), and slime's
    arguments (those JSON can write) once, to $CRF_JOB_ARGS."""
    info = (sample.metadata or {}).get("compaction", {})
    _append(os.environ["CRF_JOB_SAMPLES"], dict(rollout_id=rollout_id, evaluation=evaluation, index=sample.index,
                                                rid=sample.rollout_id, status=sample.status.value,
                                                finish_reason=info.get("finish_reason")))
    path = os.environ["CRF_JOB_ARGS"]
    if not os.path.exists(path):
        plain = (bool, int, float, str, list, dict, type(None))
        with open(path + f".{os.getpid()}", "w") as f:
            json.dump({k: v for k, v in vars(args).items() if isinstance(v, plain)}, f, default=str)
        os.replace(path + f".{os.getpid()}", path)


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
