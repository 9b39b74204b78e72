"""`compute_advantages(args, rollout_data)`: the paper's advantages and returns inside slime.

slime calls it from `compute_advantages_and_returns` (slime/backends/megatron_utils/loss.py) when
`--custom-advantage-function-path compactionrl_fast.integrations.slime.compute_advantages` is set, after it
has put the per-token KL in `rollout_data["kl"]`; it must fill `rollout_data["advantages"]` and `["returns"]`
(one tensor per sample). `--normalize-advantages` whitens them afterwards, as for slime's own estimators.

What it reads from `rollout_data` (the keys `_split_train_data_by_dp` keeps, after `process_rollout_data`):
per sample `loss_masks` [response_length] (0 on observation tokens), `rewards` (the rollout's reward, copied
on every segment), `rollout_ids` (shared by the segments of one rollout), `round_number` (the segment's
index in its rollout, 0-based: slime copies it from `Sample.metadata["round_number"]`), `partition` (the
sample's position in the whole batch), `response_lengths`, `total_lengths`, and `values` / `kl` (CP-local
slices when context parallelism is on). Why `round_number`: it is the only per-sample integer slime carries
from a Sample's metadata to the trainer, and it already means the round of a multi-turn session. A
different meaning cannot pass unnoticed: the indices of every rollout must be exactly 0..n-1, else a
ValueError.

Segments of one rollout may sit on different data-parallel ranks (slime packs micro-batches first-fit and
deals them to ranks): the ranks first exchange a few numbers per sample over the DP group, then, only for
the rollouts that are split, the samples' masks, values and KL. Under context parallelism each rank first
rebuilds whole responses with slime's `all_gather_with_cp` and slices its part back with
`slice_log_prob_with_cp`. Every rank raises the same error for bad input (errors are exchanged over the
DP x CP group before any other collective, then over the DP group before anything is computed), so a bad batch
never leaves one rank waiting in a collective.
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from ... import ops
from ...ops._reduction import segment_counts
from ...ops._validate import trusted_layout
from .._common import critic_returns
from ._options import advantage_options

_NEEDED = ("loss_masks", "response_lengths", "total_lengths", "rewards", "rollout_ids", "partition")


def _parallel():
    """(dp_group, dp_size, cp_size, dp_cp_group) from megatron-core's parallel state; (None, 1, 1, None) when it
    is not set up. dp_cp_group: the DP x CP group, every rank that takes part in this function's collectives."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return None, 1, 1, None
    if not ps.model_parallel_is_initialized():
        return None, 1, 1, None
    return (ps.get_data_parallel_group(with_context_parallel=False), ps.get_data_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_data_parallel_group(with_context_parallel=True))


def _all_gather(obj, group, size):
    if size == 1:
        return [obj]
    out = [None] * size
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def _cp_local_length(total_len, resp_len, cp_size):
    """How many response positions this CP rank holds (what slice_log_prob_with_cp keeps)."""
    if cp_size == 1:
        return resp_len
    from slime.backends.megatron_utils.cp_utils import get_logits_and_tokens_offset_with_cp
    _, _, (l0, l1), _ = get_logits_and_tokens_offset_with_cp(total_len, resp_len)
    return (l0[1] - l0[0]) + (l1[1] - l1[0])


class _Rows:
    """Samples as parallel lists: part (global position), rid, seg, reward, n (response length), mask [n] int/bool,
    values [n] and kl [n] (whole responses, or None)."""

    COLUMNS = ("part", "rid", "seg", "reward", "n", "mask", "values", "kl")

    def __init__(self):
        for k in self.COLUMNS:
            setattr(self, k, [])

    def __len__(self):
        return len(self.part)

    def select(self, keep):
        out, idx = _Rows(), [i for i in range(len(self)) if keep(i)]
        for k in self.COLUMNS:
            setattr(out, k, [getattr(self, k)[i] for i in idx])
        return out

    def extend(self, other):
        for k in self.COLUMNS:
            getattr(self, k).extend(getattr(other, k))

    def order(self):
        """Sample indices rollout by rollout (first appearance), segments by index; None when the samples are in
        that order already (then packing and unpacking keep list order)."""
        first = {r: k for k, r in enumerate(dict.fromkeys(self.rid))}
        seg = [s or 0 for s in self.seg] if None in self.seg else self.seg
        keys = list(zip(map(first.__getitem__, self.rid), seg))
        if all(map(operator.le, keys, keys[1:])):
            return None
        return sorted(range(len(self)), key=keys.__getitem__)


