"""The PPO loop of CompactionRL: rollouts -> pack -> critic values -> segment_gae -> critic and actor updates.

One step on a global batch of rollouts (each rank holds its share, cut into micro-batches):

1. critic update 1: a forward of the critic gives the values of the states before each trainable token;
   detached, they are the "old" values: `place_final_rewards` + `segment_gae` turn them into advantages
   and returns; `value_loss` on them is back-propagated (no separate no-grad pass is needed);
2. critic updates 2..K: the same value loss against the same returns;
3. actor update(s): `linear_logprobs` of the trainable tokens, `ppo_policy_loss` with the advantages.

Every loss is a token-level mean over the whole global batch: each micro-batch's loss is divided by the
global count (`global_token_count` over micro-batches and ranks), gradients are summed over
micro-batches and all-reduced (summed) over ranks, so the update equals the single-process full-batch
update. The math lives in the ops; this file only wires them.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _io
from . import checkpoint, diagnostics
from .sync import check_sampler, push_weights
from .config import TrainConfig, to_dict, validate
from .model import action_index, actor_logprobs, critic_hidden
from .threads import maybe_step

# ----------------------------------------------------------------------------------------------
# distributed helpers (no-ops in a single process)


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_sum(x: float, group=None) -> float:
    if world()[1] == 1:
        return float(x)
    dev = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([float(x)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, group=group)
    return float(t)


def global_max(x: float, group=None) -> float:
    """Max of `x` over ranks (NaN counts as +inf)."""
    if world()[1] == 1:
        return float(x)
    dev = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([float(x) if not math.isnan(x) else math.inf], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def all_reduce_grads(params, group=None) -> None:
    """Sum gradients over ranks in one flat buffer (the losses already carry the global denominator)."""
    if world()[1] == 1:
        return
    params = list(params)
    for p in params:  # a parameter unused on one rank must still join the same flat buffer
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    o = 0
    for g in grads:
        g.copy_(flat[o:o + g.numel()].view_as(g))
        o += g.numel()


# ----------------------------------------------------------------------------------------------
# state


@dataclass
class State:
    """Models, optimisers and the step of a run. `step` counts iterations done: value pre-training steps
    first, then actor updates."""
    cfg: TrainConfig
    actor: Any
    critic: Any
    opt_actor: torch.optim.Optimizer
    opt_critic: torch.optim.Optimizer
    step: int = 0
    group: Any = None
    extra: dict = field(default_factory=dict)


def make_state(cfg: TrainConfig, actor, critic, group=None) -> State:
    validate(cfg)  # a config changed field by field after it was built
    adam = dict(betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return State(cfg, actor, critic, torch.optim.Adam(actor.parameters(), lr=cfg.actor_lr, **adam),
                 torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr, **adam), group=group)


def actor_lr_at(cfg: TrainConfig, update: int) -> float:
    """The actor's learning rate at actor update `update` (0-based, of cfg.steps).

    constant: cfg.actor_lr. linear / cosine: actor_lr * (r + (1 - r) * f(x)), r = cfg.lr_end_ratio,
    x = update / steps, f(x) = 1 - x or (1 + cos(pi x)) / 2: actor_lr at the first update, and r * actor_lr
    is reached just after the last one (so the last update still moves the weights when r = 0)."""
    if cfg.lr_schedule == "constant":
        return cfg.actor_lr
    x = min(max(update, 0) / max(cfg.steps, 1), 1.0)
    f = 1.0 - x if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * x))
    return cfg.actor_lr * (cfg.lr_end_ratio + (1.0 - cfg.lr_end_ratio) * f)


def save_state(state: State, run_dir: str) -> str:
    return checkpoint.save(run_dir, models={"actor": state.actor, "critic": state.critic},
                           optimizers={"actor": state.opt_actor, "critic": state.opt_critic},
                           step=state.step, extra={"config": to_dict(state.cfg), **state.extra})


def load_state(state: State, run_dir: str) -> None:
    info = checkpoint.load(run_dir, models={"actor": state.actor, "critic": state.critic},
                           optimizers={"actor": state.opt_actor, "critic": state.opt_critic})
    state.step = info["step"]
    state.extra = {k: v for k, v in info["extra"].items() if k != "config"}


# ----------------------------------------------------------------------------------------------
# one step on packed micro-batches


def policy_mask(batch, cfg: TrainConfig):
    """Tokens in the policy loss [T] bool: all trainable tokens, or (ablation) exec tokens only."""
    if cfg.train_summary_tokens:
        return batch.loss_mask
    seg, _, _ = diagnostics.segment_ids(batch)
    return batch.loss_mask & (batch.segment_kind.long()[seg] == diagnostics.EXEC)


def selected_offsets(batch, idx, mask):
    """cu_seqlens [S+1] over the selected positions `idx` (the layout the losses see), and the mask there."""
    seg, _, _ = diagnostics.segment_ids(batch)
    S = batch.cu_seqlens.numel() - 1
    counts = torch.zeros(S, dtype=torch.long, device=idx.device).index_add_(0, seg[idx], torch.ones_like(idx))
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]), mask[idx]


def concat_layout(batches, masks):
    """One (loss_mask [T], cu_seqlens [S+1], cu_segments [R+1]) over micro-batches, `masks` replacing loss_mask."""
    dev = batches[0].loss_mask.device if batches else "cpu"
    cu_seq, cu_seg = [torch.zeros(1, dtype=torch.long, device=dev)], [torch.zeros(1, dtype=torch.long, device=dev)]
    t = s = 0
    for b in batches:
        cu_seq.append(b.cu_seqlens[1:].long() + t)
        cu_seg.append(b.cu_segments[1:].long() + s)
        t, s = t + b.loss_mask.numel(), s + b.cu_seqlens.numel() - 1
    return torch.cat([m.reshape(-1) for m in masks]), torch.cat(cu_seq), torch.cat(cu_seg)


def denominator(batches, masks, reduction: str, group=None):
    """Global count (all micro-batches, all ranks) of the reduction's units: tokens, or segments or
    rollouts with a masked token; None for "sum". At least 1, so an all-masked batch gives loss 0."""
    from ..ops import global_denominator, global_token_count

    if reduction == "sum":
        return None
    mask, cu_seq, cu_seg = concat_layout(batches, masks)
    if reduction == "token-mean":
        return max(global_token_count(mask, group=group), 1)
    return max(global_denominator(reduction, mask, cu_seqlens=cu_seq, cu_segments=cu_seg, group=group), 1)


def advantages(batch, values, cfg: TrainConfig):
    """(advantages [T], returns [T]) of a packed batch from critic values [T], via the package's ops."""
    from ..ops import place_final_rewards, segment_gae

    mode = "stitched" if cfg.cross_segment == "stitched" else "paper"
    rewards = place_final_rewards(batch.rollout_rewards.float(), batch.loss_mask, batch.cu_seqlens,
                                  batch.cu_segments, mode=mode)
    return segment_gae(rewards, values, batch.loss_mask, batch.cu_seqlens, batch.cu_segments, gamma=cfg.gamma,
                       lam=cfg.lam, cross_segment=cfg.cross_segment, lam_critic=cfg.lam_critic,
                       adaptive_alpha=cfg.adaptive_alpha, adaptive_length=cfg.adaptive_length)


