"""The CPU demo: a from-scratch agent learns, with CompactionRL, to write summaries that survive compaction.

On the built-in memory task (collect 6 digits over 6 turns, answer them in order; every episode compacts
twice, so the first digits reach the answer only through the summaries): build the tokenizer and a tiny
Llama, SFT on a scripted expert whose summaries systematically drop the oldest digit, then CompactionRL
(value pre-training, PPO with compaction), then the same RL budget with summary tokens out of the policy
loss (the ablation). Every model is evaluated on held-out tasks (sampling at the rollout temperature,
and greedy); the table, the plots and results JSON/markdown are written at the end, under the run
directory (`runs/demo/` by default). `record=True` (`demo --record`, for maintainers) also writes the
results to `benchmarks/results/` of the source checkout (the README links them).

The pieces of one run (task, model, SFT, RL, evaluation) are in `runner.py`, the results files in
`results.py`; this module schedules the jobs.
"""
from __future__ import annotations

import os
import time

import torch

from ._git import git_revision
from .results import machine, print_eval, summary, table, targets_line, versions, write
from .runner import bar_position, build, device_of, run_eval, run_rl, run_sft, task
from ..train.config import SFTConfig, TrainConfig
from ..train.config_load import to_dict, update
from ..train.engines import make_engine
from ..train.cpu_malloc import keep_freed_memory
from ..train.threads import SharedThreads, make_tuner
from ..train.dist import world
from ..train.log import MetricsLog


def demo_config(**overrides) -> TrainConfig:
    """The CPU demo (docs/demo.md): tiny model, SFT warm start on an expert whose summaries
    drop the oldest digit 60% of the time, then 120 PPO steps of 64 rollouts in 2 actor mini-batches (one pass
    over each batch for the first 40 updates, three after), adaptive lambda with alpha 4, critic lr 1e-3, actor
    lr 6e-4 with a cosine decay to 6e-5, Adam beta2 0.99 (benchmarks/results/demo_recipe_retune.md,
    demo_margin_5seeds.md and demo_beta2.md: why)."""
    cfg = TrainConfig(
        # "auto": 2 threads are ~1.65x faster on the idle 2-core machine, 2-7x slower when it is shared
        run_dir="runs/demo", threads="auto", rollouts_per_step=64, ppo_minibatches=2, steps=120, value_pretrain_steps=10,
        actor_lr=6e-4, lr_schedule="cosine", lr_end_ratio=0.1, critic_lr=1e-3, clip_high=0.2, max_grad_norm=1.0,
        adaptive_alpha=4.0, ppo_epochs=3, ppo_epochs_from=40, adam_betas=(0.9, 0.99),
        micro_batch_tokens=1 << 30, gap_every=10, checkpoint_every=0,
        sft=SFTConfig(steps=1000, rollouts_per_step=16, lr=2e-3, expert_drop_p=0.6),
    )
    return update(cfg, overrides)


