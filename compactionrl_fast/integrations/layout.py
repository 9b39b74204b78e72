"""Padded `[B, L]` batches (verl, OpenRLHF, TRL) to the packed layout of the ops, and back.

Trainers keep one response per row, right-padded to `L`, with a response mask that is 1 on
policy-generated tokens (0 on prompts, tool observations and padding). With context compaction one
rollout spans several rows, one per segment (execution windows and summaries). `packed_layout` maps
such a batch to the packed layout (docs/layout.md): the rows of one rollout become consecutive
segments in chronological order, and only the kept tokens (by default the trainable ones) are packed.
`PackedLayout.pack` gathers `[B, L, ...] -> [T, ...]`, `PackedLayout.unpack` scatters back; both are
differentiable, so per-token log-probs with gradients can go through them.

Packing only trainable tokens loses nothing for the ops of this package: GAE skips observation tokens
(they are not steps) and the losses ignore them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops._validate import INDEX_DTYPES, check_tensor


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed token comes from in a padded `[B, L]` batch.

    Attributes:
        index: [T] int64 flat positions `b * L + t` of the packed tokens, in packed order.
        loss_mask: [T] bool, the response mask at those positions.
        cu_seqlens: [B+1] token offsets; segment i is row `order[i]`.
        cu_segments: [R+1] segment offsets of the R rollouts.
        order: [B] int64 rows in packed order (rollouts by first appearance, segments chronological).
        shape: (B, L).
    """

    index: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_segments: torch.Tensor
    order: torch.Tensor
    shape: tuple

    @property
    def num_tokens(self) -> int:
        return self.index.numel()

    def pack(self, x: torch.Tensor, name: str = "x") -> torch.Tensor:
        """[B, L, ...] -> [T, ...] (a gather; gradients flow back to `x`)."""
        B, L = self.shape
        check_tensor(name, x, device=self.index.device)
        if tuple(x.shape[:2]) != (B, L):
            raise ValueError(f"{name} must have shape [B, L, ...] = [{B}, {L}, ...], got {tuple(x.shape)}")
        return x.reshape(B * L, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, y: torch.Tensor, fill=0.0, name: str = "y") -> torch.Tensor:
        """[T, ...] -> [B, L, ...] with `fill` at positions that were not packed (differentiable in `y`)."""
        B, L = self.shape
        check_tensor(name, y, device=self.index.device)
        if y.shape[0] != self.num_tokens:
            raise ValueError(f"{name} must have {self.num_tokens} packed tokens in dim 0, got {tuple(y.shape)}")
        out = y.new_full((B * L, *y.shape[1:]), fill)
        return out.index_copy(0, self.index, y).view(B, L, *y.shape[1:])


def _as_list(name, x, B):
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D [B], got shape {tuple(x.shape)}")
        x = x.tolist()
    elif hasattr(x, "tolist"):  # numpy arrays, e.g. verl's non_tensor_batch["uid"] (dtype object)
        x = x.tolist()
    else:
        x = list(x)
    if len(x) != B:
        raise ValueError(f"{name} must have one entry per row (B={B}), got {len(x)}")
    return x


def as_bool_mask(name, mask, ndim=2):
    """A 0/1 mask of any dtype (verl and OpenRLHF keep int or float masks) as bool."""
    check_tensor(name, mask, ndim=ndim)
    if mask.dtype == torch.bool:
        return mask
    if mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1")
    return mask != 0


def packed_layout(response_mask, rollout_ids=None, *, segment_index=None, keep=None,
                  index_dtype=torch.int64) -> PackedLayout:
    """Layout of a padded batch in which rows sharing a rollout id are segments of one rollout.

    Args:
        response_mask: [B, L] bool or 0/1 of any dtype, 1 on trainable (policy-generated) tokens.
        rollout_ids: [B] ids (tensor, numpy array or list of hashables, e.g. verl's uid strings); rows
            with equal ids are segments of one rollout. None: every row is its own rollout.
        segment_index: [B] ints, the chronological position of each row inside its rollout. None: the
            rows of a rollout are in chronological order in the batch (they need not be adjacent).
        keep: [B, L] bool, the tokens to pack (must include every trainable token). None: only the
            trainable tokens.
        index_dtype: torch.int32 or torch.int64 for cu_seqlens / cu_segments.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
        >>> lay = packed_layout(mask, rollout_ids=["a", "b", "a"])   # rows 0 and 2: one rollout
        >>> lay.cu_seqlens.tolist(), lay.cu_segments.tolist(), lay.order.tolist()
        ([0, 2, 5, 6], [0, 2, 3], [0, 2, 1])
    """
    mask = as_bool_mask("response_mask", response_mask)
    B, L = mask.shape
    device = mask.device
    if index_dtype not in INDEX_DTYPES:
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    if keep is None:
        keep = mask
    else:
        check_tensor("keep", keep, dtypes=(torch.bool,), ndim=2, device=device)
        if tuple(keep.shape) != (B, L):
            raise ValueError(f"keep must have the shape of response_mask {(B, L)}, got {tuple(keep.shape)}")
        if bool((mask & ~keep).any()):
            raise ValueError("keep must include every trainable token (response_mask is 1 where keep is 0)")

    ids = list(range(B)) if rollout_ids is None else _as_list("rollout_ids", rollout_ids, B)
    rank = {}
    for i in ids:  # rollouts numbered by first appearance
        rank.setdefault(i, len(rank))
    rank_of_row = [rank[i] for i in ids]
    if segment_index is None:
        pos = list(range(B))
    else:
        pos = _as_list("segment_index", segment_index, B)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in pos):
            raise TypeError("segment_index must hold integers")
        if len(set(zip(rank_of_row, pos))) != B:
            raise ValueError("segment_index has a repeated position inside one rollout")
    order = sorted(range(B), key=lambda b: (rank_of_row[b], pos[b]))

    order_t = torch.tensor(order, dtype=torch.int64, device=device)
    kept = keep.index_select(0, order_t)  # [B, L] rows in packed order
    rows, cols = kept.nonzero(as_tuple=True)  # row-major: packed order
    index = order_t[rows] * L + cols
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    cu_seqlens = torch.cat([zero, kept.sum(1).cumsum(0)])
    per_rollout = torch.bincount(torch.tensor(rank_of_row, dtype=torch.int64), minlength=len(rank))
    cu_segments = torch.cat([zero, per_rollout.to(device).cumsum(0)])
    return PackedLayout(index=index, loss_mask=mask.reshape(-1).index_select(0, index),
                        cu_seqlens=cu_seqlens.to(index_dtype), cu_segments=cu_segments.to(index_dtype),
                        order=order_t, shape=(B, L))


def segment_gae_padded(token_rewards, values, response_mask, rollout_ids=None, *, segment_index=None,
                       **gae_kwargs):
    """`compactionrl_fast.segment_gae` on a padded batch: (advantages [B, L], returns [B, L]) float32.

    Args:
        token_rewards, values: [B, L] float, read at trainable positions only.
        response_mask, rollout_ids, segment_index: as in `packed_layout`.
        gae_kwargs: keyword arguments of `segment_gae` (gamma, lam, cross_segment, lam_critic, ...).
    Positions that are not trainable get 0.
    """
    from ..ops import segment_gae

    lay = packed_layout(response_mask, rollout_ids, segment_index=segment_index)
    adv, ret = segment_gae(lay.pack(token_rewards, "token_rewards"), lay.pack(values, "values"), lay.loss_mask,
                           lay.cu_seqlens, lay.cu_segments, **gae_kwargs)
    return lay.unpack(adv), lay.unpack(ret)
