"""The built-in memory task: facts revealed early are needed for the final answer, so an agent succeeds
across compactions only if its summaries carry them (docs/demo.md).

One turn: the agent says "next"; the observation is "digit i d" (the i-th of N digits) plus filler words.
After the N digits (and any blank turns) the observation is "done" and the agent must reply
"answer d_1 ... d_N". Reward 1 for an exact answer, else 0 (`reward="accuracy"`: the fraction of right
positions, a partial credit); info reports success and that fraction. With the demo budget (memory_config()) every episode compacts twice.

The scripted expert (`ScriptedExpert`) is an Engine that reads its context like a policy would and
writes demonstrations through the same compaction loop; its summaries drop the oldest digit with a
configurable probability (a systematic error that supervised learning copies and RL has to fix).
"""
from __future__ import annotations

import functools
import numbers
import random

from ..rollout.config import RolloutConfig
from ..rollout.engines.base import Engine, Generation, caps_list

FILLERS = ("la", "lo", "li")
DIGITS = tuple(str(d) for d in range(10))
WORDS = ("memory", "collect", "digits", "answer", "all", "in", "order", "next", "digit", "done", "summarize",
         "resume", "seen", "none", "truncated") + FILLERS + DIGITS
SYSTEM = "memory"
SUMMARY_INSTRUCTION = "summarize"
RESUME_TEMPLATE = "{task} resume {summary}"


@functools.lru_cache(maxsize=None)
def memory_tokenizer():
    """The task's word-level tokenizer (34 tokens, chat template included; built locally)."""
    from .tokenizer import word_tokenizer

    return word_tokenizer(WORDS)


def memory_config(**overrides) -> RolloutConfig:
    """The demo's RolloutConfig: C = 128, T_comp = 40, summary cap 16, last 2 turns kept, 3 compactions."""
    base = RolloutConfig(budget=128, compact_threshold=40, keep_recent_turns=2, max_compactions=3,
                         max_response_tokens=16, max_turns=32, summary_max_tokens=16,
                         summary_instruction=SUMMARY_INSTRUCTION, resume_template=RESUME_TEMPLATE,
                         truncation_marker="truncated")
    return base.replace(**overrides) if overrides else base


class MemoryEnv:
    """Collect N digits over N turns (plus blank turns), answer them all in order.

    Args:
        n_digits: N in 1..9 (the facts to remember).
        n_fillers: filler words per observation (longer observations force compaction sooner).
        n_blank: extra turns whose observation holds no digit ("none" + fillers), at random places.
        reward: "exact" (1 for the exact answer, else 0: the demo's) or "accuracy" (the fraction of digits
            answered in their right position: rewards that vary between rollouts of a model that is
            often wrong, which job tests need).

    Example:
        >>> env = MemoryEnv(n_digits=2, n_fillers=1)
        >>> env.reset(0)
        ('memory', 'collect 2 digits answer all in order')
        >>> env.step("next")[0].split()[:3]
        ['digit', '1', '6']
    """

    REWARDS = ("exact", "accuracy")

    def __init__(self, n_digits: int = 6, n_fillers: int = 15, n_blank: int = 0, reward: str = "exact"):
        for name, v, lo, hi in (("n_digits", n_digits, 1, 9), ("n_fillers", n_fillers, 0, None),
                                ("n_blank", n_blank, 0, None)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"MemoryEnv: {name} must be an integer, got {type(v).__name__} {v!r}")
            if v < lo or (hi is not None and v > hi):
                raise ValueError(f"MemoryEnv: {name} must be in {lo}..{hi if hi is not None else 'inf'}, got {v}")
        if reward not in self.REWARDS:
            raise ValueError(f"MemoryEnv: reward must be one of {self.REWARDS}, got {reward!r}")
        self.n_digits, self.n_fillers, self.n_blank = int(n_digits), int(n_fillers), int(n_blank)
        self.reward = reward
        self.digits, self._queue, self._rng = [], [], random.Random(0)

    def reset(self, seed):
        self._rng = random.Random(seed)
        self.digits = [self._rng.randrange(10) for _ in range(self.n_digits)]
        self._queue = [(i + 1, d) for i, d in enumerate(self.digits)]
        for _ in range(self.n_blank):
            self._queue.insert(self._rng.randrange(len(self._queue) + 1), None)
        return SYSTEM, f"collect {self.n_digits} digits answer all in order"

    def _fillers(self):
        return " ".join(self._rng.choice(FILLERS) for _ in range(self.n_fillers))

    def step(self, action: str):
        words = action.split()
        if words and words[0] == "answer":
            guess = words[1:]
            right = sum(g == str(d) for g, d in zip(guess, self.digits))
            success = guess == [str(d) for d in self.digits]
            accuracy = right / self.n_digits
            return "", True, float(success) if self.reward == "exact" else accuracy, {"success": success,
                                                                                      "accuracy": accuracy}
        if not self._queue:
            return "done", False, 0.0
        item = self._queue.pop(0)
        head = "none" if item is None else f"digit {item[0]} {item[1]}"
        return f"{head} {self._fillers()}".strip(), False, 0.0


