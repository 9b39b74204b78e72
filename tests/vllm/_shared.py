"""Helpers of the real-engine tests: the Hugging Face forward they compare sampled log-probs with, and a short
`train` run through the command line."""
import json
import os
import subprocess
import sys

import torch

from compactionrl_fast.packing import pack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@torch.no_grad()
def hf_logprobs(model, batch):
    """log-prob [T] of every token given its attention sequence's prefix, by a plain HF forward."""
    out = torch.zeros(batch.num_tokens)
    for a0, a1 in zip(batch.cu_attn[:-1].tolist(), batch.cu_attn[1:].tolist()):
        ids = batch.input_ids[a0:a1]
        logits = model(input_ids=ids[None]).logits[0].float()
        out[a0 + 1:a1] = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]
    return out


def logp_error(model, rollouts):
    """(max |HF log-prob - rollout log-prob| over the trainable tokens, their count)."""
    b = pack(rollouts, prefix_sharing=True, mask_errors=False)
    m = b.loss_mask
    return (hf_logprobs(model, b)[m] - b.rollout_logprobs[m]).abs().max().item(), int(m.sum())


def train_cli(run, engine: str, steps: int, sets=()):
    """`python -m compactionrl_fast train --engine ENGINE` on the tiny demo model in a fresh process (threads 1,
    the guard at its default 1e-3) into `run`; asserts it succeeds and returns its metrics rows."""
    cmd = [sys.executable, "-m", "compactionrl_fast", "train", "--engine", engine, "--run-dir", str(run),
           "--steps", str(steps), "--value-pretrain-steps", "1", "--rollouts-per-step", "8", "--actor-lr", "1e-3",
           "--critic-lr", "1e-3", "--threads", "1", "--progress", "false", "--checkpoint-every", "0",
           "--set", "model.hidden_size=64", "--set", "model.num_heads=2", "--set", "sft.steps=5",
           "--set", "rollout.truncated_reward=-1", *[a for kv in sets for a in ("--set", kv)]]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
