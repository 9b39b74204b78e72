"""The CPU demo: a from-scratch agent learns, with CompactionRL, to write summaries that survive compaction.

On the built-in memory task (collect 6 digits over 6 turns, answer them in order; every episode compacts
twice, so the first digits reach the answer only through the summaries): build the tokenizer and a tiny
Llama, SFT on a scripted expert whose summaries systematically drop the oldest digit, then CompactionRL
(value pre-training, PPO with compaction), then the same RL budget with summary tokens out of the policy
loss (the ablation). Every model is evaluated on held-out tasks (sampling at the rollout temperature,
and greedy); the table, the plots and results JSON/markdown are written at the end, under the run
directory (`runs/demo/` by default). `record=True` (`demo --record`, for maintainers) also copies the
results to `benchmarks/results/` and rewrites the README's demo block from them.

`train` is the generic entry point of `python -m compactionrl_fast train` on the same task.
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch

from . import _io
from .train import checkpoint
from ._git import git_revision
from .train.config import TrainConfig, dumps, to_dict, update
from .train.engines import make_engine
from .train.threads import make_tuner, maybe_step
from .train.trainer import (EVAL_SEED_BASE, MetricsLog, evaluate, fit, load_state, make_state, save_state,
                            split_rollouts, world)

SFT_SEED_BASE = 2_000_000_000  # demonstrations are seeded apart from RL and evaluation tasks
# the demo's targets (docs/demo.md): SFT greedy at most SFT_GREEDY_MAX, CompactionRL at T=1 at least FULL_MIN
# on every seed, the ablation at least ABLATION_GAP below it
SFT_GREEDY_MAX, FULL_MIN, ABLATION_GAP = 0.1, 0.95, 0.3
# and over 3 or more seeds a mean of at least FULL_MEAN_MIN (the margin: one seed sits within ~0.01 sampling error)
FULL_MEAN_MIN, MEAN_MIN_SEEDS = 0.97, 3


_POSITION = [None]  # this process's progress-bar line when jobs run in several processes at once


def _bar_position(position):
    _POSITION[0] = position


def _tqdm(**kw):
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, position=_POSITION[0], **kw)


def task(cfg: TrainConfig):
    """(tokenizer, make_envs, rollout config) of the built-in memory task from cfg.env / cfg.rollout.

    The task's word tokenizer, or the pretrained model's own (the task is plain words and its chat
    template formats the conversation)."""
    from .envs.memory import MemoryEnv, memory_config, memory_tokenizer

    if cfg.model.pretrained:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.model.pretrained)
    else:
        tok = memory_tokenizer()
    rcfg = memory_config(**cfg.rollout)
    return tok, (lambda n: [MemoryEnv(**cfg.env) for _ in range(n)]), rcfg


def packer(cfg: TrainConfig):
    from .packing import pack

    mode = "stitched" if cfg.cross_segment == "stitched" else "paper"
    return lambda rollouts: pack(rollouts, prefix_sharing=True, reward_mode=mode)


def build(cfg: TrainConfig, tok, device="cpu"):
    """A fresh actor for the tokenizer (seeded by cfg.seed), or the pretrained one of cfg.model."""
    from .train.model import build_actor

    torch.manual_seed(cfg.seed)
    return build_actor(cfg.model, len(tok), device=device, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id)


def run_sft(cfg: TrainConfig, actor, tok, make_envs, rcfg, *, log=None, progress=True, tuner=None):
    """Supervised warm start on fresh expert demonstrations every step."""
    from .envs.memory import ScriptedExpert
    from .rollout.loop import run_rollouts
    from .train import sft

    s = cfg.sft
    rank, ws = world()
    opt = sft.make_optimizer(actor, s)
    pack = packer(cfg)
    expert = ScriptedExpert(s.expert_drop_p, seed=cfg.seed * 1009 + rank)
    device = next(actor.parameters()).device
    n = s.rollouts_per_step
    n_local = max(n // ws, 1)
    bar = _tqdm(total=s.steps, desc=f"SFT    seed {cfg.seed}", disable=not progress or rank != 0)
    m = {}
    for step in range(s.steps):
        with maybe_step(tuner) as threads:
            seeds = [SFT_SEED_BASE + (cfg.seed * 100_003 + step) * n + rank * n_local + i for i in range(n_local)]
            demos = run_rollouts(expert, make_envs(n_local), tok, rcfg, seeds)
            batches = [pack(g).to(device) for g in split_rollouts(demos, cfg.micro_batch_tokens)]
            m = sft.sft_step(actor, opt, batches, s, lr=sft.lr_at(step, s.steps, s))
        if log is not None and (step % 10 == 0 or step == s.steps - 1):
            log.log(step, {**m, "threads": threads})
        bar.update(1)
        bar.set_postfix(loss=f"{m['sft/loss']:.3f}", thr=threads)
    bar.close()
    return m


def run_rl(cfg: TrainConfig, actor, tok, make_envs, rcfg, *, progress=True, resume=False, tuner=None, engine=None):
    """Critic from the actor, value pre-training, PPO. Returns the trained State. `engine`: the rollout
    engine (default: `make_engine(cfg, actor, tok)`); `fit` syncs one that does not share the actor."""
    from .train.model import critic_from_actor

    critic = critic_from_actor(actor)
    state = make_state(cfg, actor, critic)
    if resume and checkpoint.exists(cfg.run_dir):
        load_state(state, cfg.run_dir)
    engine = engine or make_engine(cfg, actor, tok)
    total = cfg.value_pretrain_steps + cfg.steps
    desc = ("RL-abl " if not cfg.train_summary_tokens else "RL     ") + f"seed {cfg.seed}"
    bar = _tqdm(total=total, initial=state.step, desc=desc, disable=not progress or world()[0] != 0)
    recall = (lambda ro: {"summary_recall": summary_recall(ro)}) if not cfg.model.pretrained else None
    fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=packer(cfg),
        run_dir=cfg.run_dir, log=MetricsLog(cfg.run_dir, resume_step=state.step if resume else None), progress=bar,
        metrics_fn=recall, tuner=tuner)
    bar.close()
    if world()[0] == 0:
        save_state(state, cfg.run_dir)
    return state


def run_eval(actor, tok, make_envs, rcfg, n: int, temperature: float, *, progress=True, desc="eval",
             engine=None) -> dict:
    """Success on `n` held-out tasks, sampled at `temperature` and greedy (with a progress bar), on `engine`
    (given the actor's weights first) or the embedded engine on the actor."""
    from .rollout.engines.transformers_engine import TransformersEngine
    from .train.sync import push_weights

    if engine is None:
        engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    push_weights(engine, actor)
    out = {}
    rank, ws = world()
    bar = _tqdm(total=2 * len(range(rank, n, ws)), desc=desc, unit="rollout", disable=not progress or rank != 0)
    for name, t in (("sampled", temperature), ("greedy", 0.0)):
        bar.set_postfix(mode=name)
        counted, finish = _counting(make_envs, bar)
        m, ro = evaluate(engine, counted, tok, rcfg, n, temperature=t, seed_base=EVAL_SEED_BASE)
        finish()
        out[name] = {"success": m["success"], "reward": m["reward"],
                     "accuracy": m.get("info/accuracy"), "compactions": m["compactions"],
                     "summary_tokens": m["summary_tokens"], "summary_recall": summary_recall(ro)}
    bar.close()
    return out


def _counting(make_envs, bar):
    """(make_envs that advances `bar`, a function that finishes it).

    `evaluate` builds each chunk's environments just before running the chunk, so a call means the
    previous chunk is done: the bar moves by the previous call's count (and by the last one at the end)."""
    pending = [0]

    def make(n):
        bar.update(pending[0])
        pending[0] = n
        return make_envs(n)

    def finish():
        bar.update(pending[0])
        pending[0] = 0

    return make, finish


def summary_recall(rollouts) -> float | None:
    """Fraction of summaries that hold every digit revealed before them (the skill RL has to learn)."""
    from .envs.memory import summary_correct

    flags = [ok for r in rollouts for ok in summary_correct(r)]
    return sum(flags) / len(flags) if flags else None


def run(cfg: TrainConfig, *, seeds=(0,), ablation_seeds=(0,), eval_rollouts=512, out_dir=None,
        name="demo_cpu", argv=(), record=False, progress=None, workers="auto") -> dict:
    """The whole demo; writes OUT/NAME.json, OUT/NAME.md, OUT/NAME.png (OUT: `out_dir`, default cfg.run_dir)
    and per-run plots. `record`: also write them to the checkout's benchmarks/results/ and rewrite the
    README's demo block (maintainers; needs a source checkout). `progress`: bars (default cfg.progress).

    Two phases: SFT (and its evaluation) of every seed, then every RL run (CompactionRL, and the ablation on
    `ablation_seeds`) from its seed's SFT weights, each with its evaluation. `workers` > 1 runs the jobs of a
    phase in that many processes at once (each with cores // workers torch threads unless cfg.threads is a
    number); "auto": one per core on CPU with the embedded engine, else 1. A job's numbers do not depend on
    where it runs, only (by rounding) on its thread count."""
    from .train.plots import plot_run

    out_dir = out_dir or cfg.run_dir
    progress = cfg.progress if progress is None else progress
    record_root = _checkout_root() if record else None  # fail before hours of training, not after
    workers = _workers(cfg, workers)
    tuner = make_tuner(cfg.threads)  # before vLLM starts: in this process it fixes torch's thread count
    t0, c0, k0 = time.time(), time.process_time(), _children_cpu()
    tok, _, _ = task(cfg)
    shared = _shared_engine(cfg, tok)  # vLLM: one engine for every run, synced to each model
    results = {"command": "python -m compactionrl_fast " + " ".join(argv), "config": to_dict(cfg),
               "machine": _machine(cfg.threads), "versions": versions(), "runs": {}}
    results["machine"]["demo_workers"] = workers
    local = dict(tuner=tuner, engine=shared, progress=progress)
    sft_jobs = [(cfg, seed, eval_rollouts) for seed in seeds]
    rl_jobs = [(cfg, seed, vname, eval_rollouts) for seed in seeds
               for vname in ("full",) + (("ablation",) if seed in ablation_seeds else ())]
    for fn, jobs in ((_sft_job, sft_jobs), (_rl_job, rl_jobs)):
        for (seed, key), res in _run_jobs(fn, jobs, workers, cfg, local):
            results["runs"].setdefault(str(seed), {}).update(res)
            _print_eval(f"seed {seed} {key}", res[key])
    for seed in seeds:  # plots here: one process draws them all
        root = os.path.join(cfg.run_dir, f"seed{seed}")
        for part in ("sft", "full", "ablation"):
            if os.path.isfile(os.path.join(root, part, "metrics.jsonl")) and (part != "sft" or cfg.sft.steps > 0):
                plot_run(os.path.join(root, part))
    results["runs"] = {str(s): results["runs"][str(s)] for s in seeds}
    results["total_time_s"] = time.time() - t0
    # this process (all threads) plus its finished child processes (the job workers)
    results["cpu_time_s"] = time.process_time() - c0 + _children_cpu() - k0
    results["machine"]["loadavg_end"] = os.getloadavg()
    if tuner is not None:  # which thread count won each probing window
        results["machine"]["threads_chosen"] = [best for _, _, best in tuner.history]
        results["machine"]["threads_tuner_stood_down"] = tuner.locked
    results["summary"] = _summary(results)
    _write(results, out_dir, name)
    print(_table(results))
    print(f"total {results['total_time_s'] / 60:.1f} min; results in {os.path.join(out_dir, name)}.{{json,md,png}}")
    if record_root is not None:
        _write(results, os.path.join(record_root, "benchmarks", "results"), name)
        readme = os.path.join(record_root, "README.md")
        with open(readme) as f:
            text = f.read()
        with open(readme, "w") as f:
            f.write(replace_block(text, "demo", demo_block(results, name)))
        print(f"recorded in {os.path.join(record_root, 'benchmarks', 'results', name)}.{{json,md,png}} and README.md")
    print(targets_line(results["summary"]["targets"]))  # the last line: did the run meet the demo's targets
    return results


def _workers(cfg: TrainConfig, workers) -> int:
    """The number of job processes: an int >= 1, or "auto" (one per core on CPU with the embedded engine)."""
    if workers == "auto":
        on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        return (os.cpu_count() or 1) if on_cpu and cfg.engine == "transformers" and world()[1] == 1 else 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an int >= 1 or 'auto', got {workers!r}")
    if workers > 1 and (cfg.engine != "transformers" or world()[1] > 1):
        raise ValueError("workers > 1 needs the embedded engine (engine: transformers) and a single process "
                         f"(got engine {cfg.engine!r}, world size {world()[1]})")
    return workers


def _run_jobs(fn, jobs, workers, cfg, local):
    """fn(*job) for every job -> [((seed, key), result)] in job order: in this process (sharing its thread
    tuner and engine) when there is one worker or one job, else in min(workers, jobs) spawned processes."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*job, **local) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    n = min(workers, len(jobs))
    threads = cfg.threads if isinstance(cfg.threads, int) and cfg.threads > 0 else max(1, (os.cpu_count() or 1) // n)
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                             initargs=(threads,)) as pool:
        futures = [pool.submit(fn, *job, progress=local["progress"], position=i) for i, job in enumerate(jobs)]
        return [f.result() for f in futures]


def _children_cpu() -> float:
    """CPU seconds of this process's finished (waited-for) child processes."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _worker_init(threads: int):
    torch.set_num_threads(threads)


def _sft_weights(cfg: TrainConfig, seed: int) -> str:
    return os.path.join(cfg.run_dir, f"seed{seed}", "sft", "weights.pt")


def _sft_job(cfg, seed, eval_rollouts, *, progress=True, tuner=None, engine=None, position=None):
    """SFT of one seed from scratch; saves its weights for the RL jobs; -> ((seed, "sft"), results)."""
    t = time.time()
    _bar_position(position)
    scfg = update(cfg, {"seed": seed, "run_dir": os.path.join(cfg.run_dir, f"seed{seed}", "sft")})
    tok, make_envs, rcfg = task(scfg)
    actor = build(scfg, tok)
    os.makedirs(scfg.run_dir, exist_ok=True)
    m = run_sft(scfg, actor, tok, make_envs, rcfg, log=MetricsLog(scfg.run_dir), tuner=tuner, progress=progress)
    res = {"sft_time_s": time.time() - t, "sft_final_loss": m.get("sft/loss")}
    torch.save(actor.state_dict(), _sft_weights(cfg, seed))
    res["sft"] = run_eval(actor, tok, make_envs, rcfg, eval_rollouts, cfg.temperature, progress=progress,
                          desc=f"eval   seed {seed} SFT", engine=engine or make_engine(scfg, actor, tok))
    return (seed, "sft"), res


def _rl_job(cfg, seed, vname, eval_rollouts, overrides=None, *, progress=True, tuner=None, engine=None,
            position=None):
    """One RL run from the seed's SFT weights with config `overrides` (default: the demo's variants, "full",
    or "ablation" with summary tokens out of the loss), and its evaluation; -> ((seed, vname), results)."""
    t = time.time()
    _bar_position(position)
    if overrides is None:
        overrides = {"train_summary_tokens": vname == "full"}
    vcfg = update(cfg, {"seed": seed, "run_dir": os.path.join(cfg.run_dir, f"seed{seed}", vname), **overrides})
    tok, make_envs, rcfg = task(vcfg)
    actor = build(vcfg, tok)
    actor.load_state_dict(torch.load(_sft_weights(cfg, seed), weights_only=True))
    engine = engine or make_engine(vcfg, actor, tok)
    run_rl(vcfg, actor, tok, make_envs, rcfg, tuner=tuner, progress=progress, engine=engine)
    res = {f"{vname}_time_s": time.time() - t, f"{vname}_phases_s": _phase_times(vcfg.run_dir)}
    res[vname] = run_eval(actor, tok, make_envs, rcfg, eval_rollouts, cfg.temperature, progress=progress,
                          desc=f"eval   seed {seed} {vname}", engine=engine)
    return (seed, vname), res


def _shared_engine(cfg: TrainConfig, tok):
    """The vLLM or server engine every run of the demo uses (started once, from a model of the demo's shape;
    `engine: server` with server.replicas starts the replicas once); None for the embedded engine, which is
    built on each actor."""
    if cfg.engine not in ("vllm", "server"):
        return None
    from .train.engines import describe

    engine = make_engine(cfg, build(cfg, tok), tok)
    if describe(engine):
        print(describe(engine), flush=True)
    return engine


def _phase_times(run_dir: str) -> dict:
    """Seconds an RL run spent in rollouts, training and weight sync (from its metrics.jsonl)."""
    from .train.trainer import read_rows

    rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
    return {k: sum(r.get("time/" + k + "_s", 0.0) for r in rows) for k in ("rollout", "train", "weight_sync")}


def _checkout_root() -> str:
    """The source checkout holding this package (README.md with a demo block, benchmarks/results/)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = os.path.join(root, "README.md")
    if not (os.path.isdir(os.path.join(root, "benchmarks", "results")) and os.path.isfile(readme)
            and "<!-- demo:start -->" in open(readme).read()):
        raise ValueError(f"--record needs a source checkout (an editable install): no README.md demo block and "
                         f"benchmarks/results/ under {root}")
    rev = git_revision(root)
    if rev is None or rev.endswith("+dirty"):
        raise ValueError(f"--record stamps the results with the git revision: commit first (revision: {rev})")
    return root


def versions() -> dict:
    """Python and the version of every installed distribution (name -> version), sorted by name."""
    from importlib import metadata

    pkgs = {}
    for d in metadata.distributions():
        name = d.metadata["Name"]
        if name:
            pkgs[name.lower()] = d.version
    return {"python": platform.python_version(), "torch": torch.__version__,
            "packages": dict(sorted(pkgs.items()))}


KEY_PACKAGES = ("torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "tqdm", "pyyaml",
                "matplotlib")


def version_line(v: dict) -> str:
    """"Python 3.11.7, torch 2.13.0+cpu, ..." for the demo's main dependencies (all are in the JSON)."""
    pk = v.get("packages", {})
    return ", ".join([f"Python {v.get('python')}", f"torch {v.get('torch')}"] +
                     [f"{k} {pk[k]}" for k in KEY_PACKAGES[1:] if k in pk])


def replace_block(text: str, tag: str, body: str) -> str:
    """`text` with the lines between `<!-- TAG:start -->` and `<!-- TAG:end -->` replaced by `body`."""
    start, end = f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no {start} ... {end} block in the text")
    return text[:i + len(start)] + "\n" + body.strip("\n") + "\n" + text[j:]


def demo_block(results: dict, name: str) -> str:
    """The README's demo block: where, when and with what the numbers were measured, and the per-seed table."""
    m = results["machine"]
    runs = results["runs"]
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    minutes = lambda k: [r[k] / 60 for r in runs.values() if k in r]  # noqa: E731
    rl = minutes("full_time_s") + minutes("ablation_time_s")
    lines = [f"Recorded by `{results['command']}` at git `{m.get('git')}` on {m.get('cpu')} ({m.get('cores')} cores, "
             f"torch threads {m.get('torch_threads')}, load average {_load(m.get('loadavg_start'))} at start): "
             f"**{results['total_time_s'] / 60:.1f} min** wall (SFT {_span(minutes('sft_time_s'))} min, "
             f"each RL run {_span(rl)} min, evaluations the rest). {version_line(results.get('versions', {}))}. "
             f"Held-out success on {results['config'].get('eval_rollouts')} tasks "
             f"(`benchmarks/results/{name}.md`):", "",
             "| seed | SFT start (T=1 / greedy) | CompactionRL (T=1 / greedy) | "
             "ablation: summaries out of the loss (T=1 / greedy) |", "|---|---|---|---|"]
    for seed, r in runs.items():
        cells = [f"{f(r[k]['sampled']['success'])} / {f(r[k]['greedy']['success'])}" if k in r else "-"
                 for k in ("sft", "full", "ablation")]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    t = results["summary"]["targets"]
    lines += ["", targets_line(t) + ".", "",
              f"![training success and summary recall](benchmarks/results/{name}.png)"]
    return "\n".join(lines)


def targets_line(targets: dict) -> str:
    """"Targets: sft_greedy_le_0.1: met, ..." (MISSED in capitals)."""
    return "Targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items())


def _span(xs) -> str:
    return "-" if not xs else f"{min(xs):.1f}" if max(xs) - min(xs) < 0.05 else f"{min(xs):.1f}-{max(xs):.1f}"


def _load(x) -> str:
    return "-" if not x else f"{x[0]:.1f}"


def _machine(threads) -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"git": git_revision(os.path.dirname(os.path.abspath(__file__))), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": threads or torch.get_num_threads(), "torch": torch.__version__, "loadavg_start": load,
            "versions": version_line(versions())}


