"""TransformersEngine: the embedded default. Batched sampling with a KV cache from any Hugging Face causal
LM, on CPU or GPU, with exact float32 log-probs of the sampled tokens.

transformers is imported lazily (only `from_pretrained` needs it; a model object can be passed in).
"""
from __future__ import annotations

import inspect

import torch

from .base import Engine, Generation, caps_list


def sample_tokens(logits, temperature: float, top_p: float, generator=None):
    """Sample one token per row. logits: [B, V] (any float dtype).

    Returns (tokens [B] int64, logprobs [B] float32) where logprobs = log_softmax(logits / T)[token]
    (T = 1 when greedy), the distribution before top-p truncation.
    """
    logits = logits.float()
    if temperature <= 0:
        lp = torch.log_softmax(logits, dim=-1)
        tok = lp.argmax(dim=-1)
        return tok, lp.gather(1, tok[:, None])[:, 0]
    lp = torch.log_softmax(logits / temperature, dim=-1)
    probs = lp.exp()
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p  # the top token is always kept
        probs = torch.zeros_like(probs).scatter_(1, si, sp * keep)
    tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tok, lp.gather(1, tok[:, None])[:, 0]


class TransformersEngine(Engine):
    """Generation engine around a Hugging Face causal LM (`model(input_ids, attention_mask, position_ids,
    cache)`), e.g. LlamaForCausalLM / Qwen2ForCausalLM.

    The model object may be shared with the trainer (then no weight copy is needed); generation runs under
    no_grad in eval mode and restores the model's training flag afterwards.

    Args:
        model: the causal LM (already on its device).
        pad_token_id: id fed in padded positions (never attended to).
        max_batch_size: prompts are processed in chunks of at most this many rows (None: all at once).

    Example:
        >>> eng = TransformersEngine(model)                              # doctest: +SKIP
        >>> out = eng.generate([[3, 6, 2, 5]], 8, stop_token_ids=[2])   # doctest: +SKIP
        >>> out[0].token_ids, out[0].logprobs, out[0].finish_reason     # doctest: +SKIP
    """

    def __init__(self, model, *, pad_token_id: int = 0, max_batch_size: int | None = None):
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs):
        """Load a local checkpoint directory with AutoModelForCausalLM."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        pad = getattr(model.config, "pad_token_id", None)
        return cls(model, pad_token_id=pad if pad is not None else 0, **kwargs)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def load_weights(self, state_dict, strict: bool = True) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=strict)

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    def _forward(self, ids, mask, pos, cache, last_only):
        kw = {self._cache_kw: cache, "use_cache": True}
        if last_only and self._keep_kw:
            kw[self._keep_kw] = 1
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw).logits
        return logits[:, -1]

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None):
        caps = caps_list(max_new_tokens, len(prompts))
        out = [Generation([], [], "length") for _ in prompts]
        rows = [i for i, c in enumerate(caps) if c > 0]
        if any(len(prompts[i]) == 0 for i in rows):
            raise ValueError("prompts must be non-empty")
        gen = torch.Generator(self.device).manual_seed(int(seed)) if seed is not None else None
        chunk = self.max_batch_size or max(len(rows), 1)
        was_training = self.model.training
        self.model.eval()
        try:
            for c0 in range(0, len(rows), chunk):
                idx = rows[c0:c0 + chunk]
                res = self._generate_batch([prompts[i] for i in idx], [caps[i] for i in idx], float(temperature),
                                           float(top_p), stop_token_ids, gen)
                for i, g in zip(idx, res):
                    out[i] = g
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, prompts, caps, temperature, top_p, stop_token_ids, gen):
        dev, B = self.device, len(prompts)
        L = max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token goes in the same column
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, L - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(1) - 1).clamp_(min=0)
        cap_t = torch.tensor(caps, device=dev)
        stops = torch.tensor(sorted(set(int(t) for t in stop_token_ids)) or [-1], device=dev)
        maxcap = max(caps)
        toks = torch.full((B, maxcap), -1, dtype=torch.long, device=dev)
        lps = torch.zeros((B, maxcap), dtype=torch.float32, device=dev)
        n_out = torch.zeros(B, dtype=torch.long, device=dev)
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        active = torch.arange(B, device=dev)  # output row of each cache row
        alive = torch.ones(B, dtype=torch.bool, device=dev)  # cache rows still generating
        cache = self._new_cache()
        logits = self._forward(ids, mask, pos, cache, last_only=True)
        next_pos = pos[:, -1] + 1
        for step in range(maxcap):
            tok, lp = sample_tokens(logits, temperature, top_p, gen)
            rows = active[alive]
            toks[rows, step] = tok[alive]
            lps[rows, step] = lp[alive]
            n_out[rows] = step + 1
            hit = alive & torch.isin(tok, stops)
            stopped[active[hit]] = True
            alive = alive & ~hit & (cap_t[active] > step + 1)
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if n_alive <= alive.numel() // 2:  # drop finished rows from the batch and the cache
                keep = alive.nonzero()[:, 0]
                cache.batch_select_indices(keep)
                active, alive, tok, mask, next_pos = active[keep], alive[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self._forward(tok[:, None], mask, next_pos[:, None], cache, last_only=False)
            next_pos = next_pos + 1
        n_out, stopped = n_out.tolist(), stopped.tolist()
        toks, lps = toks.tolist(), lps.tolist()
        return [Generation(toks[b][:n_out[b]], lps[b][:n_out[b]], "stop" if stopped[b] else "length")
                for b in range(B)]
