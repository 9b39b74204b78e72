"""ServerEngine against fake completion servers on real sockets (tests/rollout/fake_server.py): the request
it sends, least-outstanding balancing, the in-flight bound, retries on 5xx / timeouts / a replica killed
mid-batch with every request answered exactly once, the error when no replica is left, weight sync to every
replica; async episodes over it."""
import asyncio
import threading
import time
import warnings

import pytest

httpx = pytest.importorskip("httpx")

from compactionrl_fast.envs import MemoryEnv, memory_config, memory_tokenizer  # noqa: E402
from compactionrl_fast.rollout import run_rollouts  # noqa: E402
from compactionrl_fast.rollout.engines.server_engine import ServerEngine, ServerFleetError  # noqa: E402
from compactionrl_fast.rollout.engines.vllm_engine import row_seed  # noqa: E402
from compactionrl_fast.rollout.episodes import arun_episodes, run_episodes  # noqa: E402

from .fake_server import FakeServer, completion  # noqa: E402

TOK = memory_tokenizer()
PROMPTS = [[1, 5 + i, 7, 9] for i in range(40)]


@pytest.fixture
def servers(request):
    made = []

    def make(n=2, **kw):
        s = [FakeServer(**kw) for _ in range(n)]
        made.extend(s)
        return s

    yield make
    for s in made:
        s.stop()


def engine(srvs, **kw):
    return ServerEngine([s.url for s in srvs], **kw)


def expect(prompts, cap, seed, stops=(2,)):
    return [completion(p, cap, None if seed is None else row_seed(seed, i), list(stops))
            for i, p in enumerate(prompts)]


def test_generate_matches_the_servers_and_balances(servers):
    a, b = servers(2, delay=0.01)
    eng = engine([a, b])
    try:
        assert eng.model == "fake-model"
        got = eng.generate(PROMPTS, 6, stop_token_ids=(2,), seed=11)
        want = expect(PROMPTS, 6, 11)
        assert [(g.token_ids, g.logprobs) for g in got] == [(t, lp) for t, lp, _ in want]
        assert [g.finish_reason for g in got] == [f for _, _, f in want]
        assert a.completions + b.completions == len(PROMPTS) and min(a.completions, b.completions) >= 10
        assert eng.requests == len(PROMPTS)
        assert eng.generate([[1, 2], [3]], [0, 0]) [0].token_ids == []  # cap 0: no request
    finally:
        eng.close()


def test_in_flight_bound(servers):
    (a,) = servers(1, delay=0.02)
    peak, now, lock = [0], [0], threading.Lock()
    orig = a._handle

    async def counting(method, path, body):
        if path == "/v1/completions":
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
        try:
            return await orig(method, path, body)
        finally:
            if path == "/v1/completions":
                with lock:
                    now[0] -= 1

    a._handle = counting
    eng = engine([a], max_in_flight=3)
    try:
        eng.generate(PROMPTS[:12], 4)
        assert peak[0] == 3
    finally:
        eng.close()


@pytest.mark.parametrize("fault", ["500", "hang", "die"])
def test_faulty_replica_requests_retried_elsewhere_each_answered_once(servers, fault):
    good, = servers(1)
    bad, = servers(1, **({"die_after": 3} if fault == "die" else {"mode": fault}))
    # a short timeout only where it is the fault: on a loaded machine the good replica (a thread of this process)
    # has answered later than 0.5 s, twice, and was taken down with the bad one
    eng = engine([bad, good], timeout_s=2.0 if fault == "hang" else 60.0, max_failures=2)
    try:
        got = eng.generate(PROMPTS, 6, stop_token_ids=(2,), seed=4)
        want = expect(PROMPTS, 6, 4)
        assert [(g.token_ids, g.logprobs) for g in got] == [(t, lp) for t, lp, _ in want]  # in order, none lost
        assert eng.requests == len(PROMPTS) == good.completions + bad.completions  # none counted twice
        assert not eng.stats()[bad.url]["alive"] and eng.stats()[good.url]["alive"]
        assert eng.stats()[bad.url]["failed"] >= 1
    finally:
        eng.close()


