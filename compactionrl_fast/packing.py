"""PackedBatch and pack(): rollouts -> the flat layout the ops and the trainer read (docs/layout.md).

Alignment: the log-prob of token t is predicted from position t-1 of the same attention sequence; a
trainable token is never the first token of an attention sequence (pack checks it).

Prefix sharing: an execution window and the summary written from it form one attention sequence (the
summary prompt extends the window). GAE segments stay separate: the exec segment covers the window's
tokens, the summary segment covers what follows (summary prompt + summary tokens), so every token lies in
exactly one GAE segment and each segment is a contiguous range inside its attention sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from .kernels.modes import REWARD_PLACEMENT
from .rollout.records import SEGMENT_KINDS, SUMMARY


@dataclass
class PackedBatch:
    """Flat tensors of R rollouts, S GAE segments, A attention sequences, T tokens.

    input_ids: int64 [T]; position_ids: int64 [T] (restart at 0 per attention sequence);
    cu_attn: int64 [A+1] attention-sequence offsets; cu_seqlens: int64 [S+1] GAE-segment offsets;
    cu_segments: int64 [R+1] segment offsets per rollout; segment_attn: int64 [S] attention sequence of
    each segment; loss_mask: bool [T] (True exactly on sampled tokens that are trained);
    rollout_logprobs: float32 [T] (sampler log-prob of token t, 0 where not trainable);
    rewards: float32 [T] (placed with place_final_rewards in `reward_mode`); segment_kind: int8 [S] (0 exec,
    1 summary);
    rollout_rewards: float32 [R]; per rollout: success, truncated, errored (bool [R]), compactions,
    num_turns (int64 [R]), and as lists: finish_reasons, errors, summary_lengths, infos.
    """
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_attn: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_segments: torch.Tensor
    segment_attn: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    segment_kind: torch.Tensor
    rollout_rewards: torch.Tensor
    success: torch.Tensor
    truncated: torch.Tensor
    errored: torch.Tensor
    compactions: torch.Tensor
    num_turns: torch.Tensor
    finish_reasons: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    summary_lengths: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    reward_mode: str = "paper"  # where `rewards` holds the final rewards: the trainer reuses them in that mode

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_trainable(self) -> int:
        return int(self.loss_mask.sum())

    def token_segment_kind(self) -> torch.Tensor:
        """int8 [T]: the kind of the GAE segment of each token (0 exec, 1 summary)."""
        return torch.repeat_interleave(self.segment_kind, self.cu_seqlens.diff(), output_size=self.num_tokens)

    def to(self, device) -> "PackedBatch":
        """A copy with every tensor on `device`."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


