"""The batched compaction loop (docs/method.md, "Compaction"): generate -> observe -> after each complete turn, compact
when C - |h_t| < T_comp -> rebuild -> ... for many rollouts at once.

Every round sends one generation request per unfinished rollout (its next response, or its summary) to the
engine in a single batch; environment steps of the round run concurrently when they are coroutines.
"""
from __future__ import annotations

import asyncio
import inspect
import traceback

from .compaction import ChatFormat, needs_compaction, rebuild
from .config import RolloutConfig
from .records import EXEC, SUMMARY, Rollout, Segment, Turn


class Environment:
    """The environment protocol (duck-typed; subclassing is optional).

    reset(seed) -> (system, task): the system prompt and the task text.
    step(action) -> (observation, done, reward) or (observation, done, reward, info): `action` is the
        decoded response (its stop token removed); `info` (a dict) is merged into Rollout.info.
    Either method may be a coroutine function. An exception ends only that rollout (finish_reason
    "error"). The final reward of a rollout is the sum of its step rewards.
    """

    def reset(self, seed):
        raise NotImplementedError

    def step(self, action: str):
        raise NotImplementedError


class _State:
    """One rollout in flight: its current working context and window bookkeeping."""

    def __init__(self, key, env, seed):
        self.key, self.env, self.out = key, env, Rollout(seed=seed)
        self.system = self.task = ""
        self.ctx, self.mask, self.lps = [], [], []  # current window: [L] ids, trainable flags, log-probs
        self.turns = []  # token lists of the turns in the current context (kept + new), oldest first
        self.env_reward, self.phase = 0.0, "act"

    def extend(self, ids, trainable=False, logprobs=None):
        self.ctx.extend(ids)
        self.mask.extend([trainable] * len(ids))
        self.lps.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def close_window(self):
        self.out.segments.append(Segment(EXEC, list(self.ctx), list(self.mask), list(self.lps)))

    def finish(self, reason, reward, error=None):
        self.close_window()
        self.out.finish_reason, self.out.reward, self.out.error = reason, float(reward), error
        for s in self.out.segments:
            s.reward = self.out.reward
        self.phase = "finished"


async def _call_all(calls):
    """Run calls (fn, args); await coroutines concurrently. Returns results or raised exceptions."""
    results = [None] * len(calls)
    pending = []
    for i, (fn, args) in enumerate(calls):
        try:
            r = fn(*args)
        except Exception as e:  # noqa: BLE001 -- an environment error ends only its rollout
            r = e
        if inspect.isawaitable(r):
            pending.append((i, r))
        results[i] = r
    if pending:
        done = await asyncio.gather(*(p for _, p in pending), return_exceptions=True)
        for (i, _), r in zip(pending, done):
            results[i] = r
    return results


def _short(x, n=80) -> str:
    r = repr(x)
    return f"{type(x).__name__} {r if len(r) <= n else r[:n] + '...'}"