def _require_keys(rollout_data):
    missing = [k for k in _NEEDED if k not in rollout_data]
    if missing:
        raise ValueError(f"rollout_data has no {missing}: this slime lacks the hooks compute_advantages needs "
                         "(rollout_ids and partition kept by _split_train_data_by_dp, as in slime 0.3.1 at "
                         "624b824); call it through --custom-advantage-function-path")


def _numels(col):
    return None if col is None else list(map(torch.Tensor.numel, col))


def _columns(rollout_data, cp_size):
    """This rank's samples as _Rows filled column by column from slime's per-sample lists (python numbers,
    slime's own tensors: no per-sample tensor work; under CP, values and KL gathered over whole responses), and
    the first problem found (None)."""
    _require_keys(rollout_data)
    n = len(rollout_data["loss_masks"])
    segs, values, kl = rollout_data.get("round_number"), rollout_data.get("values"), rollout_data.get("kl")
    for key in _NEEDED + ("round_number", "values", "kl"):
        if rollout_data.get(key) is not None and len(rollout_data[key]) != n:
            return _Rows(), (f"rollout_data[{key!r}] has {len(rollout_data[key])} entries, loss_masks has {n}: "
                             "one entry per sample expected")
    rows = _Rows()
    rows.mask = list(rollout_data["loss_masks"])
    if not (set(map(type, rows.mask)) <= {torch.Tensor} and set(map(torch.Tensor.dim, rows.mask)) <= {1}):
        rows.mask = [torch.as_tensor(m).reshape(-1) for m in rows.mask]
    rows.part = list(map(int, rollout_data["partition"]))
    rows.rid = list(map(int, rollout_data["rollout_ids"]))
    rows.seg = [None] * n if segs is None else list(map(int, segs))
    rows.reward = list(map(float, rollout_data["rewards"]))
    rows.values = [None] * n if values is None else list(values)
    rows.kl = [None] * n if kl is None else list(kl)
    rows.n = list(map(torch.Tensor.numel, rows.mask))
    resp = list(map(int, rollout_data["response_lengths"]))
    total = None if cp_size == 1 else list(map(int, rollout_data["total_lengths"]))
    local = resp if cp_size == 1 else [_cp_local_length(t, r, cp_size) for t, r in zip(total, resp)]
    bad = []  # (sample, check order, name, entries, expected) of each column's first wrong length
    for c, (name, sizes, want) in enumerate((("loss_mask", rows.n, resp), ("values", _numels(values), local),
                                             ("kl", _numels(kl), local))):
        if sizes is not None and sizes != want:
            i = next(i for i, (a, b) in enumerate(zip(sizes, want)) if a != b)
            bad.append((i, c, name, sizes[i], want[i]))
    if bad:
        i, _, name, got, want = min(bad)
        where = f"sample {rows.part[i]} (rollout {rows.rid[i]})"
        if name == "loss_mask":
            return rows, f"{where}: loss_mask has {got} entries, response_length is {want}"
        return rows, (f"{where}: {name} has {got} entries, expected {want} (the response's "
                      f"{'CP-local part' if cp_size > 1 else 'length'})")
    return rows, None


def _gather_cp(rows, rollout_data):
    """values and KL of whole responses from the CP-local slices (slime's all_gather_with_cp, a CP collective)."""
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp
    total, resp = list(map(int, rollout_data["total_lengths"])), list(map(int, rollout_data["response_lengths"]))
    for k in ("values", "kl"):
        setattr(rows, k, [None if x is None else all_gather_with_cp(x.float(), t, r).detach()
                          for x, t, r in zip(getattr(rows, k), total, resp)])


def _check_rollouts(metas, untrainable):
    """Raise the batch's first problem (the same on every rank). metas: per rank (small fields, error)."""
    errors = [e for _, e in metas if e]
    if errors:
        raise ValueError(errors[0])
    by_rid = {}
    for rows, _ in metas:
        for part, rid, seg, reward, n in rows:
            by_rid.setdefault(rid, []).append((part, seg, reward, n))
    for rid, rs in sorted(by_rid.items()):
        segs = [s for _, s, _, _ in rs]
        if any(s is None for s in segs):
            if len(rs) > 1:
                raise ValueError(f"rollout {rid} has {len(rs)} samples but no segment index: set "
                                 "Sample.metadata['round_number'] = 0, 1, ... on each segment (the generate of "
                                 "compactionrl_fast.integrations.slime and samples_from_rollout do)")
            continue
        if sorted(segs) != list(range(len(rs))):
            raise ValueError(f"rollout {rid}: segment indices (metadata['round_number']) must be 0..{len(rs) - 1} "
                             f"exactly once each, got {sorted(segs)}: an index repeats or is missing (a segment "
                             "dropped, or round_number used for something else)")
        rewards = {r for _, _, r, _ in rs}
        if len(rewards) > 1:
            raise ValueError(f"rollout {rid}: its segments disagree on the reward ({sorted(rewards)}); every "
                             "segment must carry the rollout's one final reward")
        if untrainable == "error":
            for part, seg, _, n in rs:
                if n == 0:
                    raise ValueError(f"rollout {rid}, segment {seg} (sample {part}) has no trainable token "
                                     "(loss_mask all 0, e.g. remove_sample): its reward would reach no token. "
                                     "Set compaction_untrainable: allow to accept such samples (zero advantages)")