def run(cfg: TrainConfig, *, seeds=(0,), ablation_seeds=(0,), eval_rollouts=512, out_dir=None,
        name="demo_cpu", argv=(), record=False, progress=None, workers="auto") -> dict:
    """The whole demo; writes OUT/NAME.json, OUT/NAME.md, OUT/NAME.png (OUT: `out_dir`, default cfg.run_dir)
    and per-run plots. `record`: also write them to the checkout's benchmarks/results/ (maintainers; needs a
    source checkout at a committed revision). `progress`: bars (default cfg.progress).

    Two phases: SFT (and its evaluation) of every seed, then every RL run (CompactionRL, and the ablation on
    `ablation_seeds`) from its seed's SFT weights, each with its evaluation. `workers` > 1 runs the jobs of a
    phase in that many processes at once (each with cores // workers torch threads unless cfg.threads is a
    number; with threads "auto" the jobs still running share the cores the finished ones free, so the last
    takes them all); "auto": one per core on CPU with the embedded engine, else 1. A job's numbers do not
    depend on where it runs, only (by rounding) on its thread count at each step: with a number for
    cfg.threads every job is bitwise reproducible at 1 thread, with "auto" the steps after a switch are not."""
    from .plots import plot_run

    out_dir = out_dir or cfg.run_dir
    progress = cfg.progress if progress is None else progress
    record_root = _checkout_root() if record else None  # fail before hours of training, not after
    workers = _workers(cfg, workers)
    tuner = make_tuner(cfg.threads)  # before vLLM starts: in this process it fixes torch's thread count
    if device_of(cfg) == "cpu":
        keep_freed_memory()
    t0, c0, k0 = time.time(), time.process_time(), _children_cpu()
    tok, _, _ = task(cfg)
    shared = _shared_engine(cfg, tok)  # vLLM: one engine for every run, synced to each model
    results = {"command": "python -m compactionrl_fast " + " ".join(argv), "config": to_dict(cfg),
               "machine": machine(cfg.threads), "versions": versions(), "runs": {}}
    results["machine"]["demo_workers"] = workers
    local = dict(tuner=tuner, engine=shared, progress=progress)
    sft_jobs = [(_sft_job, (cfg, seed)) for seed in seeds]
    # the SFT evaluations last: they fill the cores that the shorter RL runs leave idle
    rl_jobs = [(_rl_job, (cfg, seed, vname, eval_rollouts)) for seed in seeds
               for vname in ("full",) + (("ablation",) if seed in ablation_seeds else ())]
    rl_jobs += [(_sft_eval_job, (cfg, seed, eval_rollouts)) for seed in seeds]
    for jobs in (sft_jobs, rl_jobs):
        for (seed, key), res in _run_jobs(jobs, workers, cfg, local):
            results["runs"].setdefault(str(seed), {}).update(res)
            if key in res:  # an evaluation
                print_eval(f"seed {seed} {key}", res[key])
            if f"{key}_time_s" in res and (key != "sft" or cfg.sft.steps > 0):  # a training run: its plots,
                plot_run(os.path.join(cfg.run_dir, f"seed{seed}", key))  # here while the other jobs run
    parts = ["sft", "full", "ablation"]  # each seed's results in job order, whatever order the jobs ended in
    results["runs"] = {str(s): dict(sorted(results["runs"][str(s)].items(), key=lambda kv: parts.index(
        kv[0].split("_")[0]))) for s in seeds}
    results["total_time_s"] = time.time() - t0
    # this process (all threads) plus its finished child processes (the job workers)
    results["cpu_time_s"] = time.process_time() - c0 + _children_cpu() - k0
    results["machine"]["loadavg_end"] = os.getloadavg()
    if tuner is not None:  # which thread count won each probing window
        results["machine"]["threads_chosen"] = [best for _, _, best in tuner.history]
        results["machine"]["threads_tuner_stood_down"] = tuner.locked
    results["summary"] = summary(results)
    write(results, out_dir, name)
    print(table(results))
    print(f"total {results['total_time_s'] / 60:.1f} min; results in {os.path.join(out_dir, name)}.{{json,md,png}}")
    if record_root is not None:
        recorded = os.path.join(record_root, "benchmarks", "results")
        write(results, recorded, name)
        print(f"recorded in {os.path.join(recorded, name)}.{{json,md,png}}")
    print(targets_line(results["summary"]["targets"]))  # the last line: did the run meet the demo's targets
    return results


def _workers(cfg: TrainConfig, workers) -> int:
    """The number of job processes: an int >= 1, or "auto" (one per core on CPU with the embedded engine)."""
    if workers == "auto":
        local_cpu = device_of(cfg) == "cpu" and cfg.engine == "transformers" and world()[1] == 1
        return (os.cpu_count() or 1) if local_cpu else 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an int >= 1 or 'auto', got {workers!r}")
    if workers > 1 and (cfg.engine != "transformers" or world()[1] > 1):
        raise ValueError("workers > 1 needs the embedded engine (engine: transformers) and a single process "
                         f"(got engine {cfg.engine!r}, world size {world()[1]})")
    return workers