def _step_result(r):
    """(observation, done, reward, info) of env.step's return value; TypeError if it breaks the protocol."""
    if not (isinstance(r, (tuple, list)) and len(r) in (3, 4)):
        raise TypeError(f"env.step must return (observation, done, reward) or (observation, done, reward, info), "
                        f"got {_short(r)}")
    obs, done, reward = r[0], r[1], r[2]
    info = r[3] if len(r) > 3 else None
    if obs is None and done:
        obs = ""
    if not isinstance(obs, str):
        raise TypeError(f"env.step's observation must be a str (None only when done), got {_short(obs)}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        try:
            reward = float(reward)  # numpy and 0-d tensor scalars
        except (TypeError, ValueError):
            raise TypeError(f"env.step's reward must be a number, got {_short(reward)}") from None
    if info is not None and not isinstance(info, dict):
        raise TypeError(f"env.step's info must be a dict or None, got {_short(info)}")
    return obs, bool(done), float(reward), info


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def _prepare(engine, envs, tokenizer, config, seeds, chat):
    """Check the arguments of a rollout run; (config, chat, envs, seeds, stops, summary request, marker)."""
    if not callable(getattr(engine, "generate", None)):
        raise TypeError(f"engine must be an Engine with a generate() method, got {type(engine).__name__}")
    if chat is None and (tokenizer is None or not callable(getattr(tokenizer, "encode", None))):
        raise TypeError(f"tokenizer must be the policy's Hugging Face tokenizer, got {type(tokenizer).__name__}")
    if config is not None and not isinstance(config, RolloutConfig):
        raise TypeError(f"config must be a RolloutConfig, got {type(config).__name__}")
    config = config or RolloutConfig()
    chat = chat or ChatFormat(tokenizer)
    envs = list(envs)
    for i, e in enumerate(envs):
        if not (callable(getattr(e, "reset", None)) and callable(getattr(e, "step", None))):
            raise TypeError(f"envs[{i}] must have reset(seed) and step(action) methods, got {type(e).__name__}")
    seeds = list(range(len(envs))) if seeds is None else list(seeds)
    if len(seeds) != len(envs):
        raise ValueError(f"seeds must have one entry per environment ({len(envs)}), got {len(seeds)}")
    stops = tuple(sorted(set(chat.stop_token_ids) | set(config.stop_token_ids)))
    q_sum = chat.user_message(chat.encode(config.summary_instruction))
    marker = chat.encode(config.truncation_marker)
    return config, chat, envs, seeds, stops, q_sum, marker


def _start(st, r, chat, config):
    """Open the rollout's first window from env.reset's result `r` (or end it on an error); ValueError when
    the budget cannot hold its prompt."""
    if not isinstance(r, BaseException) and not (isinstance(r, (tuple, list)) and len(r) == 2
                                                 and all(isinstance(x, str) for x in r)):
        r = TypeError(f"env.reset must return (system, task) strings, got {_short(r)}")
    if isinstance(r, BaseException):
        st.out.finish_reason, st.out.reward, st.out.error = "error", float(config.error_reward), _error_text(r)
        st.phase = "finished"
        return
    st.system, st.task = r
    st.extend(chat.head(st.system, st.task))
    # the first response needs the prompt, the generation prompt, one token and the end of turn
    need = len(st.ctx) + len(chat.gen_prompt) + 1 + len(chat.assistant_end)
    if need > config.budget:
        raise ValueError(f"config.budget={config.budget} is smaller than rollout {st.key}'s prompt (seed "
                         f"{st.out.seed}): {len(st.ctx)} tokens of system prompt and task need a budget >= "
                         f"{need} to sample a response; the context would exceed the budget")
    if config.max_compactions > 0:  # the context rebuilt around a full-length summary must fit too
        resumed = len(chat.resume_head(st.system, st.task, [0] * config.summary_cap, config.resume_template))
        need = resumed + len(chat.gen_prompt) + 1 + len(chat.assistant_end)
        if need > config.budget:
            raise ValueError(f"config.budget={config.budget} cannot hold rollout {st.key}'s context after a "
                             f"compaction (seed {st.out.seed}): system prompt, task, resume template and a "
                             f"summary of summary_max_tokens={config.summary_cap} tokens need a budget >= {need}; "
                             "raise the budget or lower summary_max_tokens")


async def arun_rollouts(engine, envs, tokenizer, config: RolloutConfig | None = None, seeds=None, *, chat=None):
    """Run one rollout per environment to the end; the async form of `run_rollouts`."""
    config, chat, envs, seeds, stops, q_sum, marker = _prepare(engine, envs, tokenizer, config, seeds, chat)
    states = [_State(i, e, s) for i, (e, s) in enumerate(zip(envs, seeds))]

    for st, r in zip(states, await _call_all([(st.env.reset, (st.out.seed,)) for st in states])):
        _start(st, r, chat, config)

    round_idx = 0
    while True:
        live = [st for st in states if st.phase != "finished"]
        if not live:
            break
        reqs = [(st,) + req for st in live if (req := _next_request(st, chat, config, q_sum)) is not None]
        if not reqs:
            continue
        seed = None if config.seed is None else config.seed * 1_000_003 + round_idx
        gens = engine.generate([p for _, p, _ in reqs], [c for _, _, c in reqs], temperature=config.temperature,
                               top_p=config.top_p, stop_token_ids=stops, seed=seed,
                               cache_keys=[st.key for st, _, _ in reqs])
        if inspect.isawaitable(gens):  # an engine whose generate is a coroutine (verl's server_manager)
            gens = await gens
        round_idx += 1
        acting = []
        for (st, _, _), g in zip(reqs, gens):
            if st.phase == "summarize":
                _compact(st, g, chat, config, q_sum, stops)
            else:
                acting.append((st, g))
        results = await _call_all([(st.env.step, (_action_text(chat, g.token_ids, stops),)) for st, g in acting])
        for (st, g), r in zip(acting, results):
            _after_step(st, g, r, chat, config, marker, stops)
    return [st.out for st in states]


def _next_request(st, chat, config, q_sum):
    """(prompt, cap) of the rollout's next generation (its response, or its summary); None if it ended."""
    if st.phase == "act":
        room = config.budget - len(st.ctx) - len(chat.gen_prompt) - len(chat.assistant_end)
        cap = min(config.max_response_tokens, room)
        if cap > 0:
            return st.ctx + chat.gen_prompt, cap
        if st.out.compactions >= config.max_compactions:  # no room for a response, no compaction left
            st.finish("context_full", _truncated_reward(st, config))
            return None
        st.phase = "summarize"
    return st.ctx + q_sum + chat.gen_prompt, config.summary_cap


def _truncated_reward(st, config):
    return config.truncated_reward if config.truncated_reward is not None else st.env_reward


def _action_text(chat, ids, stops):
    return chat.decode(ids[:-1] if ids and ids[-1] in stops else ids)


def _after_step(st, g, r, chat, config, marker, stops):
    """Append the turn (response + observation) to the context; end the rollout or schedule a summary."""
    C, T = config.budget, config.compact_threshold
    n0 = len(st.ctx)
    st.extend(chat.gen_prompt)
    st.extend(g.token_ids, True, g.logprobs)
    st.extend(chat.close_response(g.token_ids))
    action = _action_text(chat, g.token_ids, stops)
    if not isinstance(r, BaseException):
        try:
            r = _step_result(r)
        except TypeError as e:  # a broken environment ends only its rollout
            r = e
    if isinstance(r, BaseException):
        st.out.turns.append(Turn(action, "", len(g.token_ids), 0, st.out.compactions))
        st.finish("error", config.error_reward, _error_text(r))
        return
    obs, done, reward, info = r
    if info:
        st.out.info.update(info)
    st.env_reward += reward
    content = chat.encode(obs) if (obs or not done) else None
    cut = False
    if content is not None:
        room = C - len(st.ctx) - len(chat.user_pre) - len(chat.user_post)
        if room < 0:  # not even an empty user message fits: the budget is exhausted
            st.turns.append(st.ctx[n0:])
            st.out.turns.append(Turn(action, obs, len(g.token_ids), 0, st.out.compactions, True))
            if done:
                st.finish("done", st.env_reward)
            else:
                st.finish("context_full", _truncated_reward(st, config))
            return
        if len(content) > room:  # cut the observation to fit, with a visible marker
            content = (content[:max(room - len(marker), 0)] + marker)[:room]
            cut = True
        st.extend(chat.user_message(content))
    st.turns.append(st.ctx[n0:])
    st.out.turns.append(Turn(action, obs, len(g.token_ids), len(content or []), st.out.compactions, cut))
    if done:
        st.finish("done", st.env_reward)
    elif len(st.out.turns) >= config.max_turns:
        st.finish("max_turns", _truncated_reward(st, config))
    elif needs_compaction(len(st.ctx), C, T) and st.out.compactions < config.max_compactions:
        st.phase = "summarize"


def _compact(st, g, chat, config, q_sum, stops):
    """Record the execution window and the summary, then rebuild h' = s + resume(S) + last k turns."""
    st.close_window()
    prompt = st.ctx + q_sum + chat.gen_prompt
    n = len(prompt)
    st.out.segments.append(Segment(SUMMARY, prompt + list(g.token_ids), [False] * n + [True] * len(g.token_ids),
                                   [0.0] * n + list(g.logprobs), shared_prefix=len(st.ctx)))
    summary = list(g.token_ids[:-1] if g.token_ids and g.token_ids[-1] in stops else g.token_ids)
    st.out.summaries.append(chat.decode(summary))
    st.out.compactions += 1
    head = chat.resume_head(st.system, st.task, summary, config.resume_template)
    ids, k = rebuild(head, st.turns, config.keep_recent_turns, config.budget, config.compact_threshold)
    st.turns = st.turns[len(st.turns) - k:]
    st.ctx, st.mask, st.lps = [], [], []
    st.extend(ids)
    st.phase = "act"


def run_rollouts(engine, envs, tokenizer, config: RolloutConfig | None = None, seeds=None, *, chat=None):
    """Run one compaction rollout per environment with `engine`, all in one batched loop.

    Args:
        engine: an Engine (TransformersEngine, VLLMEngine, or the memory task's ScriptedExpert).
        envs: environments (one per rollout) following the `Environment` protocol.
        tokenizer: the policy's Hugging Face tokenizer; its chat template formats the conversation.
        config: RolloutConfig (defaults: the paper's).
        seeds: one reset seed per environment (default 0..n-1).
        chat: a prebuilt ChatFormat (optional; saves re-deriving it every call).

    Returns:
        list of Rollout, in the order of `envs`. Call `arun_rollouts` from inside a running event loop.
    """
    return asyncio.run(arun_rollouts(engine, envs, tokenizer, config, seeds, chat=chat))
