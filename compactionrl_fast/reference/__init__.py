"""Naive PyTorch references: the oracles of the tests and the baselines of the benchmarks."""
from .gae import place_final_rewards, segment_gae

__all__ = ["segment_gae", "place_final_rewards"]
