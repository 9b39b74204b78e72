"""Supervised warm start: maximum likelihood of the demonstrations' trainable tokens (summaries included).

Small models start from scratch, so the demo first imitates a scripted expert. The loss is the
token-mean negative log-likelihood over all trainable tokens of the (global) batch, with the
log-probs from `linear_logprobs` (temperature 1).
"""
from __future__ import annotations

import math

import torch

from .model import action_index, actor_logprobs
from .micro_batch import denominator
from .trainer import optim_step


def lr_at(step: int, total: int, cfg) -> float:
    """Linear warm-up, then cosine decay to `lr * min_lr_ratio`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def make_optimizer(actor, cfg):
    return torch.optim.AdamW(actor.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def sft_step(actor, opt, batches, cfg, *, lr=None, group=None) -> dict:
    """One optimiser step of token-mean NLL over this rank's micro-batches (PackedBatch each)."""
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = lr
    actor.train()
    opt.zero_grad(set_to_none=True)
    den = denominator(batches, [b.loss_mask for b in batches], "token-mean", group)
    total = 0.0
    for b in batches:
        idx = action_index(b.loss_mask, b.cu_attn)
        logp = actor_logprobs(actor, b, idx)
        loss = -logp.sum() / den
        loss.backward()
        total += float(loss.detach())
    norm = float(optim_step(actor.parameters(), opt, cfg.max_grad_norm, group))
    return {"sft/loss": total, "sft/grad_norm": norm, "sft/tokens": den,
            "sft/lr": opt.param_groups[0]["lr"]}