def _run_jobs(jobs, workers, cfg, local):
    """fn(*args) for every (fn, args) in `jobs`, yielding ((seed, key), result) as each ends: in this process
    (sharing its thread tuner and engine, in job order) when there is one worker or one job, else in
    min(workers, jobs) spawned processes that take the jobs in order."""
    if workers <= 1 or len(jobs) <= 1:
        for fn, args in jobs:
            yield fn(*args, **local)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    n, cores = min(workers, len(jobs)), os.cpu_count() or 1
    threads = cfg.threads if isinstance(cfg.threads, int) and cfg.threads > 0 else max(1, cores // n)
    ctx = multiprocessing.get_context("spawn")
    # threads "auto": the jobs still running share the cores, so the last one (often the ablation) takes them all
    share = ctx.Value("i", threads) if cfg.threads == "auto" else None
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_worker_init,
                             initargs=(threads, device_of(cfg) == "cpu", share)) as pool:
        futures = [pool.submit(_worker_job, fn, args, local["progress"], i) for i, (fn, args) in enumerate(jobs)]
        running = len(futures)
        for f in as_completed(futures):
            running -= 1
            if share is not None and 0 < running < n:
                share.value = max(threads, cores // running)
            yield f.result()


def _children_cpu() -> float:
    """CPU seconds of this process's finished (waited-for) child processes."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


_SHARED_THREADS = None  # a spawned worker's SharedThreads (threads "auto"), set by _worker_init


def _worker_init(threads: int, cpu: bool = False, share=None):
    global _SHARED_THREADS
    torch.set_num_threads(threads)
    _SHARED_THREADS = SharedThreads(share) if share is not None else None
    if cpu:
        keep_freed_memory()


def _worker_job(fn, args, progress, position):
    """fn(*args) in a spawned worker, its training steps at the thread count the parent shares out (if any)."""
    return fn(*args, progress=progress, position=position, tuner=_SHARED_THREADS)


def _sft_weights(cfg: TrainConfig, seed: int) -> str:
    return os.path.join(cfg.run_dir, f"seed{seed}", "sft", "weights.pt")


def _sft_job(cfg, seed, *, progress=True, tuner=None, engine=None, position=None):
    """SFT of one seed from scratch; saves its weights for the RL and evaluation jobs; -> ((seed, "sft"),
    results)."""
    t = time.time()
    bar_position(position)
    scfg = update(cfg, {"seed": seed, "run_dir": os.path.join(cfg.run_dir, f"seed{seed}", "sft")})
    tok, make_envs, rcfg = task(scfg)
    actor = build(scfg, tok)
    os.makedirs(scfg.run_dir, exist_ok=True)
    m = run_sft(scfg, actor, tok, make_envs, rcfg, log=MetricsLog(scfg.run_dir), tuner=tuner, progress=progress)
    torch.save(actor.state_dict(), _sft_weights(cfg, seed))
    return (seed, "sft"), {"sft_time_s": time.time() - t, "sft_final_loss": m.get("sft/loss")}


def _from_sft(run_cfg, cfg, seed):
    """(tokenizer, env factory, rollout config, actor) of `run_cfg`, the actor at the seed's saved SFT weights."""
    tok, make_envs, rcfg = task(run_cfg)
    actor = build(run_cfg, tok)
    actor.load_state_dict(torch.load(_sft_weights(cfg, seed), weights_only=True))
    return tok, make_envs, rcfg, actor


def _sft_eval_job(cfg, seed, eval_rollouts, *, progress=True, tuner=None, engine=None, position=None):
    """The evaluation of the seed's SFT weights; -> ((seed, "sft"), {"sft": evaluation})."""
    bar_position(position)
    scfg = update(cfg, {"seed": seed})
    tok, make_envs, rcfg, actor = _from_sft(scfg, cfg, seed)
    return (seed, "sft"), {"sft": run_eval(actor, tok, make_envs, rcfg, eval_rollouts, cfg.temperature,
                                           progress=progress, desc=f"eval   seed {seed} SFT",
                                           engine=engine or make_engine(scfg, actor, tok))}


def _rl_job(cfg, seed, vname, eval_rollouts, overrides=None, *, progress=True, tuner=None, engine=None,
            position=None):
    """One RL run from the seed's SFT weights with config `overrides` (default: the demo's variants, "full",
    or "ablation" with summary tokens out of the loss), and its evaluation; -> ((seed, vname), results)."""
    t = time.time()
    bar_position(position)
    if overrides is None:
        overrides = {"train_summary_tokens": vname == "full"}
    vcfg = update(cfg, {"seed": seed, "run_dir": os.path.join(cfg.run_dir, f"seed{seed}", vname), **overrides})
    tok, make_envs, rcfg, actor = _from_sft(vcfg, cfg, seed)
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
    from ..train.engines import describe

    engine = make_engine(cfg, build(cfg, tok), tok)
    if describe(engine):
        print(describe(engine), flush=True)
    return engine


def _phase_times(run_dir: str) -> dict:
    """Seconds an RL run spent in rollouts, training and weight sync (from its metrics.jsonl)."""
    from ..train.log import read_rows

    rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
    return {k: sum(r.get("time/" + k + "_s", 0.0) for r in rows) for k in ("rollout", "train", "weight_sync")}


def _checkout_root() -> str:
    """The source checkout holding this package (with benchmarks/results/), at a committed revision."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isdir(os.path.join(root, "benchmarks", "results")):
        raise ValueError(f"--record needs a source checkout (an editable install): no benchmarks/results/ under {root}")
    rev = git_revision(root)
    if rev is None or rev.endswith("+dirty"):
        raise ValueError(f"--record stamps the results with the git revision: commit first (revision: {rev})")
    return root
