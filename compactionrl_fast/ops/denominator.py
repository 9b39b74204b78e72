"""`global_denominator` and `global_token_count`: a loss reduction's denominator D over all micro-batches
and data-parallel ranks, to pass as the losses' `denominator=` (compactionrl_fast/ops/_reduction.py)."""
from __future__ import annotations

import torch

from ._reduction import REDUCTIONS, unit_counts
from ._validate import check_choice, check_layout, check_tensor


def global_denominator(reduction, loss_mask, *, cu_seqlens=None, cu_segments=None, group=None,
                       as_tensor=False):
    """The denominator D of `reduction` summed over the ranks of `group` (all-reduce when
    torch.distributed is initialised): trainable tokens ("token-mean"), segments with a trainable token
    ("segment-mean") or rollouts with a trainable token ("rollout-mean") of this rank's full batch.

    Pass it as `denominator=` to the loss of every micro-batch on every rank: the summed gradients then
    equal those of the global batch. Returns a Python int (a host sync on CUDA), or with
    `as_tensor=True` an int64 [] tensor on the mask's device (no sync; the loss kernels read it there).
    """
    check_choice("reduction", reduction, REDUCTIONS[:3])
    check_tensor("loss_mask", loss_mask, dtypes=(torch.bool,), ndim=1)
    if loss_mask.device.type == "meta" and not as_tensor:
        raise ValueError("loss_mask is on the meta device, which holds no values: a Python int count needs real "
                         "data (pass as_tensor=True for a meta tensor)")
    cu_segments = check_layout(loss_mask, cu_seqlens, cu_segments)
    _, count = unit_counts(loss_mask, cu_seqlens, cu_segments, reduction)
    count = count.to(torch.int64).reshape(1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count, group=group)
    return count.reshape(()) if as_tensor else int(count.item())


def global_token_count(loss_mask, group=None, *, as_tensor=False):
    """Trainable tokens in `loss_mask` [T] bool, summed over the ranks of `group` (an all-reduce when
    torch.distributed is initialised). The `denominator` of "token-mean" for gradient accumulation.
    `as_tensor=True` returns an int64 [] tensor on the mask's device instead of an int (no host sync).

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> crf.global_token_count(torch.tensor([True, False, True]))
        2
    """
    return global_denominator("token-mean", loss_mask, group=group, as_tensor=as_tensor)


