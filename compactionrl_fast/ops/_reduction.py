"""How the loss ops reduce per-token losses: one weight per segment, shared by every backend.

Every reduction is a weighted sum of per-token losses over trainable tokens, loss = sum_t w_t * l_t,
with w_t constant inside a GAE segment, so one kernel pass serves them all:

    "token-mean"    w = 1 / D,            D = trainable tokens (of the batch)
    "segment-mean"  w = 1 / (n_s * D),    n_s = trainable tokens of the token's segment,
                                          D = segments with a trainable token
    "rollout-mean"  w = 1 / (n_r * D),    n_r = trainable tokens of the token's rollout,
                                          D = rollouts with a trainable token
    "sum"           w = 1

`denominator` replaces the local D. With D the global count over all micro-batches and data-parallel
ranks (`global_denominator`, `global_token_count`), summing the micro-batch losses and gradients gives
exactly the full-batch loss and gradient, provided no segment ("segment-mean") or rollout
("rollout-mean") is split across micro-batches. A zero D (nothing trainable anywhere) gives weight 0.

Everything here is tensor arithmetic on [S] or [R] (no host sync), so it traces under torch.compile.
"""
from __future__ import annotations

import torch

from . import _dispatch
from ._validate import check_choice, check_float, check_offsets, check_tensor

REDUCTIONS = ("token-mean", "segment-mean", "rollout-mean", "sum")


