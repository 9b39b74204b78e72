"""RolloutConfig: the compaction runtime's knobs, with the paper's defaults (docs/method.md, "Compaction")."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

SUMMARY_INSTRUCTION = (
    "Your context window is nearly full and your earlier history will be removed. Write a summary that "
    "lets you continue the task without it. Keep: (1) the task and every requirement or constraint; "
    "(2) what you have done so far and the current state: files you created or changed, commands you "
    "ran and their key results; (3) attempts that failed and why, so that you do not repeat them; "
    "(4) facts, values and observations you will still need, written out exactly; (5) your current plan "
    "and the next concrete step; (6) open questions. Be precise and concise. Write only the summary."
)

RESUME_TEMPLATE = (
    "{task}\n\n"
    "You have already worked on this task, and your earlier context was compacted. Your own summary of "
    "the work so far:\n\n{summary}\n\n"
    "The most recent turns, if any, follow. Continue from where you left off; do not redo finished work."
)

TRUNCATION_MARKER = " ... [observation truncated]"


@dataclass(frozen=True)
class RolloutConfig:
    """Knobs of the compaction loop. Token counts are in the policy tokenizer's tokens.

    budget: working-context budget C; the working context never exceeds it.
    compact_threshold: T_comp; compact after a complete turn when `budget - len(context) < T_comp`.
    keep_recent_turns: k, the last turns copied into the rebuilt context (lowered, down to 0, until the
        rebuilt context leaves `compact_threshold` tokens free).
    max_compactions: at most this many summaries per rollout; after that a full context ends the rollout
        as truncated.
    max_response_tokens: per-response cap; a response is capped by min(cap, budget - len(context)).
    max_turns: a rollout that has not finished after this many turns ends as truncated.
    summary_max_tokens: cap of one summary (None: max_response_tokens).
    summary_instruction: q_sum, sent as a user message after the last turn.
    resume_template: u_resume(S), the user message of the rebuilt context; "{task}" and "{summary}" are
        replaced by the task text and the summary's own tokens (never re-tokenised).
    truncation_marker: appended (as tokens) to an observation cut to fit the budget.
    temperature, top_p, seed: sampling; temperature 0 is greedy. seed None draws from torch's RNG.
    truncated_reward: the final reward of a truncated rollout (None: the environment's reward so far).
    error_reward: the final reward of a rollout whose environment raised.
    stop_token_ids: extra stop tokens besides the chat format's end-of-turn token.

    Example:
        >>> RolloutConfig(budget=128, compact_threshold=40, summary_max_tokens=16).keep_recent_turns
        2
    """
    budget: int = 65536
    compact_threshold: int = 10240
    keep_recent_turns: int = 2
    max_compactions: int = 3
    max_response_tokens: int = 10240
    max_turns: int = 250
    summary_max_tokens: int | None = None
    summary_instruction: str = SUMMARY_INSTRUCTION
    resume_template: str = RESUME_TEMPLATE
    truncation_marker: str = TRUNCATION_MARKER
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    truncated_reward: float | None = 0.0
    error_reward: float = 0.0
    stop_token_ids: tuple = ()

    def __post_init__(self):
        for name, lo in (("budget", 1), ("compact_threshold", 0), ("keep_recent_turns", 0), ("max_compactions", 0),
                         ("max_response_tokens", 1), ("max_turns", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"RolloutConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.summary_max_tokens is not None and (not isinstance(self.summary_max_tokens, int)
                                                    or self.summary_max_tokens < 1):
            raise ValueError(f"RolloutConfig.summary_max_tokens must be None or an int >= 1, got {self.summary_max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"RolloutConfig.temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"RolloutConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if "{summary}" not in self.resume_template:
            raise ValueError("RolloutConfig.resume_template must contain '{summary}'")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def summary_cap(self) -> int:
        return self.summary_max_tokens if self.summary_max_tokens is not None else self.max_response_tokens

    def replace(self, **changes) -> "RolloutConfig":
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown RolloutConfig fields: {sorted(unknown)}")
        return replace(self, **changes)
