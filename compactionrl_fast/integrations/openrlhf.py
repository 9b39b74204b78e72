"""OpenRLHF adapter: GAE and PPO losses with the signatures of OpenRLHF's own (read from OpenRLHF 0.11.2).

- `get_advantages_and_returns(values, rewards, action_mask, gamma, lambd)`: the arguments of
  `ExperienceMaker.get_advantages_and_returns` (openrlhf/trainer/ppo_utils/experience_maker.py) without
  `self`; swap it in with
      maker.get_advantages_and_returns = get_advantages_and_returns
  and pass `rollout_ids=` (per row) when the rows of an experience are segments of compacted rollouts.
- `PolicyLoss` and `ValueLoss`: `nn.Module`s with the constructor and `forward` of
  `openrlhf.models.loss.PolicyLoss` / `ValueLoss` and the same outputs, computed by the fused ops.

Semantics where they differ from OpenRLHF: OpenRLHF's GAE zeroes the values and rewards of masked
positions and still steps through them; this one skips them (docs/method.md: observation tokens are not steps).
On right-padded single-turn responses (a contiguous mask) both give the same numbers.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import ppo_policy_loss, value_loss
from ..ops._validate import trusted_layout
from ._common import denominator_from, masked_mean, number as _number
from .padded import as_bool_mask, flat, row_table, segment_gae_padded


@torch.no_grad()
def get_advantages_and_returns(values, rewards, action_mask, gamma, lambd, *, rollout_ids=None, segment_index=None,
                               **gae_kwargs):
    """OpenRLHF's GAE call, computed by `segment_gae`.

    Args:
        values, rewards: [B, L] float. action_mask: [B, L] 0/1 (trainable tokens).
        gamma, lambd: discount and GAE lambda (OpenRLHF's `args.algo.advantage.gamma/lambd`).
        rollout_ids, segment_index: [B] rows that are segments of one rollout (see `packed_layout`).
        gae_kwargs: other `segment_gae` keyword arguments. Defaults reproduce OpenRLHF on one-segment
            rows: lam=lambd, lam_critic=None (returns = advantages + values), cross_segment="paper".

    Returns:
        (advantages [B, L], returns [B, L]) float32, 0 where action_mask is 0.
    """
    if action_mask is None:
        action_mask = torch.ones(values.shape, dtype=torch.bool, device=values.device)
    kw = dict(gamma=_number("gamma", gamma), lam=_number("lambd", lambd), lam_critic=None, cross_segment="paper")
    kw.update(gae_kwargs)
    return segment_gae_padded(rewards, values, action_mask, rollout_ids, segment_index=segment_index, **kw)


def _reduction(token_level_loss, dp_size, batch_num_tokens, global_batch_size):
    """openrlhf/models/loss.py aggregate_loss: a token-mean, or a mean over rows of each row's token mean."""
    if token_level_loss:
        return "token-mean", denominator_from(batch_num_tokens, dp_size)
    return "segment-mean", denominator_from(global_batch_size, dp_size)


def _rows(reduction, B, L, device):
    """One segment per row of the flattened [B*L] batch, where the reduction needs segments."""
    return row_table(B, L, device=device).rows if reduction == "segment-mean" else None


class PolicyLoss(nn.Module):
    """Drop-in for `openrlhf.models.loss.PolicyLoss` (policy_loss_type="ppo").

    Supported train/rollout corrections: `is_correction_level="off"`, and the truncated importance weight
    (`"token"`, mode `"clip"`, gating `"ratio"`, threshold `(low <= 0, cap)`), i.e. min(pi_old/pi_rollout, cap).
    Others raise ValueError.
    """

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold: list = (0.5, 5.0)) -> None:
        super().__init__()
        if policy_loss_type != "ppo":
            raise ValueError(f"policy_loss_type must be 'ppo' for the compaction adapter, got {policy_loss_type!r}")
        if dual_clip is not None and not _number("dual_clip", dual_clip) > 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
        self.tis_cap = None
        if is_correction_level != "off":
            low, high = is_correction_threshold
            if (is_correction_level, is_correction_mode, is_correction_gating) != ("token", "clip", "ratio") or low > 0:
                raise ValueError("is_correction_*: only 'off' or the truncated importance weight (level='token', "
                                 "mode='clip', gating='ratio', threshold=(0, cap)) are supported")
            self.tis_cap = _number("is_correction_threshold[1]", high)
        self.clip_eps_low = _number("clip_eps_low", clip_eps_low)
        self.clip_eps_high = _number("clip_eps_high", clip_eps_high)
        self.dual_clip, self.token_level_loss = dual_clip, token_level_loss
        self.is_correction_threshold = tuple(is_correction_threshold)

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        """[B, L] tensors in, (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio) out, as OpenRLHF."""
        if action_mask is None:
            action_mask = torch.ones(log_probs.shape, dtype=torch.bool, device=log_probs.device)
        mask = as_bool_mask("action_mask", action_mask)
        B, L = mask.shape
        m_flat = mask.reshape(B * L)
        reduction, denom = _reduction(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        logp, old = flat("log_probs", log_probs, B, L), flat("old_log_probs", old_log_probs, B, L)
        roll = None
        if self.tis_cap is not None:
            if rollout_log_probs is None:
                raise ValueError("rollout_log_probs is required when is_correction_level != 'off'")
            roll = flat("rollout_log_probs", rollout_log_probs, B, L)
        with trusted_layout():  # the rows read in place: one segment per row
            loss, m = ppo_policy_loss(logp, old, flat("advantages", advantages, B, L), m_flat,
                                      cu_seqlens=_rows(reduction, B, L, mask.device),
                                      clip_low=self.clip_eps_low, clip_high=self.clip_eps_high,
                                      dual_clip=self.dual_clip, rollout_logprobs=roll, tis_cap=self.tis_cap,
                                      reduction=reduction, denominator=denom)
        with torch.no_grad():
            ppo_kl = masked_mean(old.float() - logp.detach().float(), m_flat).float()
            vllm_kl = filtered = None
            if roll is not None:
                vllm_kl = masked_mean(roll.float() - old.float(), m_flat).float()
                filtered = masked_mean(((old.float() - roll.float()).exp() > self.tis_cap).float(), m_flat).float()
        return loss, m["clip_fraction"], ppo_kl, vllm_kl, filtered


class ValueLoss(nn.Module):
    """Drop-in for `openrlhf.models.loss.ValueLoss`: 0.5 * max((v-R)^2, (v_clip-R)^2) (or unclipped)."""

    def __init__(self, clip_eps: float = None, token_level_loss: bool = True) -> None:
        super().__init__()
        self.clip_eps = None if clip_eps is None else _number("clip_eps", clip_eps)
        self.token_level_loss = token_level_loss

    def forward(self, values, old_values, returns, action_mask=None, dp_size=1, batch_num_tokens=None,
                global_batch_size=None):
        """[B, L] tensors in, the scalar loss out, as OpenRLHF."""
        if action_mask is None:
            action_mask = torch.ones(values.shape, dtype=torch.bool, device=values.device)
        mask = as_bool_mask("action_mask", action_mask)
        B, L = mask.shape
        reduction, denom = _reduction(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        with trusted_layout():
            loss, _ = value_loss(flat("values", values, B, L), flat("old_values", old_values, B, L),
                                 flat("returns", returns, B, L), mask.reshape(B * L), clip=self.clip_eps,
                                 cu_seqlens=_rows(reduction, B, L, mask.device), reduction=reduction,
                                 denominator=denom)
        return loss
