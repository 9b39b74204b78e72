"""Async episodes: every rollout an independent asyncio task (no lockstep rounds).

`run_rollouts` advances all rollouts of a batch together: one batched generate per round, then every
environment step of the round, so each round waits for its slowest request and its slowest tool. Here each
episode runs reset -> (generate -> step | summarize)* on its own, awaiting one generation at a time
(`engine.agenerate`, e.g. ServerEngine's, which overlaps the requests of all episodes on the servers); an
episode that finishes frees its slot for the next (`max_concurrent`).

Same records: each episode goes through the loop's own steps (`loop._next_request`, `_after_step`,
`_compact`), so given the same generations it produces exactly the Rollout `run_rollouts` produces
(tests/rollout/test_episodes.py checks it with deterministic engines). The sampling seeds differ from the
lockstep loop's (which seeds by round and batch row): request k of episode i is seeded
`request_seed(config.seed, i, k)`, whatever the order in which the episodes' requests reach the engine, so a
run is reproducible on a deterministic server. The episode's index, not its reset seed, goes into the
seed: the rollouts of a group share a reset seed and must still sample independently.
"""
from __future__ import annotations

import asyncio
import inspect

from .config import RolloutConfig
from .engines.vllm_engine import row_seed
from .loop import _action_text, _after_step, _compact, _next_request, _prepare, _start, _State


def request_seed(seed: int, episode: int, call: int) -> int:
    """The sampling seed of call `call` (0, 1, ...) of episode `episode` in a run seeded `seed`, in [0, 2^63)."""
    return row_seed(int(seed) * 1_000_003 + int(call), int(episode))


async def _maybe_await(fn, *args):
    """fn(*args), awaited if it returns an awaitable; an exception is returned, not raised."""
    try:
        r = fn(*args)
        if inspect.isawaitable(r):
            r = await r
    except Exception as e:  # noqa: BLE001 -- an environment error ends only its rollout
        return e
    return r


async def _generate(engine, prompt, cap, config, stops, seed, key):
    """One generation: `engine.agenerate` where the engine has it, else a one-row `generate`."""
    kw = dict(temperature=config.temperature, top_p=config.top_p, stop_token_ids=stops, seed=seed)
    agen = getattr(engine, "agenerate", None)
    if agen is not None:
        return await agen(prompt, cap, cache_key=key, **kw)
    return engine.generate([prompt], [cap], cache_keys=[key], **kw)[0]


async def _episode(st, engine, chat, config, stops, q_sum, marker):
    _start(st, await _maybe_await(st.env.reset, st.out.seed), chat, config)
    call = 0
    while st.phase != "finished":
        req = _next_request(st, chat, config, q_sum)
        if req is None:
            break
        prompt, cap = req
        seed = None if config.seed is None else request_seed(config.seed, st.key, call)
        g = await _generate(engine, prompt, cap, config, stops, seed, st.key)
        call += 1
        if st.phase == "summarize":
            _compact(st, g, chat, config, q_sum, stops)
            continue
        r = await _maybe_await(st.env.step, _action_text(chat, g.token_ids, stops))
        _after_step(st, g, r, chat, config, marker, stops)
    return st.out


async def arun_episodes(engine, envs, tokenizer, config: RolloutConfig | None = None, seeds=None, *, chat=None,
                        max_concurrent: int | None = None):
    """Run one rollout per environment, each as its own asyncio task; the async form of `run_episodes`."""
    if max_concurrent is not None and (isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int)
                                       or max_concurrent < 1):
        raise ValueError(f"max_concurrent must be None or an int >= 1, got {max_concurrent!r}")
    config, chat, envs, seeds, stops, q_sum, marker = _prepare(engine, envs, tokenizer, config, seeds, chat)
    states = [_State(i, e, s) for i, (e, s) in enumerate(zip(envs, seeds))]
    slots = asyncio.Semaphore(max_concurrent or max(len(states), 1))

    async def run(st):
        async with slots:
            return await _episode(st, engine, chat, config, stops, q_sum, marker)

    tasks = [asyncio.ensure_future(run(st)) for st in states]
    try:
        # one episode's failure (a bad budget, every server down) ends the run: cancel the others
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def run_episodes(engine, envs, tokenizer, config: RolloutConfig | None = None, seeds=None, *, chat=None,
                 max_concurrent: int | None = None):
    """Run one compaction rollout per environment, each an independent episode (no lockstep).

    Args: as `run_rollouts`, plus
        max_concurrent: episodes in progress at once at most (None: all); one that finishes frees its slot.
    Engine: one with `agenerate(prompt, max_new_tokens, *, temperature, top_p, stop_token_ids, seed,
        cache_key)` (ServerEngine) runs the episodes' requests concurrently; any other Engine is called with
        one prompt at a time (same records, no overlap of generations). An engine with `run_coroutine(coro)`
        (ServerEngine) runs the episodes on its own event loop: on a 2-core CPU that cut the client's CPU
        time ~3x against a hop between two loops' threads for every request.

    Returns:
        list of Rollout, in the order of `envs`. Call `arun_episodes` from inside a running event loop.
    """
    coro = arun_episodes(engine, envs, tokenizer, config, seeds, chat=chat, max_concurrent=max_concurrent)
    run_on = getattr(engine, "run_coroutine", None)
    if callable(run_on):  # an engine with an event loop of its own (ServerEngine): run the episodes there
        return run_on(coro)
    return asyncio.run(coro)
