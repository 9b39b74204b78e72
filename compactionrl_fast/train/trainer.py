"""The PPO step of CompactionRL: critic values -> segment_gae -> critic and actor updates.

One step on a global batch of rollouts (each rank holds its share, cut into micro-batches):

1. critic update 1: a forward of the critic gives the values of the states before each trainable token;
   detached, they are the "old" values: the placed final rewards + `segment_gae` turn them into advantages
   and returns; `value_loss` on them is back-propagated (no separate no-grad pass is needed);
2. critic updates 2..K: the same value loss against the same returns;
3. actor update(s): `linear_logprobs` of the trainable tokens, `ppo_policy_loss` with the advantages.

Every loss is a token-level mean over the whole global batch: each micro-batch's loss is divided by the
global count (`micro_batch.Denominators`, over micro-batches and ranks, once per step), gradients are summed
over micro-batches and all-reduced (summed) over ranks, so the update equals the single-process
full-batch update. A micro-batch's layout is derived once, on the host (`micro_batch.MicroBatch`); the metrics
stay on the device and are read once, at the end of the step (`readout.read`). The math lives in the ops;
this file only wires them. The loop around the step (rollouts, logging, checkpoints) is train/loop.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checkpoint, diagnostics
from .config import TrainConfig, validate
from .config_load import to_dict
from .dist import all_reduce_grads
from .micro_batch import Denominators, as_micro_batches
from .model import actor_logprobs, critic_hidden
from .readout import Means, read


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


def advantages(batch, values, cfg: TrainConfig, rewards=None):
    """(advantages [T], returns [T]) of a packed batch from critic values [T], via the package's ops;
    `rewards`: the placed final rewards [T] (None: placed here, `micro_batch.placed_rewards`)."""
    from ..ops import segment_gae
    from .micro_batch import placed_rewards

    rewards = placed_rewards(batch, cfg) if rewards is None else rewards
    return segment_gae(rewards, values, batch.loss_mask, batch.cu_seqlens, batch.cu_segments, gamma=cfg.gamma,
                       lam=cfg.lam, cross_segment=cfg.cross_segment, lam_critic=cfg.lam_critic,
                       adaptive_alpha=cfg.adaptive_alpha, adaptive_length=cfg.adaptive_length)


def optim_step(params, opt, max_norm, group):
    """All-reduce the gradients, clip them and step; returns the gradient norm before clipping ([] tensor)."""
    params = list(params)
    all_reduce_grads(params, group)
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)
    opt.step()
    return norm


def _scatter(idx, values, T):
    """[T] float32 zeros with `values` [N] at positions `idx`."""
    v = values.float()
    return v.new_zeros(T).index_put_((idx,), v)


def sampler_gap(behaviour, batch, idx):
    """max |trainer log-prob - sampler log-prob| over the trainable tokens `idx` [N] (0 when N = 0), a 0-d
    tensor; `behaviour` [N]: the trainer's log-probs before any update of this step."""
    d = (behaviour.detach().float() - batch.rollout_logprobs[idx].float()).abs()
    return torch.cat([d, d.new_zeros(1)]).max()


