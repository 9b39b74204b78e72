"""TRL adapter: the GAE and PPO losses of TRL's PPOTrainer as functions, computed by the fused ops.

TRL's PPO (trl/experimental/ppo/ppo_trainer.py, `PPOTrainer.train`, last shipped in TRL 1.12; TRL 1.13
removed it) computes them inline, on right-padded `[B, L]` responses with two padding masks (True on
padding): `padding_mask` (after the last response token) and `padding_mask_p1` (one position later:
the value and the score of that position still take part). These functions take the variables of
that code, in its order, and return what it computes:

    advantages, returns = compute_advantages(rewards, values, padding_mask, padding_mask_p1,
                                             args.gamma, args.lam)
    pg_loss, pg_clipfrac = policy_loss(new_logprobs, mb_logprobs, mb_advantage,
                                       padding_mask[micro_batch_inds], args.cliprange)
    vf_loss, vf_clipfrac = value_loss(vpred, mb_values, mb_return,
                                      padding_mask_p1[micro_batch_inds], args.cliprange_value)

Pass `rollout_ids=` (per row) to `compute_advantages` when rows are segments of compacted rollouts.
"""
from __future__ import annotations

import torch

from ..ops import ppo_policy_loss
from ..ops import value_loss as _value_loss
from ..ops._validate import trusted_layout
from ._common import masked_whiten, number as _number
from .padded import as_bool_mask, flat, segment_gae_padded


@torch.no_grad()
def compute_advantages(rewards, values, padding_mask, padding_mask_p1, gamma, lam, *, whiten=True, rollout_ids=None,
                       segment_index=None, **gae_kwargs):
    """TRL's steps "compute advantages and returns" and "whiten advantages" by `segment_gae`.

    Args:
        rewards, values: [B, L] float (TRL: KL penalty per token plus the score after the last token).
        padding_mask, padding_mask_p1: [B, L] bool, True on padding (TRL's two masks).
        gamma, lam: TRL's `args.gamma`, `args.lam`.
        whiten: whiten the advantages over the response tokens (TRL always does).
        rollout_ids, segment_index: [B] rows that are segments of one rollout (see `packed_layout`).
        gae_kwargs: other `segment_gae` keyword arguments; the defaults reproduce TRL on one-segment rows
            (lam_critic=None: returns = advantages + values; cross_segment="paper").

    Returns:
        (advantages [B, L], returns [B, L]) float32: advantages 0 on `padding_mask`, returns 0 on
        `padding_mask_p1`, as TRL's.
    """
    # TRL's recurrence runs over these positions
    steps = torch.logical_not(as_bool_mask("padding_mask_p1", padding_mask_p1))
    response = torch.logical_not(as_bool_mask("padding_mask", padding_mask))
    kw = dict(gamma=_number("gamma", gamma), lam=_number("lam", lam), lam_critic=None, cross_segment="paper")
    kw.update(gae_kwargs)
    adv, ret = segment_gae_padded(rewards, values, steps, rollout_ids, segment_index=segment_index, **kw)
    adv = masked_whiten(adv, response) if whiten else torch.where(response, adv, 0.0)
    return adv, ret


def policy_loss(new_logprobs, logprobs, advantages, padding_mask, cliprange):
    """TRL's clipped policy loss: (pg_loss, pg_clipfrac), the token mean over non-padding positions.

    `new_logprobs` [B, L] receives the gradient; `logprobs`, `advantages` [B, L]; `padding_mask` True on padding.
    """
    keep = torch.logical_not(as_bool_mask("padding_mask", padding_mask))
    B, L = keep.shape
    clip = _number("cliprange", cliprange)
    with trusted_layout():  # the rows read in place
        loss, m = ppo_policy_loss(flat("new_logprobs", new_logprobs, B, L), flat("logprobs", logprobs, B, L),
                                  flat("advantages", advantages, B, L), keep.reshape(B * L), clip_low=clip,
                                  clip_high=clip)
    return loss, m["clip_fraction"]


def value_loss(vpred, values, returns, padding_mask_p1, cliprange_value):
    """TRL's clipped value loss: (vf_loss, vf_clipfrac), 0.5 * token mean of max((v-R)^2, (v_clip-R)^2)."""
    keep = torch.logical_not(as_bool_mask("padding_mask_p1", padding_mask_p1))
    B, L = keep.shape
    with trusted_layout():
        loss, m = _value_loss(flat("vpred", vpred, B, L), flat("values", values, B, L), flat("returns", returns, B, L),
                              keep.reshape(B * L), clip=_number("cliprange_value", cliprange_value))
    return loss, m["clip_fraction"]