def summary_correct(rollout) -> list:
    """For each summary of a memory-task rollout: does it list exactly the digits revealed before it, in
    order ("seen d_1 ... d_m")? A diagnostic of what the summaries carry (the demo's summary recall).

    The digits come from the rollout's reset seed (the first draws of the seed's RNG, whatever n_digits).
    """
    env = MemoryEnv(n_digits=9)
    env.reset(rollout.seed)
    out = []
    for j, text in enumerate(rollout.summaries):
        n = sum(1 for t in rollout.turns if t.window <= j and t.observation.startswith("digit "))
        out.append(text.split() == ["seen"] + [str(d) for d in env.digits[:n]])
    return out


def _messages(words):
    """Split a rendered context (token strings) into (role, content words) messages."""
    msgs = []
    for w in words:
        if w in ("<system>", "<user>", "<assistant>"):
            msgs.append((w[1:-1], []))
        elif w not in ("<eos>", "<pad>") and msgs:
            msgs[-1][1].append(w)
    return msgs


def expert_knowledge(msgs) -> list:
    """Digits the context tells, in order: the last resume summary ("seen d ..."), then every observed
    "digit i d" with i beyond what is known (kept turns repeat digits the summary already holds)."""
    known = []
    for role, words in msgs:
        if role != "user" or not words:
            continue
        if "resume" in words:
            rest = words[words.index("resume") + 1:]
            known = [w for w in rest[1:] if w in DIGITS] if rest[:1] == ["seen"] else []
        elif words[0] == "digit" and len(words) >= 3 and words[1].isdigit() and int(words[1]) > len(known):
            known.append(words[2])
    return known


class ScriptedExpert(Engine):
    """A scripted policy for the memory task, behind the Engine interface (log-probs are 0).

    It says "next" until it sees "done", then answers the digits it knows; asked to summarize it writes
    "seen d_1 ... d_m", dropping the oldest digit with probability `drop_oldest_p`.

    Example:
        >>> from compactionrl_fast.rollout import run_rollouts
        >>> envs = [MemoryEnv() for _ in range(4)]
        >>> demos = run_rollouts(ScriptedExpert(drop_oldest_p=0.0), envs, memory_tokenizer(), memory_config())
        >>> [r.success for r in demos], [r.compactions for r in demos]
        ([True, True, True, True], [2, 2, 2, 2])
    """

    def __init__(self, drop_oldest_p: float = 0.55, seed: int = 0, tokenizer=None):
        if not 0.0 <= drop_oldest_p <= 1.0:
            raise ValueError(f"drop_oldest_p must be in [0, 1], got {drop_oldest_p}")
        self.drop_oldest_p = float(drop_oldest_p)
        self.tokenizer = tokenizer or memory_tokenizer()
        vocab = self.tokenizer.get_vocab()
        self._words = [None] * (max(vocab.values()) + 1)  # id -> word, without per-call tokenizer overhead
        for w, i in vocab.items():
            self._words[i] = w
        self._ids, self._eos = vocab, self.tokenizer.eos_token_id
        self._rng = random.Random(seed)

    def reply(self, context_ids, rng) -> str:
        msgs = _messages([self._words[i] for i in context_ids])
        users = [m for m in msgs if m[0] == "user"]
        last = users[-1][1] if users else []
        known = expert_knowledge(msgs)
        if last == [SUMMARY_INSTRUCTION]:
            if known and rng.random() < self.drop_oldest_p:
                known = known[1:]
            return " ".join(["seen"] + known)
        if last == ["done"]:
            return " ".join(["answer"] + known)
        return "next"

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        caps = caps_list(max_new_tokens, len(prompts))
        rng = random.Random(seed) if seed is not None else self._rng
        out = []
        for p, cap in zip(prompts, caps):
            ids = [self._ids[w] for w in self.reply(p, rng).split()] + [self._eos]
            out.append(Generation(ids[:cap], [0.0] * min(cap, len(ids)), "stop" if cap >= len(ids) else "length"))
        return out

    def load_weights(self, state_dict) -> None:
        raise TypeError("ScriptedExpert has no weights")


def expert_rollouts(n: int, *, seed: int = 0, drop_oldest_p: float = 0.55, config: RolloutConfig | None = None,
                    **env_kwargs):
    """n expert demonstrations (Rollout records; pack() them for SFT: the loss mask marks the expert's
    tokens). Reset seeds are seed*n .. seed*n+n-1."""
    from ..rollout.loop import run_rollouts

    envs = [MemoryEnv(**env_kwargs) for _ in range(n)]
    expert = ScriptedExpert(drop_oldest_p, seed=seed)
    return run_rollouts(expert, envs, memory_tokenizer(), config or memory_config(),
                        seeds=[seed * n + i for i in range(n)])
