"""Where a PPO step's time goes, verl and our trainer on demo-verl's config (issue 54), from a demo-verl run.

verl: its own per-step timers (`timing_s/*` in the run's metrics.jsonl): generation (`gen`, the agent loop with
our compaction loop on vLLM), old log-probs, values, the advantage step (`adv`: our trainer mode, the plug-in's
own share besides the agent loop), critic update, actor update, weight sync, and the rest of `step`.
Ours: the run's `time/rollout_s`, `time/train_s`, `time/weight_sync_s`; `train` split here into critic and actor
by timing `train_step` without and with the actor update on the same rollouts (our trainer computes the old
values inside the first critic update and the old log-probs inside the first actor pass: no separate phases).
Medians over the PPO steps (the value-only steps left out).

    python benchmarks/verl_step_profile.py RUN_DIR [--seed 0] [--out benchmarks/results/verl_step_profile]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

VERL_PHASES = ("gen", "old_log_prob", "values", "adv", "update_critic", "update_actor", "update_weights")


def verl_profile(run_dir, seed, warmup):
    from compactionrl_fast.train.log import read_rows

    rows = [r["data"] for r in read_rows(os.path.join(run_dir, f"seed{seed}", "verl-full", "metrics.jsonl"))
            if r["step"] > warmup]
    med = {k: statistics.median(r.get(f"timing_s/{k}", 0.0) for r in rows) for k in VERL_PHASES + ("step",)}
    med["other"] = med["step"] - sum(med[k] for k in VERL_PHASES)
    med["tokens"] = statistics.median(r.get("perf/total_num_tokens", 0) for r in rows)
    return med


def ours_profile(run_dir, seed, cfg, repeats=3):
    """Our trainer's rollout / train / sync times from the run's log; train split into critic and actor by
    timing train_step on one step's rollouts (fresh copies of the SFT start each time)."""
    import copy

    from compactionrl_fast.app.demo import _from_sft
    from compactionrl_fast.app.runner import packer
    from compactionrl_fast.rollout.loop import run_rollouts
    from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine
    from compactionrl_fast.train.config_load import update
    from compactionrl_fast.train.log import read_rows
    from compactionrl_fast.train.loop import micro_batches, train_seeds
    from compactionrl_fast.train.model import critic_from_actor
    from compactionrl_fast.train.trainer import make_state, train_step

    rows = [r for r in read_rows(os.path.join(run_dir, f"seed{seed}", "full", "metrics.jsonl")) if r.get("phase") == "ppo"]
    logged = {k: statistics.median(r[f"time/{k}_s"] for r in rows) for k in ("rollout", "train")}
    syncs = [r["time/weight_sync_s"] for r in rows]  # cumulative over the run
    logged["weight_sync"] = (syncs[-1] - syncs[0]) / max(1, len(syncs) - 1)
    scfg = update(cfg, {"seed": seed})
    tok, make_envs, rcfg, actor = _from_sft(scfg, cfg, seed)
    engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    rollouts = run_rollouts(engine, make_envs(cfg.rollouts_per_step), tok, rcfg.replace(seed=1),
                            train_seeds(cfg, cfg.value_pretrain_steps, 0, cfg.rollouts_per_step))
    pack = packer(cfg)
    split = {"critic": [], "both": []}
    for _ in range(repeats):
        for key, actor_too in (("critic", False), ("both", True)):
            a = copy.deepcopy(actor)
            state = make_state(scfg, a, critic_from_actor(copy.deepcopy(actor)))
            state.step = cfg.value_pretrain_steps
            batches, minibatches = micro_batches(rollouts, cfg, pack, torch.device("cpu"))
            t = time.perf_counter()
            train_step(state, batches, update_actor=actor_too, minibatches=minibatches)
            split[key].append(time.perf_counter() - t)
    critic = statistics.median(split["critic"])
    return {**logged, "critic": critic, "actor": statistics.median(split["both"]) - critic}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/verl_step_profile")
    a = ap.parse_args(argv)
    from compactionrl_fast.app.demo_verl import demo_verl_config
    from compactionrl_fast.train import atomic
    from compactionrl_fast.train.config_load import from_dict, update

    with open(os.path.join(a.run_dir, "demo_verl_cpu.json")) as f:
        res = json.load(f)
    cfg = update(from_dict(res["config"], demo_verl_config()), {"run_dir": a.run_dir})  # the run's own folder
    torch.set_num_threads(1)
    v = verl_profile(a.run_dir, a.seed, cfg.value_pretrain_steps)
    o = ours_profile(a.run_dir, a.seed, cfg)
    ours_step = o["rollout"] + o["train"] + o["weight_sync"]
    table = [("generation (rollouts)", v["gen"], o["rollout"]),
             ("old log-probs", v["old_log_prob"], None), ("values", v["values"], None),
             ("advantages (the plug-in's trainer mode)", v["adv"], None),
             ("critic update", v["update_critic"], o["critic"]), ("actor update", v["update_actor"], o["actor"]),
             ("weight sync", v["update_weights"], o["weight_sync"]),
             ("everything else", v["other"], o["train"] - o["critic"] - o["actor"]),
             ("the step", v["step"], ours_step)]
    f = lambda x: "fused" if x is None else f"{x:.2f}"  # noqa: E731
    md = [f"# One PPO step, verl and our trainer, demo-verl's config (`{' '.join(['python', 'benchmarks/verl_step_profile.py'] + (argv or []))}`)",
          "", f"From the demo-verl run in `{a.run_dir}` (seed {a.seed}; {res['machine'].get('cpu')}, git "
          f"`{res['machine'].get('git')}`, load average {res['machine'].get('loadavg_start')} at its start); "
          f"medians over the PPO steps. verl's step holds {v['tokens']:.0f} tokens with its padding rows. "
          "Ours: old values and old log-probs are computed inside the first critic and actor passes.", "",
          "| phase | verl (s) | ours (s) |", "|---|---|---|"]
    md += [f"| {name} | {x:.2f} | {f(y)} |" for name, x, y in table]
    md += ["", f"The plug-in's trainer mode (`adv`) is {100 * v['adv'] / v['step']:.1f}% of verl's step; the agent "
           "loop (our compaction loop) runs inside `gen`."]
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    atomic.write_text(a.out + ".md", "\n".join(md) + "\n")
    atomic.write_text(a.out + ".json", json.dumps({"verl": v, "ours": o, "run_dir": a.run_dir,
                                                   "machine": res["machine"]}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
