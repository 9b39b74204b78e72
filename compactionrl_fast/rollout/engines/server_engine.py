"""ServerEngine: rollouts on one or more OpenAI-compatible completion servers (`vllm serve` replicas).

docs/server.md is the full account: the request fields (`/v1/completions` with token-id prompts,
`logprobs: 0`, `return_token_ids`, a per-request seed; servers run `--skip-tokenizer-init` and
`--logprobs-mode processed_logprobs`), the client (one asyncio loop in its own thread; at most `max_in_flight`
requests, each to the live replica with the fewest outstanding), the faults (a timeout, 5xx or lost connection
is retried on another replica and counted once; a refused connection or `max_failures` in a row takes a
replica out; `ServerFleetError` when none is left; a 4xx is a ValueError) and the weight sync (safetensors
written once, then `reload_weights` via `POST /collective_rpc` and `POST /reset_prefix_cache` on every replica
in parallel, which needs `VLLM_SERVER_DEV_MODE=1`; a replica whose sync failed is taken out).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

from .base import Engine, Generation, caps_list
from .vllm_engine import row_seed


class ServerFleetError(RuntimeError):
    """No replica can serve a request (all are down, or the request used up its retries)."""


def _httpx():
    try:
        import httpx
    except ImportError as e:
        raise ImportError("ServerEngine needs httpx (`pip install httpx`); the servers themselves run vLLM "
                          "in their own environment") from e
    return httpx


class _Replica:
    def __init__(self, url):
        self.url = url
        self.outstanding = 0  # requests in flight on it now
        self.alive = True
        self.consecutive = 0  # failures since its last success
        self.ok = self.failed = self.tokens = 0
        self.errors = []  # how it failed, oldest first (capped)

    def describe(self) -> str:
        state = "up" if self.alive else "down"
        last = f"; last error: {self.errors[-1]}" if self.errors else ""
        return f"{self.url} ({state}, {self.ok} ok, {self.failed} failed{last})"


class ServerEngine(Engine):
    """Generation engine over OpenAI-compatible completion servers.

    Args:
        urls: base URL of each replica ("http://127.0.0.1:8000"; a trailing "/v1" is accepted).
        model: the served model name; None asks the first replica (`GET /v1/models`).
        max_in_flight: requests in flight over all replicas at most (the rest wait client-side).
        timeout_s: per request (one attempt on one replica), seconds.
        retries: further attempts of a request after a failed one, each on another replica where possible.
        max_failures: consecutive failures after which a replica is taken out of rotation.
        weights_dir: folder for `load_weights`' safetensors file; None: a temporary folder (same machine).
        fleet: a `servers.Fleet` this engine owns (stopped by `close()`).
        async_episodes: tells the trainer to run episodes as independent tasks (`rollout/episodes.py`)
            instead of the lockstep loop.
    """

    def __init__(self, urls, *, model: str | None = None, max_in_flight: int = 256, timeout_s: float = 300.0,
                 retries: int = 2, max_failures: int = 3, weights_dir: str | None = None, fleet=None,
                 async_episodes: bool = True):
        if isinstance(urls, str) or not urls:
            raise ValueError(f"urls must be a non-empty list of server URLs, got {urls!r}")
        for u in urls:
            if not (isinstance(u, str) and u.startswith(("http://", "https://"))):
                raise ValueError(f"urls: each must be an http(s) URL, got {u!r}")
        for name, v, lo in (("max_in_flight", max_in_flight, 1), ("retries", retries, 0),
                            ("max_failures", max_failures, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        httpx = _httpx()
        self.replicas = [_Replica(u.rstrip("/").removesuffix("/v1")) for u in urls]
        self.max_in_flight, self.timeout_s, self.retries = max_in_flight, float(timeout_s), retries
        self.max_failures, self.fleet, self.async_episodes = max_failures, fleet, bool(async_episodes)
        self.requests = 0  # completed requests (each counted once, however many attempts it took)
        self.last_sync = {}
        self._weights_dir, self._tmp = weights_dir, None
        self._last_prompt = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="server-engine", daemon=True)
        self._thread.start()

        async def setup():
            self._sem = asyncio.Semaphore(max_in_flight)
            # the per-request limit is `timeout_s` (asyncio.wait_for below), one for every phase
            self._client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(
                max_connections=max_in_flight + 2 * len(self.replicas), max_keepalive_connections=max_in_flight))

        self._run(setup())
        try:
            self.model = model if model is not None else self._run(self._model_name())
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- plumbing

    def _run(self, coro):
        """Run `coro` on the engine's loop and wait for it (from any thread but the loop's own)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def urls(self) -> list:
        return [r.url for r in self.replicas]

    @property
    def live(self) -> list:
        return [r for r in self.replicas if r.alive]

    def _fail(self, rep, how: str, dead: bool = False):
        rep.failed += 1
        rep.consecutive += 1
        rep.errors = (rep.errors + [how])[-5:]
        if dead or rep.consecutive >= self.max_failures:
            rep.alive = False

    def _fleet_error(self, what: str) -> ServerFleetError:
        lines = "\n".join("  " + r.describe() for r in self.replicas)
        return ServerFleetError(f"{what}. Replicas:\n{lines}")

    async def _model_name(self):
        httpx = _httpx()
        for rep in self.replicas:
            try:
                r = await asyncio.wait_for(self._client.get(rep.url + "/v1/models"), min(self.timeout_s, 30.0))
                r.raise_for_status()
                return r.json()["data"][0]["id"]
            except (httpx.HTTPError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
                self._fail(rep, f"GET /v1/models: {type(e).__name__}: {e}", dead=isinstance(e, httpx.ConnectError))
        raise self._fleet_error("no replica answered GET /v1/models (pass model= to skip the question)")

    def _pick(self, tried):
        """The live replica with the fewest outstanding requests, preferring those this request has not tried."""
        live = self.live
        if not live:
            return None
        fresh = [r for r in live if r.url not in tried] or live
        return min(fresh, key=lambda r: r.outstanding)

    # ---------------------------------------------------------------- generation

    async def _complete(self, prompt, cap, temperature, top_p, stops, seed, only=None):
        if cap == 0:
            return Generation([], [], "length")  # the server refuses max_tokens=0
        httpx = _httpx()
        body = request_body(self.model, prompt, cap, temperature, top_p, stops, seed)
        tried = set()
        async with self._sem:
            for _attempt in range(self.retries + 1):
                rep = self._pick(tried) if only is None else (only if only.alive else None)
                if rep is None:
                    raise self._fleet_error("no replica left to serve the request")
                tried.add(rep.url)
                rep.outstanding += 1
                try:
                    r = await asyncio.wait_for(self._client.post(rep.url + "/v1/completions", json=body),
                                               self.timeout_s)
                except asyncio.TimeoutError:
                    self._fail(rep, f"no answer within timeout_s={self.timeout_s:g}")
                    continue
                except httpx.TransportError as e:
                    # refused: nothing listens there any more, out at once; a connection lost mid-request
                    # (the server died, or closed a kept-alive connection as it was reused) counts as a failure
                    self._fail(rep, f"{type(e).__name__}: {e or 'connection lost'}",
                               dead=isinstance(e, httpx.ConnectError))
                    continue
                finally:
                    rep.outstanding -= 1
                if r.status_code >= 500:
                    self._fail(rep, f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                if r.status_code != 200:
                    raise ValueError(f"{rep.url} refused the request (HTTP {r.status_code}, not retried: every "
                                     f"replica would): {r.text[:500]}")
                try:
                    g = _parse(r.json(), stops)
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    self._fail(rep, f"malformed response: {type(e).__name__}: {e}")
                    continue
                rep.consecutive, rep.ok, rep.tokens = 0, rep.ok + 1, rep.tokens + len(g.token_ids)
                self.requests += 1
                self._last_prompt = body["prompt"]
                return g
        raise self._fleet_error(f"a request failed on {self.retries + 1} attempts (retries={self.retries})")

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        """As `Engine.generate`; row i is seeded `row_seed(seed, i)` (as VLLMEngine). Rows go out concurrently."""
        caps = caps_list(max_new_tokens, len(prompts))
        stops = [int(t) for t in stop_token_ids]

        async def go():
            return await asyncio.gather(*(self._complete(p, c, temperature, top_p, stops,
                                                         None if seed is None else row_seed(seed, i))
                                          for i, (p, c) in enumerate(zip(prompts, caps))))

        return list(self._run(go()))

    async def agenerate(self, prompt, max_new_tokens: int, *, temperature=1.0, top_p=1.0, stop_token_ids=(),
                        seed=None, cache_key=None):
        """One completion of one prompt (token ids), awaitable from any event loop; `seed` is used as given."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        coro = self._complete(prompt, max_new_tokens, temperature, top_p, [int(t) for t in stop_token_ids], seed)
        if asyncio.get_running_loop() is self._loop:  # episodes on the engine's own loop: no thread hop
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def run_coroutine(self, coro):
        """Run `coro` on the engine's event loop and return its result (`run_episodes` runs its episodes
        there: each request then goes out without a hop between threads)."""
        return self._run(coro)

    # ---------------------------------------------------------------- weights

    def shares_weights(self, model) -> bool:
        return False

    def load_weights(self, state_dict) -> None:
        """Write `state_dict` to `weights_dir` and reload it on every live replica; returns when all have it.
        Timings of the last sync in `last_sync` (write_s, reload_s)."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        folder = self._weights_dir
        if folder is None:
            import tempfile

            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="crf-server-sync-")
            folder = self._tmp.name
        os.makedirs(folder, exist_ok=True)
        # clone: tied weights share storage, which safetensors refuses; every name must reach the reload
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
        tmp = os.path.join(folder, "model.safetensors.tmp")
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(folder, "model.safetensors"))  # a reader never sees half a file
        t1 = time.perf_counter()
        failed = self._run(self._reload_all(os.path.abspath(folder)))
        t2 = time.perf_counter()
        self.last_sync = {"write_s": t1 - t0, "reload_s": t2 - t1, "replicas": len(self.live)}
        if failed:
            if not self.live:
                raise self._fleet_error("weight sync failed on every replica")
            import warnings

            warnings.warn(f"weight sync failed on {', '.join(failed)}: taken out of rotation", RuntimeWarning,
                          stacklevel=2)

    async def _reload_all(self, folder):
        live = self.live
        res = await asyncio.gather(*(self._reload(r, folder) for r in live))
        return [r.url for r, ok in zip(live, res) if not ok]

    async def _reload(self, rep, folder) -> bool:
        httpx = _httpx()
        try:
            for path, body in (("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}}),
                               ("/reset_prefix_cache", None)):
                r = await asyncio.wait_for(self._client.post(rep.url + path, json=body), self.timeout_s)
                if r.status_code != 200:
                    hint = " (start the server with VLLM_SERVER_DEV_MODE=1)" if r.status_code == 404 else ""
                    raise RuntimeError(f"POST {path}: HTTP {r.status_code}{hint}: {r.text[:200]}")
        except (httpx.HTTPError, asyncio.TimeoutError, RuntimeError) as e:
            self._fail(rep, f"weight sync: {type(e).__name__}: {e}", dead=True)
            return False
        return True

    # ---------------------------------------------------------------- the guard, per replica

    def replica_gaps(self, actor, max_new_tokens: int = 16, temperature: float = 1.0) -> dict:
        """{url: max |actor log-prob - replica log-prob|} over a seeded completion of the last prompt seen
        (sent to each live replica), by a plain forward of `actor`. Names the replica whose sampler differs."""
        import torch

        prompt = self._last_prompt
        if prompt is None:
            return {}
        device = next(actor.parameters()).device

        async def one(rep):
            return await self._complete(prompt, max_new_tokens, temperature, 1.0, [], 12345, only=rep)

        out = {}
        for rep in self.live:
            try:
                g = self._run(one(rep))
            except Exception as e:  # noqa: BLE001 -- report, do not mask the guard's own error
                out[rep.url] = f"{type(e).__name__}: {e}"
                continue
            if not g.token_ids:
                continue
            ids = torch.tensor(list(prompt) + list(g.token_ids), device=device)
            with torch.no_grad():
                logits = actor(input_ids=ids[None]).logits[0].float() / max(temperature, 1e-6)
            lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, ids[len(prompt):, None])[:, 0]
            out[rep.url] = (lp.cpu() - torch.tensor(g.logprobs)).abs().max().item()
        return out

    def stats(self) -> dict:
        """Per replica: requests ok and failed, tokens generated, alive, the last errors."""
        return {r.url: dict(ok=r.ok, failed=r.failed, tokens=r.tokens, alive=r.alive, errors=list(r.errors))
                for r in self.replicas}

    def close(self) -> None:
        """Close the HTTP client and the loop; stop the fleet if this engine owns one."""
        loop, self._loop = getattr(self, "_loop", None), None
        if loop is not None and loop.is_running():
            client = getattr(self, "_client", None)
            if client is not None:
                try:
                    asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(timeout=10)
                except Exception:  # noqa: BLE001 -- best effort at exit
                    pass
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)
        fleet, self.fleet = getattr(self, "fleet", None), None
        if fleet is not None:
            fleet.close()
        if getattr(self, "_tmp", None) is not None:
            self._tmp.cleanup()
            self._tmp = None


def request_body(model, prompt, cap, temperature, top_p, stops, seed) -> dict:
    """The JSON body of one `/v1/completions` request: token-id prompt, the sampled token's log-prob, token
    ids back (also without a tokenizer on the server), `seed` only when given."""
    body = {"model": model, "prompt": [int(t) for t in prompt], "max_tokens": int(cap),
            "temperature": float(temperature), "top_p": float(top_p), "logprobs": 0,
            "stop_token_ids": [int(t) for t in stops], "return_token_ids": True, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False, "ignore_eos": False}
    if seed is not None:
        body["seed"] = int(seed)
    return body


def _parse(j, stops) -> Generation:
    """Generation from a /v1/completions response (one choice, token ids and their log-probs)."""
    c = j["choices"][0]
    toks = [int(t) for t in c["token_ids"]]
    lps = [float(x) for x in c["logprobs"]["token_logprobs"]]
    if len(lps) != len(toks):
        raise ValueError(f"{len(toks)} token ids but {len(lps)} log-probs")
    stopped = c.get("finish_reason") == "stop" or bool(toks and toks[-1] in stops)
    return Generation(toks, lps, "stop" if stopped else "length")
