"""Tries of the demo's RL recipe from cached SFT weights (benchmarks/results/demo_recipe_retune.md).

    python -m benchmarks.demo_retune --seed S --name NAME [--set KEY=VALUE ...] [--every N] [--from-step K]

SFT runs once per seed with the demo's own functions (`runner.build`, `runner.run_sft`, `demo_config(seed=S)`)
and its weights are kept in OUT/seed<S>/sft.pt; the SFT model is evaluated once (`runner.run_eval`: 512
held-out tasks, T=1 and greedy). A try then loads those weights, trains the critic and the actor the way
`runner.run_rl` does (`critic_from_actor`, `make_state`, `fit` with the demo's packer) with the demo's config
plus the `--set` overrides (RL keys: the SFT weights are always the demo's), and evaluates the actor every
`--every` actor updates from update `--from-step` on (T=1 only; the final model also greedy). Every event
is one JSON line in OUT/seed<S>/NAME.jsonl (CPU seconds of training and of evaluations apart). Without
`--set` it only prepares the seed (SFT and its evaluation).

With `lr_schedule=constant` each step's tasks and sampling seeds depend only on (seed, step), so the model
after N updates of a longer run is the final model of a run with steps=N; with a decaying schedule only the
final evaluation is that of the recipe (the lr of update N depends on `steps`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--name", required=True, help="the try's name (its JSON lines file)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides over demo_config")
    p.add_argument("--every", type=int, default=10, help="evaluate every N actor updates (0: only at the end)")
    p.add_argument("--from-step", type=int, default=60, help="first actor update evaluated")
    p.add_argument("--eval-rollouts", type=int, default=512)
    p.add_argument("--out", default="runs/demo_retune", help="folder of the cached SFT weights and the tries' logs")
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    from compactionrl_fast.app import runner
    from compactionrl_fast.app.demo import demo_config
    from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine
    from compactionrl_fast.train.config_load import update
    from compactionrl_fast.train.log import MetricsLog
    from compactionrl_fast.train.loop import evaluate, fit
    from compactionrl_fast.train.model import critic_from_actor
    from compactionrl_fast.train.trainer import make_state

    sets = {}
    for item in a.set:
        k, eq, v = item.partition("=")
        if not eq:
            p.error(f"--set expects KEY=VALUE, got {item!r}")
        sets[k] = v
    root = os.path.join(a.out, f"seed{a.seed}")
    os.makedirs(root, exist_ok=True)
    base = demo_config(seed=a.seed, threads=0, progress=False)
    cfg = update(base, sets)  # --set values are read as YAML, as on the CLI
    tok, make_envs, rcfg = runner.task(cfg)
    log = open(os.path.join(root, a.name + ".jsonl"), "a")

    def emit(d):
        d = {"seed": a.seed, "name": a.name, "set": sets, "time": time.time(), "loadavg": os.getloadavg(), **d}
        log.write(json.dumps(d) + "\n")
        log.flush()
        print(json.dumps(d), flush=True)

    actor = runner.build(base, tok)
    sft_path = os.path.join(root, "sft.pt")
    if os.path.isfile(sft_path):
        actor.load_state_dict(torch.load(sft_path))
    else:
        t, c = time.time(), time.process_time()
        runner.run_sft(update(base, {"run_dir": os.path.join(root, "sft")}), actor, tok, make_envs, rcfg, progress=False)
        torch.save(actor.state_dict(), sft_path + ".tmp")
        os.replace(sft_path + ".tmp", sft_path)
        emit({"phase": "sft", "wall_s": time.time() - t, "cpu_s": time.process_time() - c})
        t, c = time.time(), time.process_time()
        ev = runner.run_eval(actor, tok, make_envs, rcfg, a.eval_rollouts, base.temperature, progress=False)
        emit({"phase": "sft_eval", "eval": ev, "wall_s": time.time() - t, "cpu_s": time.process_time() - c})
    if not sets:
        return 0

    t0, c0 = time.time(), time.process_time()
    spent = [0.0, 0.0]  # evaluations' wall and CPU seconds, kept out of the training time

    def eval_fn(state):
        n = state.step - cfg.value_pretrain_steps
        if n != cfg.steps and (n < a.from_step or not a.every or n % a.every):
            return {}
        t, c = time.time(), time.process_time()
        if n == cfg.steps:
            ev = runner.run_eval(state.actor, tok, make_envs, rcfg, a.eval_rollouts, cfg.temperature, progress=False)
        else:
            engine = TransformersEngine(state.actor, pad_token_id=tok.pad_token_id)
            m, ro = evaluate(engine, make_envs, tok, rcfg, a.eval_rollouts, temperature=cfg.temperature)
            ev = {"sampled": {"success": m["success"], "summary_recall": runner.summary_recall(ro)}}
        spent[0] += time.time() - t
        spent[1] += time.process_time() - c
        emit({"phase": "rl_eval", "actor_updates": n, "eval": ev, "rl_wall_s": time.time() - t0 - spent[0],
              "rl_cpu_s": time.process_time() - c0 - spent[1]})
        return {}

    cfg = update(cfg, {"eval_every": 1, "run_dir": os.path.join(root, a.name)})  # eval_fn picks its updates
    state = make_state(cfg, actor, critic_from_actor(actor))
    fit(state, engine=TransformersEngine(actor, pad_token_id=tok.pad_token_id), make_envs=make_envs, tokenizer=tok,
        rollout_cfg=rcfg, pack=runner.packer(cfg), run_dir=cfg.run_dir, log=MetricsLog(cfg.run_dir),
        metrics_fn=lambda ro: {"summary_recall": runner.summary_recall(ro)}, eval_fn=eval_fn)
    emit({"phase": "done", "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0,
          "eval_wall_s": spent[0], "eval_cpu_s": spent[1]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
