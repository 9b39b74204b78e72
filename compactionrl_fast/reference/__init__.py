"""Naive PyTorch references: the oracles of the tests and the baselines of the benchmarks."""
from .gae import place_final_rewards, segment_gae
from .linear_logprobs import linear_logprobs, naive_linear_logprobs
from .losses import ppo_policy_loss, value_head, value_loss

__all__ = ["segment_gae", "place_final_rewards"]
__all__ += ["linear_logprobs", "naive_linear_logprobs"]
__all__ += ["ppo_policy_loss", "value_loss", "value_head"]
