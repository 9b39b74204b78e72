"""Padded [B, L] batches for the adapter tests: compacted rollouts from the packed shape table, and
the one-segment layouts of the peers."""
from __future__ import annotations

import torch

from tests.utils import make_mask


def padded_from_packed(b, *, extra=3, seed=0, shuffle=True):
    """One row per segment of a packed batch (tests.utils.packed_batch), left-aligned, `extra` columns of
    padding holding garbage (an adapter must not read it), rows shuffled.

    Returns (padded dict of [B, L] tensors: rewards, values, mask, plus rollout_ids [B], segment_index [B],
    and rows, cols [T]: where each packed token sits).
    """
    cu = b["cu_seqlens"].long().tolist()
    cs = b["cu_segments"].long().tolist()
    S = len(cu) - 1
    L = max([e - s for s, e in zip(cu[:-1], cu[1:])] + [0]) + extra
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(S, generator=g) if shuffle else torch.arange(S)  # segment s goes to row perm[s]
    out = {k: torch.randn(S, L, generator=g) * 100 for k in ("rewards", "values")}
    out["mask"] = torch.zeros(S, L, dtype=torch.bool)
    rows, cols = [], []
    for s in range(S):
        n = cu[s + 1] - cu[s]
        rows += [int(perm[s])] * n
        cols += list(range(n))
    rows, cols = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    for k, src in (("rewards", "rewards"), ("values", "values"), ("mask", "loss_mask")):
        out[k][rows, cols] = b[src]
    rollout_of_seg = [r for r in range(len(cs) - 1) for _ in range(cs[r], cs[r + 1])]
    seg_index = [s - cs[r] for s, r in zip(range(S), rollout_of_seg)]
    ids = torch.empty(S, dtype=torch.long)
    pos = torch.empty(S, dtype=torch.long)
    ids[perm] = torch.tensor(rollout_of_seg, dtype=torch.long) * 7 + 3  # arbitrary id values
    pos[perm] = torch.tensor(seg_index, dtype=torch.long)
    return out, ids, pos, rows, cols


def multiturn_rows(B, L, seed=0, lengths=None):
    """[B, L] rows of a single-segment batch: response tokens with observation holes (runs), right
    padding after each row's length; lengths include 0, 1 and L."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [0, 1, L] + [int(x) for x in torch.randint(2, L + 1, (max(B - 3, 0),), generator=g)]
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, n in enumerate(lengths[:B]):
        mask[i, :n] = make_mask(n, "rand", g)
        if n:
            mask[i, n - 1] = True  # a response ends on a generated token
    return mask


def prefix_rows(lengths, L):
    """[B, L] right-padded masks: row i has lengths[i] leading ones."""
    return torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
