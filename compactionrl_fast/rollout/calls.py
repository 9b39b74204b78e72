"""Segments from call logs: one episode's LLM calls, as a harness recorded them, -> a Rollout for `pack()`.

A harness of one's own (NeMo Gym, verifiers, OpenHands, an OpenAI-client agent) records per call the
prompt token ids, the sampled completion token ids and their log-probs. `rollout_from_calls` lays them out
as the built-in loop (loop.py) lays out its own rollouts (docs/calls.md):

- a call whose prompt extends the previous call's prompt + completion continues the current execution
  window; the tokens in between (end of the assistant message, the observation, the next generation
  prompt) are observation tokens, never trainable;
- a summary call closes the window: the window (the summary prompt minus `summary_suffix`, the summary
  request) becomes an exec segment and the summary a summary segment sharing the window as its prefix;
- any other call that does not extend the previous one starts a new window (a context rebuilt by the
  harness); after a summary the next call always starts a new window.

Which calls are summaries: `Call.is_summary` when set; when None it is inferred from the structure the
built-in loop always has: a call is a summary exactly when the next call (or `final_context`, for the last
call) does not extend its prompt + completion. So a harness that cuts its context without a summary
must mark those calls `is_summary=False`, and a last call that is a summary is only recognised with
`final_context` or an explicit mark.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .compaction import ChatFormat
from .config import RolloutConfig
from .records import EXEC, SUMMARY, TRUNCATED_REASONS, Rollout, Segment, Turn

FINISH_REASONS = ("done",) + TRUNCATED_REASONS + ("error",)


@dataclass
class Call:
    """One LLM call of an episode.

    prompt_ids: [P] every token the model was conditioned on (the rendered chat, P >= 1).
    completion_ids: [N] the sampled tokens, exactly as sampled (a sampled stop token included).
    completion_logprobs: [N] the sampler's log-prob of each sampled token.
    is_summary: True for a summary request, False for an ordinary turn, None to infer (module docstring).
    finish_reason: the sampler's ("stop", "length", ...); an empty completion is accepted only with
        "length" (the sampler was given no room), anywhere else it means a lost completion.
    """
    prompt_ids: list
    completion_ids: list
    completion_logprobs: list
    is_summary: bool | None = None
    finish_reason: str | None = None


def _ids(x, label, allow_empty=True) -> list:
    if hasattr(x, "tolist"):  # numpy arrays, torch tensors
        x = x.tolist()
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise ValueError(f"{label} must be a list of token ids, got {type(x).__name__}")
    x = list(x)
    for t in x:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"{label} must hold int token ids >= 0, got {type(t).__name__} {t!r}")
    if not x and not allow_empty:
        raise ValueError(f"{label} is empty: a call needs a prompt")
    return [int(t) for t in x]


def _validate(i, c):
    """(prompt, completion, logprobs, is_summary) of calls[i], checked."""
    if not all(hasattr(c, a) for a in ("prompt_ids", "completion_ids", "completion_logprobs")):
        raise ValueError(f"calls[{i}] must be a Call, got {type(c).__name__}")
    p = _ids(c.prompt_ids, f"calls[{i}].prompt_ids", allow_empty=False)
    comp = _ids(c.completion_ids, f"calls[{i}].completion_ids")
    lps = c.completion_logprobs
    lps = lps.tolist() if hasattr(lps, "tolist") else lps
    try:
        lps = [float(v) for v in lps]
    except (TypeError, ValueError):
        raise ValueError(f"calls[{i}].completion_logprobs must be a list of numbers") from None
    if len(lps) != len(comp):
        raise ValueError(f"calls[{i}]: {len(lps)} log-probs for a completion of {len(comp)} tokens "
                         "(one log-prob per completion token)")
    if any(math.isnan(v) for v in lps):
        raise ValueError(f"calls[{i}].completion_logprobs holds NaN")
    fr = getattr(c, "finish_reason", None)
    if not comp and fr != "length":
        raise ValueError(f"calls[{i}]: completion of 0 tokens with finish_reason={fr!r}; only a call whose "
                         "sampler had no room (finish_reason='length') may be empty -- was the completion lost?")
    s = getattr(c, "is_summary", None)
    if s is not None and not isinstance(s, bool):
        raise ValueError(f"calls[{i}].is_summary must be True, False or None, got {s!r}")
    return p, comp, lps, s


def _extends(ids, prefix) -> bool:
    return len(ids) >= len(prefix) and ids[:len(prefix)] == prefix


class _Window:
    """The open execution window: [L] ids, loss mask, log-probs; `turn`: the Turn its observation
    tokens count to (the window's last non-summary call)."""

    def __init__(self):
        self.ids, self.mask, self.lps, self.turn = [], [], [], None

    def grow(self, ids):
        """Append the tokens of `ids` (which extends the window) beyond it, not trainable."""
        n = len(ids) - len(self.ids)
        self.ids.extend(ids[len(self.ids):])
        self.mask.extend([False] * n)
        self.lps.extend([0.0] * n)
        if self.turn is not None:
            self.turn.observation_tokens += n

    def segment(self):
        return Segment(EXEC, self.ids, self.mask, self.lps)


def rollout_from_calls(calls, reward, *, finish_reason: str = "done", summary_suffix=None, final_context=None,
                       budget: int | None = None, error: str | None = None, info: dict | None = None,
                       decode=None) -> Rollout:
    """Build one episode's Rollout (its segments, turns, compactions) from its calls in order.

    Args:
        calls: list of Call, in the order they were made (one episode).
        reward: the episode's final reward (every segment carries it).
        finish_reason: "done", "max_turns", "context_full" (truncated) or "error".
        summary_suffix: the summary request the harness appended to the window (token ids, or their
            count): a summary's window is its prompt minus these tokens (checked to end with them when
            ids are given). None: 0 tokens, the whole summary prompt is the window. The built-in loop's is
            `loop_summary_suffix(tokenizer, config)`.
        final_context: [F] the working context when the episode ended (the last prompt + completion and
            what followed: the end of the assistant message, a final observation). None: the last call's
            prompt + completion. If it does not extend the last call, it is a window of its own (a context
            rebuilt after a last summary, as the built-in loop leaves when it runs out of room).
        budget: the working-context limit C, checked when given: every non-summary prompt, every summary's
            window and `final_context` hold at most `budget` tokens.
        error: the error text of an errored episode (pack masks rollouts with an error); with
            finish_reason="error" and no text, "error reported by the harness".
        info: the environment's info dict (pack reads info["success"], else reward > 0).
        decode: optional ids -> str, fills Turn.action and Rollout.summaries (else "" and []).

    Returns:
        Rollout with segments in the built-in loop's layout: [exec, summary] per summary call, an exec
        segment per window; each Segment's lists are [L], loss_mask True exactly on completion tokens,
        logprobs 0.0 elsewhere, a summary's shared_prefix = its window's length. One Turn per non-summary
        call (observation_tokens: the tokens after its completion up to the next generation's prompt end
        or its window's end, chat-format pieces included; observation text "").

    Raises:
        ValueError naming the call index: a malformed call (empty prompt, non-int ids, log-prob count
        differing from the completion length, an empty completion not ended by "length"), a prompt over
        `budget`, a summary prompt not ending with `summary_suffix`, or a summary continued by the next call.
    """
    if isinstance(calls, (str, bytes, dict)) or not hasattr(calls, "__iter__"):
        raise ValueError(f"calls must be a list of Call, got {type(calls).__name__}")
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be None or an int >= 1, got {budget!r}")
    calls = [_validate(i, c) for i, c in enumerate(calls)]
    if summary_suffix is None:
        suffix, n_suffix = None, 0
    elif isinstance(summary_suffix, numbers.Integral) and not isinstance(summary_suffix, bool):
        suffix, n_suffix = None, int(summary_suffix)
    else:
        suffix = _ids(summary_suffix, "summary_suffix")
        n_suffix = len(suffix)
    final = None if final_context is None else _ids(final_context, "final_context")
    if final is not None and budget is not None and len(final) > budget:
        raise ValueError(f"final_context of {len(final)} tokens is longer than budget={budget}")

    # which calls are summaries: explicit marks, else "the next call (or final_context) does not extend it"
    kinds = []
    for i, (p, comp, _, s) in enumerate(calls):
        nxt = calls[i + 1][0] if i + 1 < len(calls) else final
        cont = nxt is not None and _extends(nxt, p + comp)
        if s and cont:
            what = f"calls[{i + 1}]" if i + 1 < len(calls) else "final_context"
            raise ValueError(f"calls[{i}] is marked a summary but {what} continues it (extends its prompt + "
                             "completion); a summary ends its context")
        kinds.append(s if s is not None else (nxt is not None and not cont))

    if error is None and finish_reason == "error":
        error = "error reported by the harness"
    ro = Rollout(reward=float(reward), finish_reason=finish_reason, info=dict(info or {}), error=error)
    win = None  # the open execution window
    for i, ((p, comp, lps, _), summ) in enumerate(zip(calls, kinds)):
        if win is not None and not _extends(p, win.ids):
            ro.segments.append(win.segment())  # the harness rebuilt its context without a summary
            win = None
        if summ:
            if n_suffix > len(p) or suffix is not None and p[len(p) - n_suffix:] != suffix:
                raise ValueError(f"calls[{i}]: summary prompt does not end with summary_suffix ({n_suffix} tokens)")
            window = p[:len(p) - n_suffix]
            if budget is not None and len(window) > budget:
                raise ValueError(f"calls[{i}]: summary window of {len(window)} tokens is longer than "
                                 f"budget={budget}")
            win = win or _Window()
            if len(window) < len(win.ids):
                raise ValueError(f"calls[{i}]: summary_suffix ({n_suffix} tokens) reaches into calls[{i - 1}]'s "
                                 "completion; a summary's window holds every earlier token of its context")
            win.grow(window)
            ro.segments.append(win.segment())
            ro.segments.append(Segment(SUMMARY, p + comp, [False] * len(p) + [True] * len(comp),
                                       [0.0] * len(p) + lps, shared_prefix=len(window)))
            if decode is not None:
                ro.summaries.append(decode(comp))
            ro.compactions += 1
            win = None
            continue
        if budget is not None and len(p) > budget:
            raise ValueError(f"calls[{i}]: prompt of {len(p)} tokens is longer than budget={budget}")
        win = win or _Window()
        win.grow(p)
        win.ids.extend(comp)
        win.mask.extend([True] * len(comp))
        win.lps.extend(lps)
        win.turn = Turn(decode(comp) if decode is not None else "", "", len(comp), 0, ro.compactions)
        ro.turns.append(win.turn)
    if final is not None:
        if win is not None and not _extends(final, win.ids):
            ro.segments.append(win.segment())
            win = None
        win = win or _Window()
        win.grow(final)
    if win is not None:
        ro.segments.append(win.segment())
    for s in ro.segments:
        s.reward = ro.reward
    return ro


def calls_from_rollout(rollout) -> list:
    """The calls a built-in-loop Rollout was sampled from: one Call per run of trainable tokens
    (prompt = the segment's tokens before it), is_summary from the segment kind, in order. It relies on
    the loop's layout: completions are separated by untrainable tokens (the generation prompt at least),
    and none is empty (an empty one leaves no trainable run, so it is not recovered)."""
    calls = []
    for s in rollout.segments:
        m, i = s.loss_mask, 0
        while i < len(m):
            if not m[i]:
                i += 1
                continue
            j = i
            while j < len(m) and m[j]:
                j += 1
            calls.append(Call(list(s.input_ids[:i]), list(s.input_ids[i:j]), list(s.logprobs[i:j]),
                              is_summary=s.kind == SUMMARY))
            i = j
    return calls


def loop_summary_suffix(tokenizer, config=None, *, chat=None) -> list:
    """The tokens the built-in loop appends to a window to ask for its summary (the summary instruction
    as a user message, then the generation prompt): `summary_suffix` for calls logged from it."""
    chat = chat or ChatFormat(tokenizer)
    config = config or RolloutConfig()
    return chat.user_message(chat.encode(config.summary_instruction)) + list(chat.gen_prompt)