def _print_eval(label, ev):
    s, g = ev["sampled"], ev["greedy"]
    print(f"[{label}] success sampled {s['success']:.3f} greedy {g['success']:.3f} "
          f"summary recall {s['summary_recall'] if s['summary_recall'] is not None else float('nan'):.3f}", flush=True)


def _summary(results) -> dict:
    runs = results["runs"].values()
    full = [r["full"]["sampled"]["success"] for r in runs if "full" in r]
    abl = [(r["full"]["sampled"]["success"], r["ablation"]["sampled"]["success"]) for r in runs if "ablation" in r]
    sft_g = [r["sft"]["greedy"]["success"] for r in runs]
    return {"full_success": full, "sft_greedy_success": sft_g,
            "ablation_gap": [a - b for a, b in abl],
            "targets": {f"sft_greedy_le_{SFT_GREEDY_MAX}": all(x <= SFT_GREEDY_MAX for x in sft_g),
                        f"full_ge_{FULL_MIN}_every_seed": bool(full) and all(x >= FULL_MIN for x in full),
                        f"ablation_ge_{ABLATION_GAP}_below": bool(abl) and all(a - b >= ABLATION_GAP for a, b in abl),
                        **({f"full_mean_ge_{FULL_MEAN_MIN}": sum(full) / len(full) >= FULL_MEAN_MIN}
                           if len(full) >= MEAN_MIN_SEEDS else {})}}


