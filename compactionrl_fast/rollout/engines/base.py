"""The small interface every generation engine implements."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Generation:
    """One completion. token_ids: [n] sampled ids (a sampled stop token included, last);
    logprobs: [n] float32 log-prob of each sampled token under the sampling distribution softmax(logits /
    temperature) (before top-p truncation; temperature 0 uses temperature 1); finish_reason: "stop" or
    "length"."""
    token_ids: list
    logprobs: list
    finish_reason: str


class Engine:
    """Generate token ids with per-token log-probs from token-id prompts; load new weights.

    Subclasses implement `generate`, `load_weights` and `shares_weights`; `sleep`/`wake` free and restore
    accelerator memory where the engine supports it (no-ops otherwise).
    """

    def shares_weights(self, model) -> bool:
        """True when the engine generates with `model`'s own parameters, so that an optimiser step on
        `model` reaches it without `load_weights`. The trainer pushes the actor's weights to every engine
        that says False, after every actor update (and at the start of RL)."""
        return False

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        """Sample one completion per prompt.

        Args:
            prompts: list of token-id lists (never re-tokenised).
            max_new_tokens: int, or a list with one cap per prompt (a cap of 0 gives an empty completion).
            temperature: 0 is greedy. top_p: nucleus sampling in (0, 1].
            stop_token_ids: generation of a row stops after it samples one of these (it is returned).
            seed: makes sampling reproducible (None: the engine's own RNG).
            cache_keys: optional hashable per prompt naming the conversation it continues (the loop passes
                the rollout index); an engine may reuse that conversation's KV cache. A hint only.

        Returns:
            list of Generation, one per prompt, in order.
        """
        raise NotImplementedError

    def load_weights(self, state_dict) -> None:
        """Replace the policy's weights with `state_dict` (names as in the trainer's model)."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Release accelerator memory between rollout phases (where supported)."""

    def wake(self) -> None:
        """Undo `sleep`."""


def caps_list(max_new_tokens, n: int) -> list:
    """Per-prompt caps from an int or a list; ValueError on a bad length or a negative cap."""
    caps = [int(max_new_tokens)] * n if isinstance(max_new_tokens, int) else [int(c) for c in max_new_tokens]
    if len(caps) != n:
        raise ValueError(f"max_new_tokens must be an int or have one entry per prompt ({n}), got {len(caps)}")
    if any(c < 0 for c in caps):
        raise ValueError("max_new_tokens must be >= 0")
    return caps
