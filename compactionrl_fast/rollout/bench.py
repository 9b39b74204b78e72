"""Rollout throughput of an engine on the built-in memory task (the demo's model size by default, docs/demo.md).

    python -m compactionrl_fast.rollout.bench --threads 1 --expert-warmup 300 --repeats 5

Prints rollouts/s and tokens/s (generated tokens, and packed tokens without / with prefix sharing) as
JSON. A random model writes long, junk responses; --expert-warmup N first fits the model to N steps of
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


def main(argv=None):
    from ..envs import MemoryEnv, memory_config, memory_tokenizer, tiny_llama
    from ..packing import pack
    from .engines import TransformersEngine
    from .loop import run_rollouts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--expert-warmup", type=int, default=0, help="SFT steps on expert demos before timing")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--load", default=None, help="the demo's sft_actor.pt to load into the model")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--no-lean", action="store_true", help="use the model's own forward (DynamicCache)")
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
    eng = TransformersEngine(model, pad_token_id=tok.pad_token_id, prefix_cache=not args.no_prefix_cache,
                             lean=not args.no_lean)
    cfg = memory_config(temperature=args.temperature)
    times, cpu, gen_tokens, packed, shared, compactions, success = [], [], [], [], [], [], []
    for rep in range(args.repeats + 1):
        envs = [MemoryEnv() for _ in range(args.batch)]
        t0, c0 = time.perf_counter(), time.process_time()
        ros = run_rollouts(eng, envs, tok, cfg, seeds=[rep * args.batch + i for i in range(args.batch)])
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if rep == 0:
            continue  # warm-up
        times.append(dt)
        cpu.append(dc)
        success.append(sum(r.success for r in ros) / len(ros))
        gen_tokens.append(sum(r.num_trainable for r in ros))
        packed.append(pack(ros).num_tokens)
        shared.append(pack(ros, prefix_sharing=True).num_tokens)
        compactions.append(sum(r.compactions for r in ros) / len(ros))
    t = statistics.median(times)
    print(json.dumps({
        "engine": "transformers", "prefix_cache": not args.no_prefix_cache, "lean": eng.lean, "batch": args.batch, "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()), "expert_warmup": args.expert_warmup,
        "seconds_per_batch_median": round(t, 4), "cpu_seconds_per_batch_median": round(statistics.median(cpu), 4),
        "rollouts_per_s": round(args.batch / t, 1),
        "generated_tokens_per_s": round(statistics.median(gen_tokens) / t, 1),
        "packed_tokens_per_s": round(statistics.median(packed) / t, 1),
        "packed_tokens_per_rollout": round(statistics.median(packed) / args.batch, 1),
        "shared_tokens_per_rollout": round(statistics.median(shared) / args.batch, 1),
        "compactions_per_rollout": round(statistics.mean(compactions), 2),
        "success": round(statistics.mean(success), 3), "load_avg_1min": round(os.getloadavg()[0], 2),
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
    }))


if __name__ == "__main__":
    main()
