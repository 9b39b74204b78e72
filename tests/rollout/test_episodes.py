"""Async episodes (rollout/episodes.py): given the same generations they produce exactly the records of the
lockstep loop; seeds per (episode, call) whatever the scheduling; a slot bound; errors end one episode."""
import asyncio
import random
import zlib

import pytest

from compactionrl_fast.envs import MemoryEnv, ScriptedExpert, memory_config, memory_tokenizer
from compactionrl_fast.rollout import run_rollouts
from compactionrl_fast.rollout.engines.base import Engine, Generation, caps_list
from compactionrl_fast.rollout.episodes import arun_episodes, request_seed, run_episodes

from .helpers import AsyncListEnv, FixedEngine, ListEnv

TOK = memory_tokenizer()


class HashEngine(Engine):
    """Tokens and log-probs a deterministic function of the prompt alone (not of the seed or the batch)."""

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        out = []
        for p, cap in zip(prompts, caps_list(max_new_tokens, len(prompts))):
            rng = random.Random(zlib.crc32(bytes(str(list(p)), "ascii")))
            n = min(cap, rng.randint(1, 12))
            toks = [rng.randrange(len(TOK)) for _ in range(n)]
            out.append(Generation(toks, [-rng.random() for _ in toks], "stop" if toks and toks[-1] in
                                  stop_token_ids else "length"))
        return out


def ob(n):
    return " ".join(["la"] * n)


SCRIPTS = [[ob(3)] * 2, [ob(18)] * 5, [ob(18)] * 40, [ob(60), ob(90), ob(90), ob(5)], [ob(5), ""], [ob(200)] * 3]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == y  # dataclass equality: every segment, turn, reward, summary, finish reason


@pytest.mark.parametrize("threshold", [40, 0])
def test_scripted_envs_same_records_as_the_lockstep_loop(threshold):
    cfg = memory_config(compact_threshold=threshold, max_turns=20)

    def envs(cls=ListEnv):
        return [cls(s) for s in SCRIPTS] + [cls([ob(18)] * 9, fail_at=4), cls([ob(2)], fail_reset=True)]

    want = run_rollouts(FixedEngine(TOK), envs(), TOK, cfg)
    assert sum(r.compactions for r in want) > 3 and {r.finish_reason for r in want} >= {"done", "error"}
    same(run_episodes(FixedEngine(TOK), envs(), TOK, cfg), want)
    same(run_episodes(FixedEngine(TOK), envs(AsyncListEnv), TOK, cfg, max_concurrent=3), want)


@pytest.mark.parametrize("engine", [HashEngine, lambda: ScriptedExpert(drop_oldest_p=0.0)])
def test_memory_task_same_records_as_the_lockstep_loop(engine):
    cfg = memory_config(seed=3)
    seeds = [100 + i for i in range(24)]
    want = run_rollouts(engine(), [MemoryEnv() for _ in seeds], TOK, cfg, seeds)
    assert sum(r.compactions for r in want) > 0
    same(run_episodes(engine(), [MemoryEnv() for _ in seeds], TOK, cfg, seeds), want)


class AsyncEngine(Engine):
    """agenerate with a random delay: requests complete out of order. Records (episode, seed) per call and
    the largest number of episodes generating at once."""

    def __init__(self):
        self.inner, self.log, self.now, self.peak = HashEngine(), [], 0, 0
        self.rng = random.Random(0)

    async def agenerate(self, prompt, cap, *, temperature, top_p, stop_token_ids, seed, cache_key):
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(self.rng.random() * 0.003)
        self.now -= 1
        self.log.append((cache_key, seed))
        return self.inner.generate([prompt], [cap], stop_token_ids=stop_token_ids)[0]

    def generate(self, *a, **k):
        raise AssertionError("agenerate is preferred")


def test_out_of_order_completions_same_records_and_seeds_per_episode_and_call():
    cfg = memory_config(seed=5)
    seeds = list(range(16))
    want = run_rollouts(HashEngine(), [MemoryEnv() for _ in seeds], TOK, cfg, seeds)
    eng = AsyncEngine()
    same(run_episodes(eng, [MemoryEnv() for _ in seeds], TOK, cfg, seeds), want)
    assert eng.peak > 1  # the episodes' requests overlapped
    per = {}
    for key, seed in eng.log:
        per.setdefault(key, []).append(seed)
    assert per == {k: [request_seed(5, k, c) for c in range(len(v))] for k, v in per.items()}
    assert len(set(eng.log)) == len(eng.log)  # no seed reused, also within a group sharing a reset seed
    eng2 = AsyncEngine()
    run_episodes(eng2, [MemoryEnv() for _ in seeds], TOK, cfg.replace(seed=None), seeds)
    assert {s for _, s in eng2.log} == {None}


def test_max_concurrent_bounds_the_episodes_in_progress():
    eng = AsyncEngine()
    run_episodes(eng, [MemoryEnv() for _ in range(12)], TOK, memory_config(), max_concurrent=4)
    assert 1 < eng.peak <= 4
    with pytest.raises(ValueError, match="max_concurrent"):
        run_episodes(eng, [MemoryEnv()], TOK, memory_config(), max_concurrent=0)


def test_slow_tools_overlap_across_episodes():
    """A tool that sleeps 30 ms per step: episodes do not wait for one another."""
    import time

    class SlowEnv(ListEnv):
        async def step(self, action):
            await asyncio.sleep(0.03)
            return ListEnv.step(self, action)

    envs = [SlowEnv([ob(2)] * 5) for _ in range(16)]
    t = time.perf_counter()
    ros = run_episodes(FixedEngine(TOK), envs, TOK, memory_config())
    assert all(r.finish_reason == "done" for r in ros)
    assert time.perf_counter() - t < 16 * 5 * 0.03 / 2  # far below one sleep after another


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="engine"):
        run_episodes(object(), [MemoryEnv()], TOK)
    with pytest.raises(ValueError, match="seeds"):
        run_episodes(FixedEngine(TOK), [MemoryEnv()], TOK, seeds=[1, 2])
    with pytest.raises(ValueError, match="budget"):
        run_episodes(FixedEngine(TOK), [MemoryEnv()], TOK, memory_config(budget=8))
