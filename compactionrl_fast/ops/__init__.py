"""Public ops, one file each (docs/adding-an-op.md), on the shared skeleton: _validate (input checks),
_dispatch (backend choice), _register (custom op + fake + autograd)."""
from . import _dispatch
from . import _mask  # noqa: F401 -- registers the mask_to_bool op (its fake) with the package
from .denominator import global_denominator, global_token_count
from .gae import place_final_rewards, segment_gae, segment_params
from .linear_logprobs import linear_logprobs, linear_logprobs_loss
from .output_cache import output_cache
from .ppo_loss import ppo_policy_loss
from .value_head import value_head, value_head_loss
from .value_loss import value_loss

_dispatch.cpp_ext()  # load the compiled ops (if built) so torch.ops.compactionrl_fast.* exist

__all__ = ["segment_gae", "segment_params", "place_final_rewards"]
__all__ += ["linear_logprobs", "linear_logprobs_loss"]
__all__ += ["ppo_policy_loss", "value_loss", "value_head", "value_head_loss", "global_token_count",
            "global_denominator", "output_cache"]
