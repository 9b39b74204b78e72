"""Small helpers shared by the trainer adapters."""
from __future__ import annotations

import torch


def cfg_get(config, key, default=None):
    """`config[key]` of a dict, an OmegaConf DictConfig, a verl dataclass config or any object, else `default`
    (an explicit None in the config stays None)."""
    if config is None:
        return default
    get = getattr(config, "get", None)
    return get(key, default) if callable(get) else getattr(config, key, default)


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
    """Mean of `x` [N] over the True positions of `mask` [N] (0 when there is none), summed in float64 without a
    float64 copy; `x` is overwritten (pass a temporary). Masked positions never reach the sum (a NaN in
    padding does not)."""
    n = torch.count_nonzero(mask)
    return x.masked_fill_(~mask, 0).sum(dtype=torch.float64) / n.clamp(min=1)
