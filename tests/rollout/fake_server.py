"""A fake vLLM completion server on a real socket (asyncio, HTTP/1.1 keep-alive), in a thread or as a process.

Completions are a deterministic function of (prompt, seed, weights version): the same request gives the
same tokens on every replica, as on identical vLLM replicas. Behaviour switches for the fault tests:
`mode` "ok" | "500" (every completion fails with HTTP 500) | "hang" (never answers a completion);
`die_after`: after that many completions the server closes its socket and every open connection
(a replica killed mid-batch); `delay`: seconds before each answer.

`python -m tests.rollout.fake_server --port P [anything vLLM's server takes]` serves until SIGTERM (the
launcher's tests start it in place of vLLM).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import zlib

EOS = 2


def completion(prompt, cap, seed, stops, version=0):
    """(token ids, log-probs, finish_reason) of the fake model."""
    key = zlib.crc32(json.dumps([list(prompt), seed, version]).encode())
    rng = random.Random(key)
    n = min(cap, rng.randint(1, 8))
    toks = [rng.randrange(5, 30) for _ in range(n)]
    finish = "length"
    if stops and n < cap + 1 and rng.random() < 0.6:
        toks[-1] = stops[0]
        finish = "stop"
    return toks, [-(1 + (t % 7)) / 4 - version for t in toks], finish


class FakeServer:
    def __init__(self, mode="ok", die_after=None, delay=0.0, port=0):
        self.mode, self.die_after, self.delay = mode, die_after, delay
        self.completions = 0  # completions answered
        self.received = 0  # completion requests received
        self.version = 0  # bumped by every reload_weights
        self.reloads = []  # weights_path of each reload_weights
        self.resets = 0
        self._writers = set()
        self._port = port
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self, started):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", self._port))
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    def kill(self):
        """Close the listening socket and every connection (as a SIGKILLed server would)."""
        def k():
            self.server.close()
            for w in list(self._writers):
                w.transport.abort()
        self.loop.call_soon_threadsafe(k)

    def stop(self):
        if not self.loop.is_running():
            return
        self.kill()

        async def drain():  # end every connection's task (a hung answer too) before the loop stops
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(drain(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _conn(self, reader, writer):
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                n = 0
                for h in lines[1:]:
                    if h.lower().startswith("content-length:"):
                        n = int(h.split(":", 1)[1])
                body = json.loads(await reader.readexactly(n)) if n else None
                status, out = await self._handle(method, path, body)
                if status is None:
                    return
                data = json.dumps(out).encode()
                writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: "
                             f"{len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _handle(self, method, path, body):
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "fake-model"}]}
        if path == "/collective_rpc":
            self.version += 1
            self.reloads.append(body["kwargs"]["weights_path"])
            return 200, {"results": [None]}
        if path == "/reset_prefix_cache":
            self.resets += 1
            return 200, {"success": True}
        if path == "/health":
            return 200, {}
        if path != "/v1/completions":
            return 404, {"detail": "Not Found"}
        self.received += 1
        if self.die_after is not None and self.completions >= self.die_after:
            self.kill()
            return None, None
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "500":
            return 500, {"error": {"message": "engine dead", "code": 500}}
        if not body.get("return_tokens_as_token_ids") or body.get("logprobs") != 0:
            return 400, {"error": {"message": "needs logprobs=0 and return_tokens_as_token_ids"}}
        if body["max_tokens"] < 1 or min(body["prompt"]) < 0:
            return 400, {"error": {"message": "max_tokens must be at least 1"}}
        toks, lps, finish = completion(body["prompt"], body["max_tokens"], body.get("seed"),
                                       body.get("stop_token_ids") or [], self.version)
        self.completions += 1
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": toks, "finish_reason": finish,
                                  "logprobs": {"token_logprobs": lps,
                                               "tokens": [f"token_id:{t}" for t in toks]}}]}


def main(argv):
    port = int(argv[argv.index("--port") + 1])
    srv = FakeServer(port=port)
    print(f"fake server on {srv.url}", flush=True)
    srv.thread.join()


if __name__ == "__main__":
    main(sys.argv[1:])