def _optim_step(params, opt, max_norm, group):
    params = list(params)
    all_reduce_grads(params, group)
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf")) if params else 0.0
    opt.step()
    return float(norm)


class _Mean:
    """Token-weighted mean of per-micro-batch metrics."""

    def __init__(self):
        self.sums, self.weights = {}, {}

    def add(self, metrics: dict, weight: float):
        for k, v in metrics.items():
            v = float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
            if math.isfinite(v):
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def result(self, prefix=""):
        return {prefix + k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


def _scatter(idx, values, T):
    """[T] float32 zeros with `values` [N] at positions `idx`."""
    return torch.zeros(T, dtype=torch.float32, device=idx.device).index_put_((idx,), values.float())


def sampler_gap(behaviour, batch, idx):
    """max |trainer log-prob - sampler log-prob| over the trainable tokens `idx` [N] (0 when N = 0), a 0-d
    tensor; `behaviour` [N]: the trainer's log-probs before any update of this step."""
    d = (behaviour.detach().float() - batch.rollout_logprobs[idx].float()).abs()
    return torch.cat([d, d.new_zeros(1)]).max()


def train_step(state: State, batches: list, *, update_actor: bool = True, diagnose: bool = True,
               gap: bool = False, minibatches: list | None = None, measure_gap: bool = False) -> dict:
    """One PPO step over this rank's micro-batches (PackedBatch each, whole rollouts). Returns metrics.

    `minibatches`: lists of indices into `batches`, one actor optimiser step each, repeated for
    cfg.ppo_epochs (default: all micro-batches in one step). Every rank must pass the same number.
    `sampler/logp_absdiff_max` (the sampler-vs-learner gap, `sampler_gap`) is measured at every actor
    update for free, and with an extra actor forward on a critic-only step when `measure_gap`.
    """
    cfg, actor, critic, group = state.cfg, state.actor, state.critic, state.group
    from ..ops import value_head, value_loss

    idx = [action_index(b.loss_mask, b.cu_attn) for b in batches]
    sel_v = [selected_offsets(b, i, b.loss_mask) for b, i in zip(batches, idx)]
    den_v = denominator(batches, [b.loss_mask for b in batches], "token-mean", group)
    out = {}
    # ---- critic: update 1 also yields the old values, hence advantages and returns
    adv, ret, old_v = [None] * len(batches), [None] * len(batches), [None] * len(batches)
    critic.train()
    for k in range(max(cfg.critic_updates_per_step, 1)):
        state.opt_critic.zero_grad(set_to_none=True)
        acc, total = _Mean(), 0.0
        for i, b in enumerate(batches):
            v = value_head(critic_hidden(critic, b, idx[i]), critic.weight, critic.bias)  # [N]
            if k == 0:
                old_v[i] = v.detach()
                adv[i], ret[i] = advantages(b, _scatter(idx[i], old_v[i], b.loss_mask.numel()), cfg)
            cu, m = sel_v[i]
            loss, met = value_loss(v, old_v[i], ret[i][idx[i]], m, clip=cfg.value_clip, cu_seqlens=cu,
                                   cu_segments=b.cu_segments, reduction="token-mean", denominator=den_v)
            loss.backward()
            total += float(loss.detach())  # each micro-batch's share of the global-batch loss
            acc.add(met, idx[i].numel())
        if cfg.critic_updates_per_step > 0:
            out["critic_grad_norm"] = _optim_step(critic.parameters(), state.opt_critic, cfg.max_grad_norm, group)
        if k == 0:
            out.update(acc.result("critic/"))
            out["critic/value_loss"] = total
    # ---- actor: PPO epochs over mini-batches
    if update_actor:
        actor.train()
        # the schedule is a function of the actor update (state.step counts value pre-training first), so a
        # resumed run continues it
        lr = actor_lr_at(cfg, state.step - cfg.value_pretrain_steps)
        for g in state.opt_actor.param_groups:
            g["lr"] = lr
        minibatches = minibatches or [list(range(len(batches)))]
        # behaviour log-probs, frozen before the first actor step; the first mini-batch of a single epoch
        # is trained before any step, so its live log-probs (detached) are the behaviour ones
        skip = set(minibatches[0]) if cfg.ppo_epochs == 1 else set()
        old = [None] * len(batches)
        with torch.no_grad():
            for i, b in enumerate(batches):
                if i not in skip and any(i in mb for mb in minibatches):
                    old[i] = actor_logprobs(actor, b, idx[i], temperature=cfg.temperature)
        acc, gaps = _Mean(), []
        for _ in range(cfg.ppo_epochs):
            for mb in minibatches:
                sub = lambda xs: [xs[j] for j in mb]  # noqa: E731
                acc.add(_actor_update(state, sub(batches), sub(idx), sub(adv), sub(old), gaps), 1.0)
        out.update(acc.result())
        out["actor/lr"] = lr
    elif measure_gap:
        with torch.no_grad():
            gaps = [sampler_gap(actor_logprobs(actor, b, idx[i], temperature=cfg.temperature), b, idx[i])
                    for i, b in enumerate(batches)]
    if update_actor or measure_gap:
        out["sampler/logp_absdiff_max"] = float(torch.stack(gaps).max()) if gaps else 0.0
    # ---- diagnostics on the whole local batch
    if diagnose:
        d = _Mean()
        for i, b in enumerate(batches):
            values = _scatter(idx[i], old_v[i], b.loss_mask.numel())
            stats = diagnostics.batch_diagnostics(b, adv[i], values, ret[i], cfg)
            if gap:
                stats.update(diagnostics.advantage_gap(b, values, cfg))
            scalars = {k: v for k, v in stats.items() if not isinstance(v, list)}
            d.add(scalars, idx[i].numel())
            if i == 0:  # histograms and deciles of the first micro-batch; undefined scalars stay None
                out.update({k: v for k, v in stats.items() if isinstance(v, list)})
                out.update(dict.fromkeys(scalars))
        out.update(d.result())
    return out


def _actor_update(state, batches, idx, adv, old, gaps) -> dict:
    """One actor optimiser step over micro-batches; `old`: behaviour log-probs [N] per micro-batch, None
    where the current policy is the behaviour policy (its log-probs detached: ratio 1 in value). Appends
    each micro-batch's sampler gap (behaviour vs rollout log-probs) to `gaps`."""
    from ..ops import ppo_policy_loss

    cfg, actor, group = state.cfg, state.actor, state.group
    pmask = [policy_mask(b, cfg) for b in batches]
    sel_p = [selected_offsets(b, i, m) for b, i, m in zip(batches, idx, pmask)]
    den_p = denominator(batches, pmask, cfg.loss_reduction, group)
    state.opt_actor.zero_grad(set_to_none=True)
    acc, total = _Mean(), 0.0
    for i, b in enumerate(batches):
        logp, ent = actor_logprobs(actor, b, idx[i], temperature=cfg.temperature, return_entropy=True)
        cu, m = sel_p[i]
        rollout_lp = b.rollout_logprobs[idx[i]].float()
        gaps.append(sampler_gap(logp if old[i] is None else old[i], b, idx[i]))
        loss, met = ppo_policy_loss(logp, logp.detach() if old[i] is None else old[i], adv[i][idx[i]], m,
                                    cu_seqlens=cu, cu_segments=b.cu_segments, clip_low=cfg.clip_low,
                                    clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                                    rollout_logprobs=rollout_lp if cfg.tis_cap else None, tis_cap=cfg.tis_cap,
                                    reduction=cfg.loss_reduction, denominator=den_p)
        loss.backward()
        n = int(m.sum())
        if n:
            with torch.no_grad():
                lr = logp.detach()[m] - rollout_lp[m]  # trainer vs sampler log-prob mismatch
                met.update(rollout_kl=(torch.expm1(lr) - lr).mean(), rollout_logp_absdiff_max=lr.abs().max(),
                           entropy=ent.detach()[m].mean())
        total += float(loss.detach())
        acc.add(met, n)
    out = acc.result("actor/")
    out["actor/policy_loss"] = total
    out["actor/grad_norm"] = _optim_step(actor.parameters(), state.opt_actor, cfg.max_grad_norm, group)
    return out


# ----------------------------------------------------------------------------------------------
# the loop: rollouts -> micro-batches -> train_step, with logging, evaluation and checkpoints

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
    cfg.ppo_minibatches even groups. Returns (batches, minibatches as lists of batch indices)."""
    k = max(1, min(cfg.ppo_minibatches, len(rollouts)))
    batches, groups = [], []
    for j in range(k):
        part = rollouts[j * len(rollouts) // k:(j + 1) * len(rollouts) // k]
        first = len(batches)
        batches += [pack(g).to(device) for g in split_rollouts(part, cfg.micro_batch_tokens)]
        groups.append(list(range(first, len(batches))))
    return batches, groups


def rollout_metrics(rollouts: list, prefix: str = "") -> dict:
    """Reward, success, compactions, summary length, finish reasons, and the environments' numeric info."""
    n = max(len(rollouts), 1)
    out = {"reward": sum(r.reward for r in rollouts) / n, "success": sum(r.success for r in rollouts) / n,
           "compactions": sum(r.compactions for r in rollouts) / n,
           "truncated": sum(r.truncated for r in rollouts) / n,
           "errors": sum(r.finish_reason == "error" for r in rollouts) / n,
           "turns": sum(len(r.turns) for r in rollouts) / n}
    lens = [x for r in rollouts for x in r.summary_lengths]
    out["summary_tokens"] = sum(lens) / len(lens) if lens else 0.0
    keys = {k for r in rollouts for k, v in r.info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for k in sorted(keys):
        vals = [float(r.info[k]) for r in rollouts if isinstance(r.info.get(k), (int, float))]
        out["info/" + k] = sum(vals) / len(vals)
    return {prefix + k: v for k, v in out.items()}


def read_rows(path: str) -> list:
    """The rows of a metrics.jsonl, skipping lines that do not parse (a write cut by a kill)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


class MetricsLog:
    """JSON lines in run_dir/metrics.jsonl (rank 0), and TensorBoard scalars when it is installed."""

    def __init__(self, run_dir: str, *, resume_step: int | None = None, tensorboard: bool = True):
        self.rank = world()[0]
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        if self.rank != 0:
            return
        os.makedirs(run_dir, exist_ok=True)
        _io.remove_stale_temps(run_dir)  # temporary files of a run killed mid-write
        if resume_step is not None and os.path.isfile(self.path):
            # drop rows logged after the checkpoint (those steps are redone) and a line cut by a kill
            rows = [json.dumps(r) + "\n" for r in read_rows(self.path) if r.get("step", -1) < resume_step]
            _io.write_text(self.path, "".join(rows))
        elif os.path.isfile(self.path):
            os.remove(self.path)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except Exception:  # noqa: BLE001 -- tensorboard is optional
                self.tb = None

    def log(self, step: int, metrics: dict) -> None:
        if self.rank != 0:
            return
        row = {"step": step, **diagnostics.finite(metrics)}
        line = json.dumps(row) + "\n"
        with open(self.path, "a") as f:  # one line appended and synced; a line cut by a kill is dropped on resume
            size = f.tell()
            try:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                f.truncate(size)  # no partial line left behind
                if _io.is_no_space(e):
                    raise OSError(e.errno, f"no space left on device while writing {self.path}") from e
                raise
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)


def evaluate(engine, make_envs, tokenizer, rollout_cfg, n: int, *, temperature: float, seed_base: int = EVAL_SEED_BASE,
             chunk: int = 128, chat=None) -> tuple:
    """Run `n` held-out rollouts (this rank's share) at `temperature` (0: greedy). Returns (metrics, rollouts)."""
    from ..rollout.loop import run_rollouts

    rank, ws = world()
    seeds = [seed_base + i for i in range(n) if i % ws == rank]
    cfg = rollout_cfg.replace(temperature=temperature, seed=seed_base + rank)
    out = []
    for i in range(0, len(seeds), chunk):
        s = seeds[i:i + chunk]
        out += run_rollouts(engine, make_envs(len(s)), tokenizer, cfg, s, chat=chat)
    m = rollout_metrics(out)
    if ws > 1:  # fixed keys averaged over ranks; the environments' info keys stay this rank's
        n = max(global_sum(len(out)), 1)
        m.update({k: global_sum(v * len(out)) / n for k, v in m.items() if not k.startswith("info/")})
    return m, out


def _rollouts_fn(engine):
    """run_episodes (independent async episodes) for an engine that asks for them (ServerEngine), else the
    lockstep run_rollouts."""
    if getattr(engine, "async_episodes", False):
        from ..rollout.episodes import run_episodes

        return run_episodes
    from ..rollout.loop import run_rollouts

    return run_rollouts


def fit(state: State, *, engine, make_envs, tokenizer, rollout_cfg, pack, run_dir: str, log: MetricsLog | None = None,
        progress=None, eval_fn=None, metrics_fn=None, chat=None, tuner=None) -> State:
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
    from ..rollout.loop import run_rollouts

    cfg = state.cfg
    rank, ws = world()
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
            gap = bool(cfg.gap_every) and (it % cfg.gap_every == 0)
            metrics = train_step(state, batches, update_actor=not pretrain, gap=gap, minibatches=minibatches,
                                 measure_gap=first)
            t2 = time.perf_counter()
            if not pretrain:
                sync_s += push_weights(engine, state.actor)
        rm = rollout_metrics(rollouts)
        if ws > 1:  # the fixed keys are averaged over ranks; the environments' info keys stay rank 0's
            rm.update({k: global_sum(v, state.group) / ws for k, v in rm.items() if not k.startswith("info/")})
        metrics.update(rm)
        if metrics_fn is not None:
            metrics.update(metrics_fn(rollouts))
        metrics.update({"phase": "value_pretrain" if pretrain else "ppo", "time/rollout_s": t1 - t0,
                        "time/train_s": t2 - t1, "time/weight_sync_s": sync_s, "threads": threads,
                        "actor_step": max(0, it + 1 - cfg.value_pretrain_steps)})
        state.step = it + 1
        if eval_fn is not None and not pretrain and cfg.eval_every and (state.step - cfg.value_pretrain_steps) % cfg.eval_every == 0:
            metrics.update(eval_fn(state))
        gap_now = metrics.get("sampler/logp_absdiff_max")
        if gap_now is not None and ws > 1:  # every rank sees the same gap, so all raise or none
            gap_now = metrics["sampler/logp_absdiff_max"] = global_max(gap_now, state.group)
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
            save_state(state, run_dir)
    return state