def pack(rollouts, *, prefix_sharing: bool = False, reward_mode: str = "paper", mask_truncated: bool = False,
         mask_errors: bool = True, train_summaries: bool = True, device="cpu") -> PackedBatch:
    """Pack Rollout records into a PackedBatch.

    Args:
        rollouts: list of Rollout (segments in chronological order).
        prefix_sharing: put each summary in the attention sequence of the window it was written from.
        reward_mode: "paper" (final reward on the last trainable token of every segment) or "stitched"
            (on the rollout's last trainable token only); see place_final_rewards.
        mask_truncated / mask_errors: take truncated / errored rollouts out of the loss (loss_mask False).
        train_summaries: False takes summary tokens out of the loss (the ablation of the method).

    Example:
        >>> from compactionrl_fast.envs import expert_rollouts
        >>> b = pack(expert_rollouts(2, drop_oldest_p=0.0), prefix_sharing=True)
        >>> b.cu_segments.tolist(), b.segment_kind.tolist()
        ([0, 5, 10], [0, 1, 0, 1, 0, 0, 1, 0, 1, 0])
    """
    from .ops import place_final_rewards

    if reward_mode not in REWARD_PLACEMENT:
        raise ValueError(f"reward_mode must be one of {tuple(REWARD_PLACEMENT)}, got {reward_mode!r}")
    if isinstance(rollouts, (str, bytes, dict)) or hasattr(rollouts, "segments") or not hasattr(rollouts, "__iter__"):
        raise TypeError(f"rollouts must be a list of Rollout records, got {type(rollouts).__name__}")
    rollouts = list(rollouts)
    for r_i, ro in enumerate(rollouts):
        if not all(hasattr(ro, a) for a in ("segments", "reward", "truncated", "error")):
            raise TypeError(f"rollouts[{r_i}] must be a Rollout record (as run_rollouts returns), "
                            f"got {type(ro).__name__}")
        for s_i, s in enumerate(ro.segments):
            if getattr(s, "kind", None) not in SEGMENT_KINDS:
                raise ValueError(f"rollouts[{r_i}].segments[{s_i}].kind must be one of {sorted(SEGMENT_KINDS)}, "
                                 f"got {getattr(s, 'kind', None)!r}")
    ids, mask, lps = [], [], []
    cu_attn, cu_seq, cu_seg, seg_attn, kinds = [0], [0], [0], [], []
    for r_i, ro in enumerate(rollouts):
        off = mask_truncated and ro.truncated or mask_errors and ro.error is not None
        prev = None
        for s in ro.segments:
            if len(s.loss_mask) != len(s.input_ids) or len(s.logprobs) != len(s.input_ids):
                raise ValueError(f"rollout {r_i}: a segment's input_ids, loss_mask and logprobs differ in length")
            share = prefix_sharing and s.kind == SUMMARY and s.shared_prefix > 0
            if share:
                if prev is None or prev.kind == SUMMARY or len(prev) != s.shared_prefix \
                        or prev.input_ids != s.input_ids[:s.shared_prefix]:
                    raise ValueError(f"rollout {r_i}: a summary's shared prefix is not the preceding exec window")
                start = s.shared_prefix
            else:
                start = 0
                if len(s) and s.loss_mask[0]:
                    raise ValueError(f"rollout {r_i}: a segment starts with a trainable token (nothing predicts it)")
                if len(s):
                    cu_attn.append(cu_attn[-1] + len(s))
            if share:
                cu_attn[-1] += len(s) - start
            n = len(s) - start
            ids.extend(s.input_ids[start:])
            m = [False] * n if off or (s.kind == SUMMARY and not train_summaries) else s.loss_mask[start:]
            mask.extend(m)
            lps.extend(s.logprobs[start:])
            cu_seq.append(cu_seq[-1] + n)
            seg_attn.append(len(cu_attn) - 2 if len(cu_attn) > 1 else 0)
            kinds.append(SEGMENT_KINDS[s.kind])
            prev = s
        cu_seg.append(len(kinds))
    T = len(ids)
    cu_attn_t = torch.tensor(cu_attn, dtype=torch.int64)
    starts = torch.repeat_interleave(cu_attn_t[:-1], cu_attn_t.diff(), output_size=T)
    loss_mask = torch.tensor(mask, dtype=torch.bool)
    cu_seqlens, cu_segments = torch.tensor(cu_seq, dtype=torch.int64), torch.tensor(cu_seg, dtype=torch.int64)
    rr = torch.tensor([ro.reward for ro in rollouts], dtype=torch.float32)
    batch = PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        position_ids=torch.arange(T, dtype=torch.int64) - starts,
        cu_attn=cu_attn_t, cu_seqlens=cu_seqlens, cu_segments=cu_segments,
        segment_attn=torch.tensor(seg_attn, dtype=torch.int64),
        loss_mask=loss_mask,
        rollout_logprobs=torch.where(loss_mask, torch.tensor(lps, dtype=torch.float32), 0.0),
        rewards=place_final_rewards(rr, loss_mask, cu_seqlens, cu_segments, mode=reward_mode),
        segment_kind=torch.tensor(kinds, dtype=torch.int8),
        rollout_rewards=rr,
        success=torch.tensor([ro.success for ro in rollouts], dtype=torch.bool),
        truncated=torch.tensor([ro.truncated for ro in rollouts], dtype=torch.bool),
        errored=torch.tensor([ro.error is not None for ro in rollouts], dtype=torch.bool),
        compactions=torch.tensor([ro.compactions for ro in rollouts], dtype=torch.int64),
        num_turns=torch.tensor([len(ro.turns) for ro in rollouts], dtype=torch.int64),
        finish_reasons=[ro.finish_reason for ro in rollouts],
        errors=[ro.error for ro in rollouts],
        summary_lengths=[ro.summary_lengths for ro in rollouts],
        infos=[dict(ro.info) for ro in rollouts],
        reward_mode=reward_mode,
    )
    return batch.to(device) if torch.device(device).type != "cpu" else batch