def train_step(state: State, batches: list, *, update_actor: bool = True, diagnose: bool = True,
               advantage_gap: bool = False, minibatches: list | None = None,
               measure_sampler_gap: bool = False) -> dict:
    """One PPO step over this rank's micro-batches (PackedBatch or `micro_batch.MicroBatch` each, whole
    rollouts). Returns metrics (host numbers, read from the device once, at the end).

    `minibatches`: lists of indices into `batches`, one actor optimiser step each, repeated for
    cfg.ppo_epochs (default: all micro-batches in one step). Every rank must pass the same number.
    `sampler/logp_absdiff_max` (the sampler-vs-learner gap, `sampler_gap`) is measured at every actor
    update for free, and with an extra actor forward on a critic-only step when `measure_sampler_gap`.
    `advantage_gap`: also the gap between the paper's and the stitched advantages (`diagnostics.advantage_gap`).
    """
    cfg, actor, critic, group = state.cfg, state.actor, state.critic, state.group
    from ..ops import value_head, value_loss

    if not batches:
        raise ValueError("train_step: batches is empty (every rank needs at least one micro-batch)")
    mbs = as_micro_batches(batches, cfg)
    minibatches = minibatches or [list(range(len(mbs)))]
    device = mbs[0].idx.device
    den = Denominators.build(mbs, minibatches if update_actor else [], cfg, group, device)
    rec = {}  # what the step measured, on the device until `read`
    # ---- critic: update 1 also yields the old values, hence advantages and returns
    adv, ret, old_v = [None] * len(mbs), [None] * len(mbs), [None] * len(mbs)
    critic.train()
    for k in range(max(cfg.critic_updates_per_step, 1)):
        state.opt_critic.zero_grad()
        rows, losses = [], []  # (metrics, weight) of each micro-batch, and its loss
        for i, m in enumerate(mbs):
            b = m.batch
            v = value_head(critic_hidden(critic, b, m.idx, m.tables), critic.weight, critic.bias)  # [N]
            if k == 0:
                old_v[i] = v.detach()
                adv[i], ret[i] = advantages(b, _scatter(m.idx, old_v[i], b.loss_mask.numel()), cfg, m.rewards)
            loss, met = value_loss(v, old_v[i], ret[i][m.idx], m.value_mask, clip=cfg.value_clip,
                                   cu_seqlens=m.loss_cu, reduction="token-mean", denominator=den.value)
            loss.backward()
            losses.append(loss.detach())  # each micro-batch's share of the global-batch loss
            rows.append((met, m.n_tokens))
        if cfg.critic_updates_per_step > 0:
            rec["critic_grad_norm"] = optim_step(critic.parameters(), state.opt_critic, cfg.max_grad_norm, group)
        if k == 0:
            rec["critic"] = (rows, losses)
    # ---- actor: PPO epochs over mini-batches
    gaps = []
    if update_actor:
        actor.train()
        # the schedule is a function of the actor update (state.step counts value pre-training first), so a
        # resumed run continues it
        update = state.step - cfg.value_pretrain_steps
        lr = actor_lr_at(cfg, update)
        for g in state.opt_actor.param_groups:
            g["lr"] = lr
        epochs = cfg.ppo_epochs if max(update, 0) >= cfg.ppo_epochs_from else 1
        # behaviour log-probs, frozen before the first actor step; the first mini-batch is trained before
        # any step, so its live log-probs (detached, kept by _actor_update for later epochs) are the behaviour ones
        old = [None] * len(mbs)
        with torch.no_grad():
            for i, m in enumerate(mbs):
                if i not in minibatches[0] and any(i in mb for mb in minibatches):
                    old[i] = actor_logprobs(actor, m.batch, m.idx, temperature=cfg.temperature, tables=m.tables)
        rec["actor"] = []
        for _ in range(epochs):
            for j, mb in enumerate(minibatches):
                sub = lambda xs: [xs[i] for i in mb]  # noqa: E731
                behaviour = sub(old)
                rec["actor"].append(_actor_update(state, sub(mbs), sub(adv), behaviour, den.policy[j], gaps))
                for i, b in zip(mb, behaviour):
                    old[i] = b
    elif measure_sampler_gap:
        with torch.no_grad():
            gaps = [sampler_gap(actor_logprobs(actor, m.batch, m.idx, temperature=cfg.temperature, tables=m.tables),
                                m.batch, m.idx) for m in mbs]
    if gaps:
        rec["sampler_gap"] = torch.stack(gaps).max()
    # ---- diagnostics on the whole local batch
    if diagnose:
        rec["diag"] = []
        for i, m in enumerate(mbs):
            values = _scatter(m.idx, old_v[i], m.batch.loss_mask.numel())
            stats = diagnostics.batch_diagnostics(m, adv[i], values, ret[i])
            if advantage_gap:
                stats.update(diagnostics.advantage_gap(m, values, cfg))
            rec["diag"].append(stats)
    return _metrics(read(rec), mbs, update_actor=update_actor, measure_sampler_gap=measure_sampler_gap,
                    lr=lr if update_actor else None)