def _remote_rows(rows, metas, dp_rank, group, dp_size, device):
    """The samples of other ranks that belong to rollouts this rank holds (exchanged only for split rollouts):
    masks on the device of this rank's masks (slime moves loss_masks to the GPU), values and KL on `device`."""
    ranks_of = {}
    for r, (rs, _) in enumerate(metas):
        for _, rid, _, _, _ in rs:
            ranks_of.setdefault(rid, set()).add(r)
    split = {rid for rid, rk in ranks_of.items() if len(rk) > 1}
    if not split:
        return None
    mine = rows.select(lambda i: rows.rid[i] in split)
    for k in ("mask", "values", "kl"):
        setattr(mine, k, [None if x is None else x.detach().cpu() for x in getattr(mine, k)])
    held, remote = set(rows.rid), _Rows()
    for r, theirs in enumerate(_all_gather(mine, group, dp_size)):
        if r != dp_rank:
            remote.extend(theirs.select(lambda i: theirs.rid[i] in held))
    for k, to in (("mask", rows.mask[0].device if rows else device), ("values", device), ("kl", device)):
        setattr(remote, k, [None if x is None else x.to(to) for x in getattr(remote, k)])
    return remote


def _cat(parts, lengths, device, dtype):
    """parts [n_i] (or None: zeros) packed into [sum n_i] of `dtype` on `device`; None when every part is None."""
    kinds = set(map(type, parts))  # one C-level pass, not a generator per sample
    if kinds <= {type(None)}:
        return None
    if type(None) in kinds:
        parts = [torch.zeros(n, device=device) if p is None else p for p, n in zip(parts, lengths)]
    return torch.cat(parts).detach().to(device=device, dtype=dtype)


def _packed(rows, order, device):
    """(mask [T] bool, values [T] or None, kl [T] or None, lengths, cu_seqlens [S+1], cu_segments [R+1],
    rollout rewards [R]) of `rows` in `order` (None: list order)."""
    def take(col):
        return col if order is None else [col[i] for i in order]

    masks, rid, reward = take(rows.mask), take(rows.rid), take(rows.reward)
    lengths = take(rows.n)
    mask = torch.cat(masks).to(device).bool()
    values = _cat(take(rows.values), lengths, device, torch.float32)
    kl = _cat(take(rows.kl), lengths, device, torch.float32)
    starts = [0] + [k for k in range(1, len(rid)) if rid[k] != rid[k - 1]]
    cu_seqlens = torch.from_numpy(np.cumsum([0] + lengths, dtype=np.int64)).to(device)  # faster than torch.tensor
    cu_segments = torch.tensor(starts + [len(rid)], dtype=torch.int64, device=device)
    rr = torch.tensor(list(map(reward.__getitem__, starts)), dtype=torch.float32, device=device)
    return mask, values, kl, lengths, cu_seqlens, cu_segments, rr


def _plainly_valid(rows, order, counts, starts, untrainable):
    """True when the samples (packed in `order`, rollouts beginning at `starts`) pass _check_rollouts
    on one rank; False sends them to _check_rollouts for its error."""
    if untrainable == "error" and 0 in counts:
        return False
    seg = rows.seg if order is None else [rows.seg[i] for i in order]
    reward = rows.reward if order is None else [rows.reward[i] for i in order]
    for a, b in zip(starts, starts[1:]):
        if seg[a:b] != list(range(b - a)) or reward[a:b].count(reward[a]) != b - a:
            return False
    return True