def check_layout(loss_mask, cu_seqlens, cu_segments):
    """Validate `cu_seqlens`/`cu_segments` against `loss_mask` [T]; returns cu_segments in cu_seqlens' dtype.

    The value checks read the offsets on the host; under torch.compile they are skipped (shape and dtype
    checks remain), so tracing does not break on a data-dependent branch.
    """
    T, device = loss_mask.numel(), loss_mask.device
    if cu_seqlens is None:
        if cu_segments is not None:
            raise ValueError("cu_segments needs cu_seqlens (the segments it groups)")
        return None
    tracing = torch.compiler.is_compiling()
    if tracing:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    else:
        check_offsets("cu_seqlens", cu_seqlens, total=T, device=device)
    if cu_segments is None:
        return None
    S = cu_seqlens.numel() - 1
    if tracing:
        check_tensor("cu_segments", cu_segments, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    else:
        check_offsets("cu_segments", cu_segments, total=S, device=device, total_name="S (number of segments)")
    return cu_segments.to(cu_seqlens.dtype)


def check_denominator(denominator, reduction):
    """A number >= 0 or a one-element tensor (which avoids a host sync and recompiles), or None."""
    if denominator is None:
        return None
    if reduction == "sum":
        raise ValueError("denominator has no meaning with reduction='sum' (the sum is not divided)")
    if isinstance(denominator, torch.Tensor):
        if denominator.numel() != 1:
            raise ValueError(f"denominator must be a number or a one-element tensor, got shape "
                             f"{tuple(denominator.shape)}")
        return denominator.reshape(())
    return check_float("denominator", denominator, 0.0, float("inf"))


@torch._dynamo.assume_constant_result
def _resolve(backend: str, device_type: str, supported: tuple) -> str:
    return _dispatch.resolve(backend, torch.device(device_type), supported)


def resolve_backend(backend, device, supported=_dispatch.BACKENDS):
    """`_dispatch.resolve`, seen by torch.compile as a constant (it imports modules and reads the
    environment, which dynamo will not trace)."""
    return _resolve(backend, device.type, tuple(supported))


_CPP_COUNTS = _dispatch.cpp_ext() is not None and hasattr(torch.ops.compactionrl_fast, "segment_counts")
if _CPP_COUNTS:
    @torch.library.register_fake("compactionrl_fast::segment_counts")
    def _segment_counts_fake(loss_mask, cu_seqlens):
        return cu_seqlens.new_empty(cu_seqlens.shape[0] - 1, dtype=torch.int64)


def segment_counts(loss_mask, cu_seqlens):
    """Trainable tokens of each segment: int64 [S]. C++ on CPU (no [T] temporary), torch elsewhere."""
    if loss_mask.device.type == "cpu" and _CPP_COUNTS:
        return torch.ops.compactionrl_fast.segment_counts(loss_mask, cu_seqlens)
    csum = torch.nn.functional.pad(torch.cumsum(loss_mask, 0), (1, 0))
    return csum[cu_seqlens.long()].diff()


def _unit_counts(loss_mask, cu_seqlens, cu_segments, reduction):
    """(n [S]: trainable tokens of each segment's averaging unit, D: units with a trainable token).

    The unit is the whole batch ("token-mean", and D counts tokens), the segment or the rollout.
    Without cu_seqlens the batch is one segment; without cu_segments each segment is its own rollout.
    """
    if cu_seqlens is None:
        n = torch.count_nonzero(loss_mask).reshape(1)  # mask.sum() would make an int64 [T] copy
        return n, (n if reduction == "token-mean" else (n > 0).long()).sum()
    n = segment_counts(loss_mask, cu_seqlens)
    if reduction == "token-mean":
        return n, n.sum()
    if reduction == "rollout-mean" and cu_segments is not None:
        S, R = n.numel(), cu_segments.numel() - 1
        roll = torch.repeat_interleave(torch.arange(R, device=n.device), cu_segments.diff().long(), output_size=S)
        n_r = torch.zeros(R, dtype=n.dtype, device=n.device).index_add_(0, roll, n)
        return n_r[roll], (n_r > 0).sum()
    return n, (n > 0).sum()


def _inverse(x):
    """1/x where x > 0, else 0, in float64."""
    x = x.double()
    return torch.where(x > 0, 1.0 / torch.where(x > 0, x, 1.0), 0.0)


def segment_weights(loss_mask, cu_seqlens, cu_segments, reduction, denominator=None):
    """Reduction weight of each segment's tokens: float64 [S] ([1] when cu_seqlens is None)."""
    device = loss_mask.device
    if reduction == "sum":
        S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
        return torch.ones(S, dtype=torch.float64, device=device)
    n, d = _unit_counts(loss_mask, cu_seqlens, cu_segments, reduction)
    if denominator is not None:
        d = torch.as_tensor(denominator, device=device)
    if reduction == "token-mean":
        return _inverse(d).expand(n.numel()).contiguous()
    return _inverse(n) * _inverse(d)


def global_denominator(reduction, loss_mask, *, cu_seqlens=None, cu_segments=None, group=None) -> int:
    """The denominator D of `reduction` summed over the ranks of `group` (all-reduce when
    torch.distributed is initialised): trainable tokens ("token-mean"), segments with a trainable token
    ("segment-mean") or rollouts with a trainable token ("rollout-mean") of this rank's full batch.

    Pass it as `denominator=` to the loss of every micro-batch on every rank: the summed gradients then
    equal those of the global batch.
    """
    check_choice("reduction", reduction, REDUCTIONS[:3])
    check_tensor("loss_mask", loss_mask, dtypes=(torch.bool,), ndim=1)
    cu_segments = check_layout(loss_mask, cu_seqlens, cu_segments)
    _, count = _unit_counts(loss_mask, cu_seqlens, cu_segments, reduction)
    count = count.to(torch.int64).reshape(1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count, group=group)
    return int(count.item())


def global_token_count(loss_mask, group=None) -> int:
    """Trainable tokens in `loss_mask` [T] bool, summed over the ranks of `group` (an all-reduce when
    torch.distributed is initialised). The `denominator` of "token-mean" for gradient accumulation.

    Example:
        >>> import torch, compactionrl_fast as crf
        >>> crf.global_token_count(torch.tensor([True, False, True]))
        2
    """
    return global_denominator("token-mean", loss_mask, group=group)


def register_loss_op(name: str, fake, n_inputs: int) -> None:
    """Fake impl and autograd of a loss op `name` returning (loss [], metrics [k], grad [T] or [0]), where the
    kernel already wrote d loss / d input-0 into `grad` (the other `n_inputs - 1` inputs get no gradient)."""
    none = (None,) * (n_inputs - 1)

    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # no zero [T] gradient for the unused `grad` output
        ctx.save_for_backward(output[2])

    def backward(ctx, d_loss, d_metrics, d_grad):
        # In place: the saved buffer becomes the input's gradient, so fwd+bwd allocate one [T] buffer in all.
        # A second backward through the same graph (retain_graph=True) then fails loudly on the saved
        # tensor's version counter instead of computing a wrong gradient.
        (grad,) = ctx.saved_tensors
        if not torch.compiler.is_compiling() and d_loss.device.type == "cpu" and d_loss.item() == 1.0:
            return (grad,) + none  # loss.backward(): skip a pass over [T] (no sync on CPU)
        return (grad.mul_(d_loss),) + none

    torch.library.register_fake(name, fake)
    torch.library.register_autograd(name, backward, setup_context=setup_context)
