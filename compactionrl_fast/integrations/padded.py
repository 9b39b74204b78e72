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

The adapters themselves do not pack: the ops read the padded batch flattened to `[B*L]` (no copy), each
row a segment, and a `RowTable` (built on the host in O(B) from the rollout ids, cached per batch) tells
`segment_gae` where each rollout's rows sit (`seg_start`). Outputs are written straight into `[B, L]`.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from ..ops._mask import bool_mask_and_count
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


def _check_positions(rank_of_row, pos):
    """segment_index must number each rollout's rows 0, 1, ..., n-1 (in any row order)."""
    seen = {}
    for r, p in zip(rank_of_row, pos):
        seen.setdefault(r, set())
        if p in seen[r]:
            raise ValueError(f"segment_index has a repeated position {p} inside one rollout")
        seen[r].add(p)
    for r, ps in seen.items():
        if ps != set(range(len(ps))):
            raise ValueError(f"segment_index must number the rows of each rollout 0..n-1, got {sorted(ps)} "
                             "for one rollout")


def _row_order(B, rollout_ids, segment_index):
    """(rows in packed order, rollout rank of each row, number of rollouts): rollouts by first appearance,
    rows of a rollout by `segment_index` (else batch order). Validates both arguments."""
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
        _check_positions(rank_of_row, pos)
    return sorted(range(B), key=lambda b: (rank_of_row[b], pos[b])), rank_of_row, len(rank)


def as_bool_mask(name, mask, ndim=2):
    """A 0/1 mask of any dtype (verl and OpenRLHF keep int or float masks) as bool."""
    return bool_mask_and_count(name, mask, ndim)[0]


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

    order, rank_of_row, n_rollouts = _row_order(B, rollout_ids, segment_index)

    order_t = torch.tensor(order, dtype=torch.int64, device=device)
    kept = keep.index_select(0, order_t)  # [B, L] rows in packed order
    rows, cols = kept.nonzero(as_tuple=True)  # row-major: packed order
    index = order_t[rows] * L + cols
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    cu_seqlens = torch.cat([zero, kept.sum(1).cumsum(0)])
    per_rollout = torch.bincount(torch.tensor(rank_of_row, dtype=torch.int64), minlength=n_rollouts)
    cu_segments = torch.cat([zero, per_rollout.to(device).cumsum(0)])
    return PackedLayout(index=index, loss_mask=mask.reshape(-1).index_select(0, index),
                        cu_seqlens=cu_seqlens.to(index_dtype), cu_segments=cu_segments.to(index_dtype),
                        order=order_t, shape=(B, L))


@dataclass(frozen=True)
class RowTable:
    """Rows of a padded `[B, L]` batch as segments of the flattened `[B*L]` tensors (no token moves).

    Attributes:
        cu_seqlens: [B+1] int64, L * arange(B+1): segment i is L tokens (row `order[i]`).
        cu_segments: [R+1] int64 segment offsets of the R rollouts (segments in chronological order).
        seg_start: [B] int64 flat start of each segment's row, `L * order`; None when `order` is 0..B-1.
        rows: [B+1] int64, L * arange(B+1): one segment per row in memory order (for the losses).
        order: the rows in segment order (a tuple of ints).
    """

    cu_seqlens: torch.Tensor
    cu_segments: torch.Tensor
    seg_start: torch.Tensor | None
    rows: torch.Tensor
    order: tuple


_TABLES: collections.OrderedDict = collections.OrderedDict()  # a few recent batches: GAE, losses reuse them
_TABLES_MAX = 8


def _key(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return ("t", x.device.type, tuple(x.tolist()) if x.dim() == 1 else id(x))
    if hasattr(x, "tolist"):
        x = x.tolist()
    try:
        return tuple(x)
    except TypeError:
        return ("id", id(x))


def row_table(B, L, rollout_ids=None, segment_index=None, device="cpu") -> RowTable:
    """The `RowTable` of a padded batch (see `packed_layout` for `rollout_ids` / `segment_index`). Built
    in O(B) on the host, validated there, and cached for the next calls with the same batch layout."""
    key = (B, L, str(device), _key(rollout_ids), _key(segment_index))
    try:
        hit = _TABLES.get(key)
    except TypeError:  # unhashable ids: build without the cache
        key, hit = None, None
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    order, rank_of_row, n_rollouts = _row_order(B, rollout_ids, segment_index)
    order = tuple(order)
    per_rollout = [0] * n_rollouts
    for r in rank_of_row:
        per_rollout[r] += 1
    cu_segments = [0]
    for n in per_rollout:
        cu_segments.append(cu_segments[-1] + n)
    rows = torch.arange(0, (B + 1) * L, L, dtype=torch.int64) if L else torch.zeros(B + 1, dtype=torch.int64)
    identity = order == tuple(range(B))
    table = RowTable(cu_seqlens=rows.to(device), cu_segments=torch.tensor(cu_segments, dtype=torch.int64).to(device),
                     seg_start=None if identity else (torch.tensor(order, dtype=torch.int64) * L).to(device),
                     rows=rows.to(device), order=order)
    if key is not None:
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    return table


def flat(name, x, B, L):
    """A `[B, L]` tensor as `[B*L]` (a view when contiguous), with a clear error for another shape."""
    check_tensor(name, x)
    if tuple(x.shape) != (B, L):
        raise ValueError(f"{name} must have shape [B, L] = [{B}, {L}] (as response_mask), got {tuple(x.shape)}")
    return x.reshape(B * L)


def segment_gae_padded(token_rewards, values, response_mask, rollout_ids=None, *, segment_index=None,
                       **gae_kwargs):
    """`compactionrl_fast.segment_gae` on a padded batch: (advantages [B, L], returns [B, L]) float32.

    Args:
        token_rewards, values: [B, L] float, read at trainable positions only.
        response_mask, rollout_ids, segment_index: as in `packed_layout`.
        gae_kwargs: keyword arguments of `segment_gae` (gamma, lam, cross_segment, lam_critic, ...).
    Positions that are not trainable get 0. The rows are read in place (each row one segment, placed by
    `row_table`), so no token is packed or unpacked; the numbers are those of the op on the packed batch.
    """
    from ..ops import segment_gae
    from ..ops._validate import trusted_layout

    mask = as_bool_mask("response_mask", response_mask)
    B, L = mask.shape
    table = row_table(B, L, rollout_ids, segment_index, mask.device)
    with trusted_layout():
        adv, ret = segment_gae(flat("token_rewards", token_rewards, B, L), flat("values", values, B, L),
                               mask.reshape(B * L), table.cu_seqlens, table.cu_segments, seg_start=table.seg_start,
                               **gae_kwargs)
    return adv.view(B, L), ret.view(B, L)