def test_no_replica_left_names_every_url_and_how_it_failed(servers):
    a, = servers(1, mode="500")
    b, = servers(1)
    b.stop()  # connection refused
    eng = ServerEngine([a.url, b.url], model="m", retries=5, max_failures=1)
    try:
        with pytest.raises(ServerFleetError) as e:
            eng.generate(PROMPTS[:2], 4)
        msg = str(e.value)
        assert a.url in msg and b.url in msg and "HTTP 500" in msg and "ConnectError" in msg
    finally:
        eng.close()


def test_retries_exhausted(servers):
    a, b = servers(2, mode="500")
    eng = engine([a, b], retries=1, max_failures=10)
    try:
        with pytest.raises(ServerFleetError, match="failed on 2 attempts"):
            eng.generate(PROMPTS[:1], 4)
    finally:
        eng.close()


def test_a_4xx_is_not_retried(servers):
    a, b = servers(2)
    eng = engine([a, b])
    try:
        with pytest.raises(ValueError, match="refused the request"):
            eng.generate([[-1]], 4)
        assert a.received + b.received == 1
    finally:
        eng.close()


def test_weight_sync_reaches_every_replica(servers, tmp_path):
    import torch

    a, b = servers(2)
    eng = engine([a, b], weights_dir=str(tmp_path / "w"))
    try:
        before = eng.generate(PROMPTS[:4], 6, seed=1)
        eng.load_weights({"w": torch.ones(3), "tied": torch.zeros(2)})
        assert a.reloads == b.reloads == [str(tmp_path / "w")] and a.resets == b.resets == 1
        assert (tmp_path / "w" / "model.safetensors").exists()
        after = eng.generate(PROMPTS[:4], 6, seed=1)
        assert [g.logprobs for g in after] != [g.logprobs for g in before]  # version 1 on both replicas
        assert set(eng.last_sync) == {"write_s", "reload_s", "replicas"} and eng.last_sync["replicas"] == 2
        b.stop()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            eng.load_weights({"w": torch.ones(3)})
        assert any(b.url in str(x.message) for x in w) and eng.urls == [a.url, b.url] and len(eng.live) == 1
    finally:
        eng.close()


def test_bad_arguments():
    for kw, name in [(dict(urls=[]), "urls"), (dict(urls="http://x"), "urls"), (dict(urls=["ftp://x"]), "urls"),
                     (dict(urls=["http://x"], max_in_flight=0), "max_in_flight"),
                     (dict(urls=["http://x"], timeout_s=0), "timeout_s"), (dict(urls=["http://x"], retries=-1), "retries")]:
        with pytest.raises(ValueError, match=name):
            ServerEngine(**kw)


def test_episodes_and_lockstep_over_servers_and_a_kill_mid_batch(servers):
    a, b = servers(2, delay=0.002)
    eng = engine([a, b])
    cfg = memory_config(seed=2, max_turns=6)
    try:
        lock = run_rollouts(eng, [MemoryEnv() for _ in range(16)], TOK, cfg)
        assert len(lock) == 16
        n0 = a.completions + b.completions
        t = threading.Timer(0.05, a.kill)
        t.start()
        ros = run_episodes(eng, [MemoryEnv() for _ in range(32)], TOK, cfg)
        t.join()
        assert len(ros) == 32 and all(r.finish_reason for r in ros)
        calls = sum(len(r.turns) + r.compactions for r in ros)
        # each call answered once; the killed server may have computed answers that never arrived
        assert eng.requests - n0 == calls <= a.completions + b.completions - n0
        assert not eng.stats()[a.url]["alive"]
        solo = engine([b])
        again = run_episodes(solo, [MemoryEnv() for _ in range(32)], TOK, cfg)  # on the engine's loop
        hop = asyncio.run(arun_episodes(solo, [MemoryEnv() for _ in range(32)], TOK, cfg))  # from another loop
        solo.close()
        assert again == ros == hop  # the kill changed nothing: same seeds, same answers on the survivor
    finally:
        eng.close()