def _table(results) -> str:
    lines = ["| seed | model | success (T=1) | success (greedy) | answer accuracy | summary recall | minutes |",
             "|---|---|---|---|---|---|---|"]
    for seed, r in results["runs"].items():
        for k in ("sft", "full", "ablation"):
            if k not in r:
                continue
            s, g = r[k]["sampled"], r[k]["greedy"]
            f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            label = {"sft": "SFT start", "full": "CompactionRL", "ablation": "ablation: summaries out of the loss"}[k]
            lines.append(f"| {seed} | {label} | {f(s['success'])} | {f(g['success'])} | {f(s['accuracy'])} | "
                         f"{f(s['summary_recall'])} | {r.get(k + '_time_s', 0) / 60:.1f} |")
    engine = results["config"].get("engine", "transformers")
    for seed, r in results["runs"].items():
        for k in ("full", "ablation"):
            ph = r.get(k + "_phases_s")
            if ph and r.get(k + "_time_s"):
                share = {n: 100 * v / r[k + "_time_s"] for n, v in ph.items()}
                lines.append(f"seed {seed} {k} RL ({engine} engine): rollouts {share['rollout']:.0f}%, training "
                             f"{share['train']:.0f}%, weight sync {share['weight_sync']:.1f}% of "
                             f"{r[k + '_time_s'] / 60:.1f} min")
    return "\n".join(lines)


