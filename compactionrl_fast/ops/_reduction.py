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
A negative or NaN tensor denominator is an error where its value can be read without a sync (CPU), and
makes the loss NaN elsewhere (never a silent 0).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _dispatch
from ._validate import check_choice, check_float, check_offsets, check_tensor, value_checks

REDUCTIONS = ("token-mean", "segment-mean", "rollout-mean", "sum")


def check_layout(loss_mask, cu_seqlens, cu_segments):
    """Validate `cu_seqlens`/`cu_segments` against `loss_mask` [T]; returns cu_segments in cu_seqlens' dtype.

    Dtype, shape and device are always checked; the offsets' values only where `value_checks` allows
    (CPU by default: no host sync on CUDA, no data-dependent branch under torch.compile). The kernels
    clamp offsets, so unchecked bad offsets give wrong numbers, never an out-of-bounds access.
    """
    T, device = loss_mask.numel(), loss_mask.device
    if cu_seqlens is None:
        if cu_segments is not None:
            raise ValueError("cu_segments needs cu_seqlens (the segments it groups)")
        return None
    # the type first: a list (or anything else) is a TypeError that names the argument
    check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    if cu_segments is not None:
        check_tensor("cu_segments", cu_segments, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    read = value_checks(cu_seqlens)
    if read:
        check_offsets("cu_seqlens", cu_seqlens, total=T, device=device)
    elif cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must have at least one element (offsets [S+1])")
    if cu_segments is None:
        return None
    S = cu_seqlens.numel() - 1
    check_tensor("cu_segments", cu_segments, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    if read:
        check_offsets("cu_segments", cu_segments, total=S, device=device, total_name="S (number of segments)")
    elif cu_segments.numel() < 1:
        raise ValueError("cu_segments must have at least one element (offsets [R+1])")
    return cu_segments.to(cu_seqlens.dtype)


def check_denominator(denominator, reduction, device=None):
    """A number >= 0 (a Python float: no host-device copy), a one-element tensor on the data's device
    (read by the kernels: no sync, no recompiles), or None."""
    if denominator is None:
        return None
    if reduction == "sum":
        raise ValueError("denominator has no meaning with reduction='sum' (the sum is not divided)")
    if isinstance(denominator, torch.Tensor):
        if denominator.numel() != 1:
            raise ValueError(f"denominator must be a number or a one-element tensor, got shape "
                             f"{tuple(denominator.shape)}")
        if device is not None and denominator.device != device:
            raise ValueError(f"denominator is on {denominator.device}, expected {device} (the loss_mask's device)")
        if denominator.dtype == torch.bool or denominator.is_complex():
            raise TypeError(f"denominator must be a real number tensor, got {denominator.dtype}")
        if value_checks(denominator):
            d = float(denominator.detach().reshape(()))
            if not d >= 0.0 or d == float("inf"):
                raise ValueError(f"denominator must be a finite number >= 0, got {d}")
        return denominator.reshape(())
    return check_float("denominator", denominator, 0.0, float("inf"))


@torch._dynamo.assume_constant_result
def _resolve(backend: str, device_type: str, supported: tuple, op) -> str:
    return _dispatch.resolve(backend, torch.device(device_type), supported, op)


def resolve_backend(backend, device, supported=_dispatch.BACKENDS, op=None):
    """`_dispatch.resolve`, seen by torch.compile as a constant (it imports modules and reads the
    environment, which dynamo will not trace)."""
    return _resolve(backend, device.type, tuple(supported), op)


_CPP_COUNTS = _dispatch.cpp_ext() is not None and hasattr(torch.ops.compactionrl_fast, "segment_counts")
if _CPP_COUNTS:
    @torch.library.register_fake("compactionrl_fast::segment_counts")
    def _segment_counts_fake(loss_mask, cu_seqlens):
        return cu_seqlens.new_empty(cu_seqlens.shape[0] - 1, dtype=torch.int64)


def segment_counts(loss_mask, cu_seqlens):
    """Trainable tokens of each segment: int64 [S]. C++ on CPU, a Triton kernel on CUDA (no [T]
    temporary either way), torch elsewhere."""
    if loss_mask.device.type == "cpu" and _CPP_COUNTS:
        return torch.ops.compactionrl_fast.segment_counts(loss_mask, cu_seqlens)
    if loss_mask.device.type == "cuda" and _dispatch.has_triton():
        return torch.ops.compactionrl_fast.segment_counts_triton(loss_mask, cu_seqlens)
    csum = torch.nn.functional.pad(torch.cumsum(loss_mask, 0), (1, 0))
    return csum[cu_seqlens.long().clamp(0, loss_mask.numel())].diff()


@torch.library.custom_op("compactionrl_fast::segment_counts_triton", mutates_args=())
def _segment_counts_triton(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    from ..kernels.segments import segment_counts as launch

    return launch(loss_mask, cu_seqlens)


@_segment_counts_triton.register_fake
def _(loss_mask, cu_seqlens):
    return cu_seqlens.new_empty(cu_seqlens.shape[0] - 1, dtype=torch.int64)


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
        roll = torch.repeat_interleave(torch.arange(R, device=n.device), cu_segments.diff().long().clamp(min=0),
                                       output_size=S)
        n_r = torch.zeros(R, dtype=n.dtype, device=n.device).index_add_(0, roll, n)
        return n_r.index_select(0, roll), (n_r > 0).sum()
    return n, (n > 0).sum()


def _inverse(x):
    """1/x for counts x >= 0, with 1/0 = 0, in float64."""
    return x.double().reciprocal().nan_to_num_(posinf=0.0)


def _inverse_denominator(d):
    """1/d for a user's denominator: 0 for d = 0, NaN for d < 0 or NaN (the loss shows it), float64."""
    if isinstance(d, float):
        return 0.0 if d == 0.0 else 1.0 / d
    d = d.double()
    return torch.where(d > 0, d.reciprocal(), torch.where(d == 0, 0.0, float("nan")))


_CODES = {"token-mean": 0, "segment-mean": 1, "rollout-mean": 2, "sum": 3}
_CPP_WEIGHTS = _dispatch.cpp_ext() is not None and hasattr(torch.ops.compactionrl_fast, "segment_weights")


def _segment_weights_fake(loss_mask, cu_seqlens, cu_segments, reduction, den, den_t):
    S = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return loss_mask.new_empty(S, dtype=torch.float64)


if _CPP_WEIGHTS:
    torch.library.register_fake("compactionrl_fast::segment_weights", _segment_weights_fake)


@torch.library.custom_op("compactionrl_fast::segment_weights_triton", mutates_args=())
def _segment_weights_triton(loss_mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                            cu_segments: Optional[torch.Tensor], reduction: int, den: float,
                            den_t: Optional[torch.Tensor]) -> torch.Tensor:
    from ..kernels.segments import segment_counts as launch_counts
    from ..kernels.segments import segment_weights as launch

    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    given = den_t is not None or den >= 0
    if reduction == 3 or (reduction == 0 and given):  # the weights need no counts: one launch
        counts = torch.empty(S, dtype=torch.int64, device=loss_mask.device)
    elif cu_seqlens is None:
        counts = torch.count_nonzero(loss_mask).reshape(1)
    else:
        counts = launch_counts(loss_mask, cu_seqlens)
    return launch(counts, cu_segments, reduction, den_t if den_t is not None else (den if given else None))


torch.library.register_fake("compactionrl_fast::segment_weights_triton", _segment_weights_fake)


def segment_weights(loss_mask, cu_seqlens, cu_segments, reduction, denominator=None, backend=None):
    """Reduction weight of each segment's tokens: float64 [S] ([1] when cu_seqlens is None).

    One op call: the Triton kernels for backend "triton" and on CUDA (counts, then one program for D
    and the weights), C++ on CPU; the torch formulation below where neither is there. A negative or
    NaN tensor denominator gives NaN weights."""
    device = loss_mask.device
    den = -1.0 if denominator is None or isinstance(denominator, torch.Tensor) else float(denominator)
    den_t = denominator if isinstance(denominator, torch.Tensor) else None
    if device.type == "cpu" and _CPP_WEIGHTS and backend != "triton":
        return torch.ops.compactionrl_fast.segment_weights(loss_mask, cu_seqlens, cu_segments, _CODES[reduction], den,
                                                           den_t)
    if (device.type == "cuda" or backend == "triton") and _dispatch.has_triton():
        return torch.ops.compactionrl_fast.segment_weights_triton(loss_mask, cu_seqlens, cu_segments,
                                                                  _CODES[reduction], den, den_t)
    return segment_weights_torch(loss_mask, cu_seqlens, cu_segments, reduction, denominator)


def segment_weights_torch(loss_mask, cu_seqlens, cu_segments, reduction, denominator=None):
    """`segment_weights` in torch ops on [S] (the formulation the kernels port; no host sync)."""
    device = loss_mask.device
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if reduction == "sum":
        return torch.ones(S, dtype=torch.float64, device=device)
    if reduction == "token-mean" and denominator is not None:  # no counts needed
        inv = _inverse_denominator(denominator)
        if isinstance(inv, float):
            return torch.full((S,), inv, dtype=torch.float64, device=device)
        return inv.reshape(1).repeat(S)
    n, d = _unit_counts(loss_mask, cu_seqlens, cu_segments, reduction)
    inv_d = _inverse(d) if denominator is None else _inverse_denominator(denominator)
    if reduction == "token-mean":
        return inv_d.reshape(1).repeat(S)
    return _inverse(n) * inv_d


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
    _, count = _unit_counts(loss_mask, cu_seqlens, cu_segments, reduction)
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


def loss_backward(name: str, n_inputs: int):
    """The backward of a loss op `name` (see `register_loss_op`): d input-0 = saved grad * d_loss."""
    none = (None,) * (n_inputs - 1)

    def backward(ctx, d_loss, d_metrics, d_grad):
        # The saved buffer becomes the input's gradient (fwd+bwd allocate one [T] buffer in all). It is
        # handed out once: a second backward through the same graph (retain_graph=True) would have to
        # scale the buffer the first one returned, so it is refused instead.
        if getattr(ctx, "grad_handed_out", False):
            raise RuntimeError(f"{name}: a second backward through the same loss is not supported (the first "
                               "backward handed out its gradient buffer); compute the loss again, or use "
                               "backend='torch'")
        ctx.grad_handed_out = True
        (grad,) = ctx.saved_tensors
        if type(d_loss) is torch.Tensor and d_loss.device.type == "cpu" and not torch.compiler.is_compiling() \
                and d_loss.item() == 1.0:
            return (grad,) + none  # loss.backward() in eager mode on CPU: skip a pass over [T] (no sync there)
        return (grad.mul_(d_loss),) + none

    return backward


def register_loss_op(name: str, fake, n_inputs: int) -> None:
    """Fake impl and autograd of a loss op `name` returning (loss [], metrics [k], grad [T] or [0]), where the
    kernel already wrote d loss / d input-0 into `grad` (the other `n_inputs - 1` inputs get no gradient)."""

    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # no zero [T] gradient for the unused `grad` output
        ctx.save_for_backward(output[2])

    torch.library.register_fake(name, fake)
    torch.library.register_autograd(name, loss_backward(name, n_inputs), setup_context=setup_context)
