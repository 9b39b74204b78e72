"""Small helpers shared by the trainer adapters."""
from __future__ import annotations

import torch


# The critic's target: "local", segment_gae's returns; "corrected", the scaled advantages + values
# (docs/slime.md and docs/verl.md: why local is the default).
CRITIC_TARGETS = ("local", "corrected")


def critic_returns(adv, ret, values, mask, target):
    """The critic's targets [T] or [B, L]: `ret` ("local") or advantages + values on trainable tokens, 0 elsewhere
    ("corrected")."""
    return torch.where(mask, adv + values.float(), 0.0) if target == "corrected" else ret


def cfg_get(config, key, default=None):
    """`config[key]` of a dict, an OmegaConf DictConfig, a verl dataclass config or any object, else `default`
    (an explicit None in the config stays None)."""
    if config is None:
        return default
    get = getattr(config, "get", None)
    return get(key, default) if callable(get) else getattr(config, key, default)


def number(name, x):
    """float(x) for a Python/numpy/0-d tensor number; TypeError naming the argument otherwise."""
    if isinstance(x, bool) or isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be a number, got {type(x).__name__} {x!r}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}") from None


def masked_whiten(x, mask, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over the trainable tokens, unbiased variance; 0 elsewhere.

    The batch whitening verl and TRL apply to GAE advantages (float32 in, float32 out). Needs at least 2
    trainable tokens, like theirs.
    """
    n = int(mask.sum())
    if n < 2:
        raise ValueError(f"whitening needs at least 2 trainable tokens in the batch, got {n}")
    xm = x.double()[mask]
    mean = xm.mean()
    var = ((xm - mean) ** 2).sum() / (n - 1)
    return torch.where(mask, (x.double() - mean) * torch.rsqrt(var + eps), 0.0).to(x.dtype)


def denominator_from(count, dp_size):
    """A trainer's global count divided by the data-parallel size (they multiply the loss by dp_size)."""
    if count is None:
        return None
    if isinstance(count, torch.Tensor):
        return count.detach().double().reshape(()) / dp_size
    return float(count) / dp_size


def masked_mean(x, mask):
    """Mean of `x` [N] over the True positions of `mask` [N] (0 when there is none); `x` may be overwritten
    (pass a temporary). Masked positions never reach the sum (a NaN in padding does not).

    CPU: a BLAS dot product with the mask (torch's bool-mask `where` is ~25x slower there); a non-finite
    result, which a NaN or inf at a masked position could cause, is recomputed the exact way."""
    n = torch.count_nonzero(mask)
    s = None
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        s = torch.dot(x, mask.to(x.dtype))
        if not bool(torch.isfinite(s)):
            s = None
    if s is None:
        s = x.masked_fill_(~mask, 0).sum()
    return s.double() / n.clamp(min=1)