def _write(results, out_dir, name):
    os.makedirs(out_dir, exist_ok=True)
    _io.remove_stale_temps(out_dir)
    _io.write_text(os.path.join(out_dir, name + ".json"), json.dumps(results, indent=1, default=str))
    t = results["summary"]["targets"]
    md = [f"# CPU demo ({name})", "", f"Command: `{results['command']}`", "",
          f"Machine: {results['machine']}; total {results['total_time_s'] / 60:.1f} min wall, "
          f"{results['cpu_time_s'] / 60:.1f} min CPU (load averages at start and end show how shared the machine was).",
          "",
          "Evaluation: held-out tasks, success = exact answer; summary recall = fraction of summaries that "
          "hold every digit seen before them.", "", _table(results), "",
          targets_line(t), ""]
    _io.write_text(os.path.join(out_dir, name + ".md"), "\n".join(md))
    _curves(results, os.path.join(out_dir, name + ".png"))


def _curves(results, path):
    """Training success and summary recall of the full method and the ablation, per seed, against actor
    updates (value pre-training shaded, at x <= 0: the per-run plots' convention)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .train.plots import read_metrics, step_axis

    run_dir = results["config"]["run_dir"]
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.88, wspace=0.25)
    shade = None
    for seed in results["runs"]:
        for v, style in (("full", "-"), ("ablation", "--")):
            p = os.path.join(run_dir, f"seed{seed}", v, "metrics.jsonl")
            if os.path.isfile(p):
                rows = read_metrics(p)
                xs, _, shade = step_axis(rows)
                for ax, key in zip(axes, ("success", "summary_recall")):
                    pts = [(x, r[key]) for x, r in zip(xs, rows) if isinstance(r.get(key), (int, float))]
                    ax.plot([a for a, _ in pts], [b for _, b in pts], style, label=f"{v} seed {seed}")
    titles = (("Training success (sampled at T=1)", "fraction of the step's rollouts"),
              ("Summaries holding every digit seen so far", "fraction of the step's summaries"))
    for ax, (title, ylabel) in zip(axes, titles):
        if shade is not None:
            ax.axvspan(*shade, color="0.85", zorder=0)
        ax.set_xlabel("actor update" + (" (shaded: value pre-training)" if shade else ""), fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# `python -m compactionrl_fast train` (single process or torchrun)


def _init_distributed(cfg: TrainConfig):
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def train(cfg: TrainConfig, *, resume: bool = True):
    """SFT (when cfg.sft.steps > 0 and no checkpoint exists) then value pre-training and PPO."""
    tuner = make_tuner(cfg.threads)
    _init_distributed(cfg)
    rank, _ = world()
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    tok, make_envs, rcfg = task(cfg)
    actor = build(cfg, tok, device)  # same seed on every rank: identical initial weights
    if rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        _io.remove_stale_temps(cfg.run_dir)  # left by a run killed mid-write
        _io.write_text(os.path.join(cfg.run_dir, "config.json"), dumps(cfg))
    sft_path = os.path.join(cfg.run_dir, "sft_actor.pt")
    has_ckpt = resume and checkpoint.exists(cfg.run_dir)
    if cfg.sft.steps > 0 and not has_ckpt:
        if resume and os.path.isfile(sft_path):
            actor.load_state_dict(checkpoint.load_state_dict(sft_path))
        else:
            run_sft(cfg, actor, tok, make_envs, rcfg, log=MetricsLog(os.path.join(cfg.run_dir, "sft")),
                    progress=cfg.progress, tuner=tuner)
            if rank == 0:
                checkpoint.save_state_dict(actor.state_dict(), sft_path)
    state = run_rl(cfg, actor, tok, make_envs, rcfg, progress=cfg.progress, resume=resume, tuner=tuner)
    if rank == 0:
        from .train.plots import plot_run

        plot_run(cfg.run_dir)
        if os.path.isfile(os.path.join(cfg.run_dir, "sft", "metrics.jsonl")):
            plot_run(os.path.join(cfg.run_dir, "sft"))
        with _io.atomic_dir(os.path.join(cfg.run_dir, "actor")) as tmp:
            actor.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    return state
