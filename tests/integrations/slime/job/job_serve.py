"""The SGLang engines of the slime job on CPU (tests/integrations/slime/job/test_job.py), one process: replicas of an
SGLang-protocol server over the model of --hf-checkpoint (the job's: the memory task's SFT model, the demo's tiny
Llama; our TransformersEngine), each answering what slime
and sglang_router ask of an external engine (slime/backends/sglang_utils/external.py, sglang_engine.py,
server_control.py): GET /server_info, GET /health (the router's registration check), POST /generate (input_ids,
sampling_params, return_logprob; answers meta_info.output_token_logprobs and finish_reason), POST
/abort_request ({"abort_all": true}) and GET /v1/loads. /server_info also tells the test what it served: the
model's shape (`crf_model`) and the `stop_token_ids` of every /generate request (`crf_stop_token_ids`: distinct
lists and how many requests sent each).

A request whose prompt holds HOLD (three "none" words: no memory-task context holds them) waits until slime
aborts it, so the job's over-sampled prompts are aborted in every step, whatever the timing.

    python -m tests.integrations.slime.job.job_serve HF_DIR PORT... (one replica per port; prints "ready" when up)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys

HOLD = "none none none"


class Replica:
    def __init__(self, engine, hold_ids, pool, model_info):
        self.engine, self.hold_ids, self.pool, self.model_info = engine, hold_ids, pool, model_info
        self.held, self.running, self.aborted = set(), 0, 0
        self.stops = {}  # tuple(stop_token_ids) -> requests

    def _holds(self, ids):
        n = len(self.hold_ids)
        return any(ids[i:i + n] == self.hold_ids for i in range(len(ids) - n + 1))

    async def generate(self, request):
        from aiohttp import web

        body = await request.json()
        sp, ids = body["sampling_params"], body["input_ids"]
        key = tuple(sp.get("stop_token_ids") or ())
        self.stops[key] = self.stops.get(key, 0) + 1
        if self._holds(ids):
            wait = asyncio.get_running_loop().create_future()
            self.held.add(wait)
            try:
                await wait  # set by /abort_request
            finally:
                self.held.discard(wait)
            self.aborted += 1
            return web.json_response({"text": "", "meta_info": {"output_token_logprobs": [],
                                                                "finish_reason": {"type": "abort"}}})
        self.running += 1
        try:
            g = await asyncio.get_running_loop().run_in_executor(self.pool, lambda: self.engine.generate(
                [ids], [sp["max_new_tokens"]], temperature=sp["temperature"], top_p=sp["top_p"],
                stop_token_ids=sp["stop_token_ids"], seed=sp.get("sampling_seed"))[0])
        finally:
            self.running -= 1
        return web.json_response({"text": "", "meta_info": {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(g.logprobs, g.token_ids)],
            "finish_reason": {"type": g.finish_reason}}})

    async def abort(self, request):
        from aiohttp import web

        if (await request.json()).get("abort_all"):
            for w in list(self.held):
                if not w.done():
                    w.set_result(None)
        return web.json_response({})

    async def loads(self, request):
        from aiohttp import web

        return web.json_response({"num_reqs": self.running + len(self.held)})

    async def health(self, request):
        from aiohttp import web

        return web.json_response({})

    async def server_info(self, request):
        from aiohttp import web

        return web.json_response({"tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1,
                                  "aborted_requests": self.aborted, "crf_model": self.model_info,
                                  "crf_stop_token_ids": [[list(k), n] for k, n in self.stops.items()]})


async def serve(hf_dir, ports):
    from aiohttp import web
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compactionrl_fast.rollout.engines import TransformersEngine

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    engine = TransformersEngine(model, pad_token_id=tok.pad_token_id)
    pool = concurrent.futures.ThreadPoolExecutor(1)  # one model: one generation at a time
    hold_ids = tok(HOLD, add_special_tokens=False)["input_ids"]
    c = model.config
    model_info = dict(architecture=type(model).__name__, hidden_size=c.hidden_size,
                      num_attention_heads=c.num_attention_heads, num_hidden_layers=c.num_hidden_layers)
    runners = []
    for port in ports:
        rep, app = Replica(engine, hold_ids, pool, model_info), web.Application()
        app.router.add_post("/generate", rep.generate)
        app.router.add_post("/abort_request", rep.abort)
        app.router.add_get("/v1/loads", rep.loads)
        app.router.add_get("/server_info", rep.server_info)
        app.router.add_get("/health", rep.health)
        runners.append((app, port))
    for app, port in runners:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], [int(p) for p in sys.argv[2:]]))
