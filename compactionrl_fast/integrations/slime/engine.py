"""SGLangEngine: the compaction loop's Engine over an SGLang server or slime's router (`POST /generate`).

Request: `{"input_ids": prompt, "sampling_params": {...}, "return_logprob": true}`; response: `meta_info`
with `output_token_logprobs` (`[[logprob, token_id, ...], ...]`, one per generated token, a sampled stop
token included) and `finish_reason` (`{"type": "stop" | "length" | "abort", ...}`). This is the protocol
slime's own `generate` speaks (slime/rollout/sglang_rollout.py).
"""
from __future__ import annotations

import asyncio
import weakref

from ...rollout.engines.base import Engine, Generation, caps_list


class RolloutAborted(RuntimeError):
    """The server aborted a request (slime aborts in-flight requests when a rollout step has enough samples)."""


def _httpx():
    try:
        import httpx
    except ImportError as e:
        raise ImportError("SGLangEngine needs httpx (`pip install httpx`)") from e
    return httpx


def parse_generate_response(j, stops=()) -> Generation:
    """A Generation from SGLang's `/generate` JSON; ValueError when it is not one, RolloutAborted on abort."""
    if not isinstance(j, dict) or not isinstance(j.get("meta_info"), dict):
        raise ValueError(f"/generate answered without meta_info: {str(j)[:200]}")
    meta = j["meta_info"]
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort":
        raise RolloutAborted(f"the server aborted the request: {fr}")
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise ValueError("/generate answered without output_token_logprobs: send return_logprob=true")
    ids = [int(p[1]) for p in pairs]
    lps = [float(p[0]) if p[0] is not None else 0.0 for p in pairs]
    reason = "stop" if kind == "stop" or (ids and ids[-1] in set(stops)) else "length"
    return Generation(ids, lps, reason)


class SGLangEngine(Engine):
    """Generate through SGLang's native `/generate` (slime's router, or one SGLang server).

    Args:
        url: the router's base URL ("http://host:port"); requests go to `url + "/generate"`.
        sampling_params: extra SGLang sampling parameters sent with every request (e.g. slime's
            `sampling_params`: top_k, skip_special_tokens, ...); the loop's own keys override them.
        timeout_s: per request, seconds (None: no limit).
        headers: extra HTTP headers (e.g. slime's `X-SMG-Routing-Key` for consistent-hashing routing).

    `agenerate` is what the compaction loop's episodes await (`arun_episodes`); `generate` runs a batch of
    them on a private event loop. Weights are synced by slime itself, so `load_weights` is not supported.
    """

    def __init__(self, url: str, *, sampling_params: dict | None = None, timeout_s: float | None = None,
                 headers: dict | None = None):
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        self.url = url.rstrip("/")
        self.sampling_params = dict(sampling_params or {})
        self.timeout_s, self.headers = timeout_s, dict(headers or {})
        self.requests = 0
        # one httpx.AsyncClient per event loop (a client cannot cross loops); gone with its loop
        self._clients = weakref.WeakKeyDictionary()

    def _client(self):
        loop = asyncio.get_running_loop()
        c = self._clients.get(loop)
        if c is None or c.is_closed:
            c = self._clients[loop] = _httpx().AsyncClient(timeout=self.timeout_s)
        return c

    def request_body(self, prompt, cap, temperature, top_p, stops, seed) -> dict:
        sp = dict(self.sampling_params)
        sp.update(max_new_tokens=int(cap), temperature=float(temperature), top_p=float(top_p),
                  stop_token_ids=sorted(set(int(t) for t in stops) | set(sp.get("stop_token_ids") or ())),
                  no_stop_trim=True)
        if seed is not None:
            sp["sampling_seed"] = int(seed) % (2 ** 31)
        return {"input_ids": [int(t) for t in prompt], "sampling_params": sp, "return_logprob": True}

    async def agenerate(self, prompt, max_new_tokens: int, *, temperature=1.0, top_p=1.0, stop_token_ids=(),
                        seed=None, cache_key=None):
        """One completion of `prompt` (token ids); RolloutAborted when the server aborts it."""
        caps_list([max_new_tokens], 1)
        if max_new_tokens == 0:
            return Generation([], [], "length")
        body = self.request_body(prompt, max_new_tokens, temperature, top_p, stop_token_ids, seed)
        r = await self._client().post(self.url + "/generate", json=body, headers=self.headers or None)
        if r.status_code != 200:
            raise ValueError(f"{self.url}/generate refused the request (HTTP {r.status_code}): {r.text[:500]}")
        self.requests += 1
        return parse_generate_response(r.json(), stop_token_ids)

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        """As `Engine.generate` (rows concurrently; row i seeded `seed + i`). Not from a running event loop."""
        caps = caps_list(max_new_tokens, len(prompts))

        async def go():
            try:
                return await asyncio.gather(*(self.agenerate(p, c, temperature=temperature, top_p=top_p,
                                                             stop_token_ids=stop_token_ids,
                                                             seed=None if seed is None else seed + i)
                                              for i, (p, c) in enumerate(zip(prompts, caps))))
            finally:
                await self.aclose()

        return list(asyncio.run(go()))

    async def aclose(self):
        """Close the client of the running event loop."""
        c = self._clients.pop(asyncio.get_running_loop(), None)
        if c is not None:
            await c.aclose()

    def load_weights(self, state_dict) -> None:
        raise NotImplementedError("slime syncs the SGLang servers' weights itself; SGLangEngine does not")
