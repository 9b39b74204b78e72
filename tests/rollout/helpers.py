"""Test helpers for the rollout runtime: a scripted engine that records its calls, simple environments,
and a fresh forward over a packed batch."""
from __future__ import annotations

import asyncio

import torch

from compactionrl_fast.rollout.engines.base import Engine, Generation, caps_list


class FixedEngine(Engine):
    """Answers every act request with `act` and every summary request with `summary` (words of the
    tokenizer), each followed by EOS; records (prompt, completion) pairs."""

    def __init__(self, tokenizer, act="next", summary="seen 1 2", summary_word="summarize"):
        self.tok, self.calls = tokenizer, []
        self.act = tokenizer.encode(act, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.summary = tokenizer.encode(summary, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.summary_id = tokenizer.convert_tokens_to_ids(summary_word)

    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        out = []
        for p, cap in zip(prompts, caps_list(max_new_tokens, len(prompts))):
            ids = self.summary if self.summary_id in p[-4:] else self.act
            g = Generation(ids[:cap], [-0.5] * min(cap, len(ids)), "stop" if cap >= len(ids) else "length")
            self.calls.append((list(p), g))
            out.append(g)
        return out


class ListEnv:
    """Observation i is `obs[i]`; done (reward 1) after the last one; optional failure at a step."""

    def __init__(self, obs, fail_at=None, fail_reset=False, task="collect digits"):
        self.obs, self.fail_at, self.fail_reset, self.task = list(obs), fail_at, fail_reset, task

    def reset(self, seed):
        if self.fail_reset:
            raise RuntimeError("reset exploded")
        self.i = 0
        return "memory", self.task

    def step(self, action):
        if self.fail_at is not None and self.i == self.fail_at:
            raise KeyError("step exploded")
        o = self.obs[self.i]
        self.i += 1
        done = self.i == len(self.obs)
        return o, done, 1.0 if done else 0.0


class AsyncListEnv(ListEnv):
    async def reset(self, seed):
        await asyncio.sleep(0)
        return ListEnv.reset(self, seed)

    async def step(self, action):
        await asyncio.sleep(0)
        return ListEnv.step(self, action)


@torch.no_grad()
def packed_logprobs(model, batch):
    """float32 [T]: log-prob of each token given the earlier tokens of its attention sequence (fresh
    forward of every attention sequence on its own; 0 at the first token of a sequence)."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32)
    for a0, a1 in zip(batch.cu_attn[:-1].tolist(), batch.cu_attn[1:].tolist()):
        ids = batch.input_ids[a0:a1]
        logits = model(input_ids=ids[None], position_ids=batch.position_ids[a0:a1][None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
        out[a0 + 1:a1] = lp
    return out


class Recorder(Engine):
    """Wraps an engine and records every (prompt, Generation) pair."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, prompts, max_new_tokens, **kw):
        out = self.inner.generate(prompts, max_new_tokens, **kw)
        self.calls.extend((list(p), g) for p, g in zip(prompts, out))
        return out


def check_fidelity(rollouts, calls, atol=1e-6):
    """Every segment's loss mask is exactly the union of the spans that recorded completions occupy in it
    (prompt = the segment's prefix, completion = the next tokens), with the recorded log-probs. A summary's
    shared prefix (its window's tokens) is the exec segment's: nothing in it is trainable in the summary."""
    for ro in rollouts:
        for s in ro.segments:
            mask = [False] * len(s)
            lps = [0.0] * len(s)
            for p, g in calls:
                n, m = len(p), len(g.token_ids)
                if m and s.shared_prefix <= n and n + m <= len(s) and s.input_ids[n:n + m] == g.token_ids and s.input_ids[:n] == p:
                    mask[n:n + m] = [True] * m
                    lps[n:n + m] = g.logprobs
            assert mask == list(s.loss_mask), f"{s.kind} segment: loss mask differs from the sampled spans"
            assert max((abs(a - b) for a, b in zip(lps, s.logprobs)), default=0.0) <= atol
