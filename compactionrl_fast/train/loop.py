"""The training loop: rollouts -> micro-batches -> `trainer.train_step`, with logging, evaluation and
checkpoints, from value pre-training to the last PPO step."""
from __future__ import annotations

import time

from . import dist, trainer
from .config import TrainConfig
from .micro_batch import layout_on
from .log import MetricsLog, compaction_metrics, rollout_metrics
from .sync import check_sampler, push_weights
from .threads import maybe_step

EVAL_SEED_BASE = 1_000_000_000  # evaluation tasks are seeded apart from every training task


def train_seeds(cfg: TrainConfig, step: int, rank: int, n: int) -> list:
    """Task seeds of this rank's rollouts at `step`: a function of (seed, step, rank) only, so that a
    resumed run sees the same tasks. With group_size g, g consecutive rollouts share a task."""
    base = (cfg.seed * 100_003 + step) * cfg.rollouts_per_step + rank * n
    return [(base + i) // cfg.group_size for i in range(n)]


def split_rollouts(rollouts: list, max_tokens: int) -> list:
    """Contiguous groups of whole rollouts with at most `max_tokens` tokens each (one rollout may exceed it)."""
    groups, cur, size = [], [], 0
    for r in rollouts:
        n = sum(len(s) for s in r.segments)
        if cur and size + n > max_tokens:
            groups.append(cur)
            cur, size = [], 0
        cur.append(r)
        size += n
    if cur:
        groups.append(cur)
    return groups


def micro_batches(rollouts: list, cfg: TrainConfig, pack, device="cpu"):
    """Pack a rank's rollouts into micro-batches of at most cfg.micro_batch_tokens tokens, within
    cfg.ppo_minibatches even groups, each with its layout derived on the host and moved to `device`.
    Returns (batches as `micro_batch.MicroBatch`, minibatches as lists of batch indices)."""
    k = max(1, min(cfg.ppo_minibatches, len(rollouts)))
    batches, groups = [], []
    for j in range(k):
        part = rollouts[j * len(rollouts) // k:(j + 1) * len(rollouts) // k]
        first = len(batches)
        batches += [layout_on(pack(g), cfg, device) for g in split_rollouts(part, cfg.micro_batch_tokens)]
        groups.append(list(range(first, len(batches))))
    return batches, groups


def evaluate(engine, make_envs, tokenizer, rollout_cfg, n: int, *, temperature: float, seed_base: int = EVAL_SEED_BASE,
             chunk: int = 128, chat=None) -> tuple:
    """Run `n` held-out rollouts (this rank's share) at `temperature` (0: greedy). Returns (metrics, rollouts)."""
    from ..rollout.loop import run_rollouts

    rank, ws = dist.world()
    seeds = [seed_base + i for i in range(n) if i % ws == rank]
    cfg = rollout_cfg.replace(temperature=temperature, seed=seed_base + rank)
    out = []
    for i in range(0, len(seeds), chunk):
        s = seeds[i:i + chunk]
        out += run_rollouts(engine, make_envs(len(s)), tokenizer, cfg, s, chat=chat)
    m = rollout_metrics(out)
    if ws > 1:  # fixed keys averaged over ranks; the environments' info keys stay this rank's
        n = max(dist.global_sum(len(out)), 1)
        m.update({k: dist.global_sum(v * len(out)) / n for k, v in m.items() if not k.startswith("info/")})
    return m, out


def _rollouts_fn(engine):
    """run_episodes (independent async episodes) for an engine that asks for them (ServerEngine), else the
    lockstep run_rollouts."""
    if getattr(engine, "async_episodes", False):
        from ..rollout.episodes import run_episodes

        return run_episodes
    from ..rollout.loop import run_rollouts

    return run_rollouts


def fit(state: trainer.State, *, engine, make_envs, tokenizer, rollout_cfg, pack, run_dir: str, log: MetricsLog | None = None,
        progress=None, eval_fn=None, metrics_fn=None, chat=None, tuner=None) -> trainer.State:
    """Value pre-training then PPO, from `state.step` to `value_pretrain_steps + steps` iterations.

    Args:
        engine: generation engine; one that does not share the actor's parameters (`shares_weights`) gets
            the actor's weights at the start and after every actor update (`time/weight_sync_s`), and
            every step checks the sampler-vs-learner gap against cfg.sampler_logp_tol.
        make_envs: n -> list of n environments. rollout_cfg: RolloutConfig.
        pack: rollouts -> PackedBatch. eval_fn: (state) -> dict, called every cfg.eval_every actor steps.
        metrics_fn: rollouts -> dict of task-specific metrics logged with each step (this rank's rollouts).
        tuner: a `threads.ThreadTuner` that sets the CPU thread count of each step (None: leave it).
    """
    cfg = state.cfg
    rank, ws = dist.world()
    if cfg.rollouts_per_step % ws:
        raise ValueError(f"rollouts_per_step={cfg.rollouts_per_step} is not divisible by the world size {ws}")
    n_local = cfg.rollouts_per_step // ws
    device = next(state.actor.parameters()).device
    total = cfg.value_pretrain_steps + cfg.steps
    log = log or MetricsLog(run_dir, resume_step=state.step)
    sync_s = push_weights(engine, state.actor)  # the start of RL: after SFT, after a resume
    first = True
    while state.step < total:
        it = state.step
        pretrain = it < cfg.value_pretrain_steps
        with maybe_step(tuner) as threads:
            t0 = time.perf_counter()
            # the sampling seed is a function of the step too: a resumed run draws the same rollouts
            rcfg = rollout_cfg.replace(temperature=cfg.temperature, seed=(cfg.seed * 100_003 + it) * 1009 + rank)
            rollouts = _rollouts_fn(engine)(engine, make_envs(n_local), tokenizer, rcfg,
                                            train_seeds(cfg, it, rank, n_local), chat=chat)
            t1 = time.perf_counter()
            batches, minibatches = micro_batches(rollouts, cfg, pack, device)
            advantage_gap = bool(cfg.gap_every) and (it % cfg.gap_every == 0)
            metrics = trainer.train_step(state, batches, update_actor=not pretrain, advantage_gap=advantage_gap,
                                         minibatches=minibatches, measure_sampler_gap=first)
            t2 = time.perf_counter()
            if not pretrain:
                sync_s += push_weights(engine, state.actor)
        rm = rollout_metrics(rollouts)
        # the fixed keys are averaged over ranks; the environments' info keys stay rank 0's
        rm.update({k: dist.global_sum(v, state.group) / ws for k, v in rm.items() if not k.startswith("info/")})
        metrics.update(rm)
        metrics.update(compaction_metrics(rollouts, cfg, state.group))  # the whole step's, on every rank
        if metrics_fn is not None:
            metrics.update(metrics_fn(rollouts))
        metrics.update({"phase": "value_pretrain" if pretrain else "ppo", "time/rollout_s": t1 - t0,
                        "time/train_s": t2 - t1, "time/weight_sync_s": sync_s, "threads": threads,
                        "actor_step": max(0, it + 1 - cfg.value_pretrain_steps)})
        state.step = it + 1
        if eval_fn is not None and not pretrain and cfg.eval_every and (state.step - cfg.value_pretrain_steps) % cfg.eval_every == 0:
            metrics.update(eval_fn(state))
        gap_now = metrics.get("sampler/logp_absdiff_max")
        if gap_now is not None:  # every rank sees the same gap, so all raise or none
            gap_now = metrics["sampler/logp_absdiff_max"] = dist.global_max(gap_now, state.group)
        bad = cfg.sampler_logp_tol is not None and gap_now is not None and not gap_now <= cfg.sampler_logp_tol
        if it % cfg.log_every == 0 or state.step == total or bad:
            log.log(it, metrics)
        check_sampler(gap_now, cfg.sampler_logp_tol, it, engine, actor=state.actor)
        sync_s, first = 0.0, False
        if progress is not None:
            progress.update(1)
            progress.set_postfix(succ=f"{metrics['success']:.2f}", R=f"{metrics['reward']:.2f}",
                                 ph="V" if pretrain else "PPO")
        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and rank == 0:
            trainer.save_state(state, run_dir)
    return state