def compute_advantages(args, rollout_data) -> None:
    """slime's --custom-advantage-function-path target: sets rollout_data["advantages"] and ["returns"].

    Per sample (segment): GAE over its trainable tokens, the rollout's reward once on each segment's last
    trainable token ("paper"; only the rollout's last with cross_segment "stitched"), the KL penalty
    `-kl_coef * kl` on every token as slime's ppo estimator adds it, the cross-segment factor
    `(gamma*lam)^(trainable tokens in later segments of the rollout)`, adaptive lambda over the rollout's
    trainable tokens: `crf.segment_gae` on the batch's segments packed rollout by rollout.
    Returns are the critic's targets: "local" (default; segment_gae's returns: with gamma = lam_critic = 1
    the rollout's reward minus the later KL, the Monte-Carlo return) or "corrected" (advantages + values).

    Args:
        args: slime's namespace (options: docs/slime.md).
        rollout_data: slime's per-rank batch, see the module docstring.
    """
    kw, extra = advantage_options(args)
    group, dp_size, cp_size, dp_cp_group = _parallel()
    dp_rank = torch.distributed.get_rank(group) if dp_size > 1 else 0
    if extra["kl_coef"] != 0 and rollout_data.get("kl") is None:
        raise ValueError("--kl-coef is set but rollout_data has no 'kl': compute_advantages must be called by "
                         "slime's compute_advantages_and_returns (--custom-advantage-function-path)")
    rows, error = _columns(rollout_data, cp_size)
    if cp_size > 1:  # a CP rank's own problem (its slices) must stop its CP peers before all_gather_with_cp
        error = next((e for e in _all_gather(error, dp_cp_group, torch.distributed.get_world_size(dp_cp_group))
                      if e), None)
        if error is not None:
            raise ValueError(error)
        _gather_cp(rows, rollout_data)
    device = next((x.device for x in rows.values + rows.kl if x is not None), torch.device("cpu"))
    order = rows.order()
    packed = _packed(rows, order, device) if rows and error is None else None
    counts = [0] * len(rows)
    if packed is not None:  # trainable tokens per sample (one read of the packed mask, no [T] temporary)
        packed_counts = segment_counts(packed[0], packed[4]).tolist()
        if order is None:
            counts = packed_counts
        for i, n in zip(order or (), packed_counts):
            counts[i] = n
    if dp_size > 1 or packed is None or not _plainly_valid(rows, order, counts, packed[5].tolist(),
                                                            extra["untrainable"]):
        meta = (list(zip(rows.part, rows.rid, rows.seg, rows.reward, counts)), error)
        metas = _all_gather(meta, group, dp_size)
        _check_rollouts(metas, extra["untrainable"])
    remote = _remote_rows(rows, metas, dp_rank, group, dp_size, device) if dp_size > 1 else None
    n_local = len(rows)
    if not n_local:
        rollout_data["advantages"], rollout_data["returns"] = [], []
        return
    if remote:  # a rollout shared with other ranks: pack this rank's rollouts again, whole
        rows.extend(remote)
        order = rows.order()
        packed = _packed(rows, order, device)
    mask, values, kl, lengths, cu_seqlens, cu_segments, rr = packed
    if values is None:
        values = torch.zeros(mask.numel(), device=device)
    with trusted_layout():  # offsets made by _packed from the masks' lengths: not read back per op
        token_rewards = ops.place_final_rewards(rr, mask, cu_seqlens, cu_segments, mode=extra["reward_mode"])
        if extra["kl_coef"] != 0 and kl is not None:
            token_rewards = token_rewards.sub_(kl, alpha=extra["kl_coef"])
        adv, ret = ops.segment_gae(token_rewards, values, mask, cu_seqlens, cu_segments, **kw)
    ret = critic_returns(adv, ret, values, mask, extra["critic_target"])

    adv, ret = adv.split(lengths), ret.split(lengths)
    if order is None and cp_size == 1:  # packed in list order, this rank's samples first
        rollout_data["advantages"], rollout_data["returns"] = list(adv[:n_local]), list(ret[:n_local])
        return
    advantages, returns = [None] * n_local, [None] * n_local
    for a, r, i in zip(adv, ret, range(len(rows)) if order is None else order):
        if i < n_local:
            advantages[i], returns[i] = _cp_slice(a, rollout_data, i, cp_size), _cp_slice(r, rollout_data, i, cp_size)
    rollout_data["advantages"], rollout_data["returns"] = advantages, returns


def _cp_slice(x, rollout_data, i, cp_size):
    if cp_size == 1:
        return x
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    return slice_log_prob_with_cp(x, int(rollout_data["total_lengths"][i]), int(rollout_data["response_lengths"][i]))
