"""Public ops (one file each) with validation and backend dispatch."""
from . import _dispatch
from .gae import place_final_rewards, segment_gae
from .linear_logprobs import linear_logprobs, linear_logprobs_loss

_dispatch.cpp_ext()  # load the compiled ops (if built) so torch.ops.compactionrl_fast.* exist

__all__ = ["segment_gae", "place_final_rewards"]
__all__ += ["linear_logprobs", "linear_logprobs_loss"]