def _metrics(rec: dict, mbs: list, *, update_actor: bool, measure_sampler_gap: bool, lr) -> dict:
    """The step's metrics from its read record (host numbers only)."""
    out = {}
    if "critic_grad_norm" in rec:
        out["critic_grad_norm"] = rec["critic_grad_norm"]
    rows, losses = rec["critic"]
    out.update(Means(rows).result("critic/"))
    out["critic/value_loss"] = _total(losses)
    if update_actor:
        acc = Means()
        for rows, losses, norm in rec["actor"]:
            mb = Means(rows).result("actor/")
            mb["actor/policy_loss"] = _total(losses)
            mb["actor/grad_norm"] = norm
            acc.add(mb, 1.0)
        out.update(acc.result())
        out["actor/lr"] = lr
    if update_actor or measure_sampler_gap:
        out["sampler/logp_absdiff_max"] = rec["sampler_gap"]
    if "diag" in rec:
        d = Means()
        for i, (m, stats) in enumerate(zip(mbs, rec["diag"])):
            scalars = {k: v for k, v in stats.items() if not isinstance(v, list)}
            d.add(scalars, m.n_tokens)
            if i == 0:  # histograms and deciles of the first micro-batch; undefined scalars stay None
                out.update({k: v for k, v in stats.items() if isinstance(v, list)})
                out.update(dict.fromkeys(scalars))
        out.update(d.result())
    return out


def _total(losses) -> float:
    total = 0.0
    for x in losses:
        total += x
    return total


def _actor_update(state, mbs, adv, old, den, gaps) -> tuple:
    """One actor optimiser step over micro-batches; `old`: behaviour log-probs [N] per micro-batch, None
    where the current policy is the behaviour policy (its log-probs detached: ratio 1 in value; stored into
    `old` for the later epochs). Appends each micro-batch's sampler gap (behaviour vs rollout log-probs) to
    `gaps`. Returns (metric rows, losses, gradient norm), on the device."""
    from ..ops import ppo_policy_loss

    cfg, actor, group = state.cfg, state.actor, state.group
    state.opt_actor.zero_grad()
    rows, losses = [], []
    for i, m in enumerate(mbs):
        b = m.batch
        logp, ent = actor_logprobs(actor, b, m.idx, temperature=cfg.temperature, return_entropy=True, tables=m.tables)
        rollout_lp = m.rollout_logprobs
        if old[i] is None:
            old[i] = logp.detach()
        gaps.append(sampler_gap(old[i], b, m.idx))
        loss, met = ppo_policy_loss(logp, old[i], adv[i][m.idx], m.policy_mask,
                                    cu_seqlens=m.loss_cu, cu_segments=b.cu_segments, clip_low=cfg.clip_low,
                                    clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                                    rollout_logprobs=rollout_lp if cfg.tis_cap else None, tis_cap=cfg.tis_cap,
                                    reduction=cfg.loss_reduction, denominator=den)
        loss.backward()
        if m.n_policy:
            with torch.no_grad():
                p = m.policy_pos
                lr = logp.detach()[p] - rollout_lp[p]  # trainer vs sampler log-prob mismatch
                met.update(rollout_kl=(torch.expm1(lr) - lr).mean(), rollout_logp_absdiff_max=lr.abs().max(),
                           entropy=ent.detach()[p].mean())
        losses.append(loss.detach())
        rows.append((met, m.n_policy))
    return rows, losses, optim_step(actor.parameters(), state.opt_actor, cfg.max_grad_norm, group)
