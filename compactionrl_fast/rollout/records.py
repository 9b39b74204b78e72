"""Records of the compaction loop: a Rollout is its Segments in chronological order.

Token ids are the ones the model saw and sampled, never re-tokenised. Every list of a segment has one
entry per token of its attention sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EXEC, SUMMARY = "exec", "summary"
SEGMENT_KINDS = {EXEC: 0, SUMMARY: 1}
TRUNCATED_REASONS = ("max_turns", "context_full")


@dataclass
class Segment:
    """One trainable segment: an execution window or a summary generation.

    input_ids: [L] every token of the sequence the segment was sampled in (its prompt included).
    loss_mask: [L] True exactly on tokens the policy sampled in this segment.
    logprobs: [L] the sampler's log-prob of each sampled token, 0.0 elsewhere.
    shared_prefix: for a summary, how many leading tokens equal the preceding execution segment's
        input_ids (the window the summary was written from); 0 for execution segments.
    reward: the rollout's final reward (every segment carries it; set when the rollout ends).
    """
    kind: str
    input_ids: list
    loss_mask: list
    logprobs: list
    shared_prefix: int = 0
    reward: float = 0.0

    def __len__(self):
        return len(self.input_ids)

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Turn:
    """One atomic turn (a_i, o_i), as text for inspection; the tokens live in the segments."""
    action: str
    observation: str
    response_tokens: int
    observation_tokens: int
    window: int  # index of the execution window (0-based) the turn was played in
    observation_truncated: bool = False


@dataclass
class Rollout:
    """One episode. finish_reason: "done" (the environment ended it), "max_turns", "context_full"
    (budget exhausted after max_compactions) or "error" (the environment raised; see `error`)."""
    segments: list = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = "done"
    turns: list = field(default_factory=list)
    compactions: int = 0
    summaries: list = field(default_factory=list)  # decoded summary texts, in order
    error: str | None = None
    info: dict = field(default_factory=dict)  # merged info dicts returned by the environment
    seed: int | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason in TRUNCATED_REASONS

    @property
    def success(self) -> bool:
        """info["success"] when the environment reports it, else reward > 0."""
        return bool(self.info.get("success", self.reward > 0))

    @property
    def summary_lengths(self) -> list:
        return [s.num_trainable for s in self.segments if s.kind == SUMMARY]

    @property
    def num_trainable(self) -> int:
        return sum(s.num_trainable for s in self.segments)
