"""An environment factory for compaction.yaml's `compaction_env`, on the package's built-in memory task:
`compaction_env: env_example.make_env` with this folder on PYTHONPATH. Replace it with your agent's environment
(our Environment protocol: reset(seed) -> (system, task); step(action) -> (observation, done, reward[, info]))."""
from compactionrl_fast.envs.memory import MemoryEnv


def make_env(args, sample):
    """One environment per prompt; `sample` is slime's Sample of the prompt (prompt, label, metadata)."""
    return MemoryEnv(n_digits=int((sample.metadata or {}).get("n_digits", 6)))
