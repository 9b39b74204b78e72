"""TransformersEngine: the embedded default. Batched sampling with a KV cache from any Hugging Face causal
LM, on CPU or GPU, with exact float32 log-probs of the sampled tokens.

Prefix reuse: when a prompt carries a `cache_key` (the loop passes the rollout's index), the KV of that
key's previous prompt + completion is kept and only the prompt's new tokens are prefilled next time (a
turn adds ~20 tokens to a ~100-token context). Cached KV is dropped when the weights change (load_weights,
or any in-place update of a parameter, detected through the parameters' version counters).

transformers is imported lazily (only `from_pretrained` and the cache need it).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from . import lean_decoder
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


@dataclass
class _Cached:
    seq: list  # tokens whose KV is stored (prompt + completion minus its last token)
    src: list  # the batch cache's per-layer (keys [B, H, L, D], values) holding this row
    row: int  # row in src
    cols: torch.Tensor  # [len(seq)] columns of src holding the tokens of seq, in order


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on list-slice equality (C speed) for the first mismatch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TransformersEngine(Engine):
    """Generation engine around a Hugging Face causal LM (`model(input_ids, attention_mask, position_ids,
    cache)`), e.g. LlamaForCausalLM / Qwen2ForCausalLM, with sdpa or eager attention.

    The model object may be shared with the trainer (then no weight copy is needed); generation runs under
    no_grad in eval mode and restores the model's training flag afterwards.

    Args:
        model: the causal LM (already on its device).
        pad_token_id: id fed in padded positions (never attended to).
        max_batch_size: prompts are processed in chunks of at most this many rows (None: all at once).
        prefix_cache: keep per-key KV between calls (see the module docstring); the last call's KV stays
            in memory until the next call, `clear_cache()` or `sleep()`.
        lean: use the lean Llama-style forward (engines/lean_decoder.py) when the model supports it
            (default); False always uses the model's own forward with a DynamicCache.

    Example:
        >>> eng = TransformersEngine(model)                              # doctest: +SKIP
        >>> out = eng.generate([[3, 6, 2, 5]], 8, stop_token_ids=[2])   # doctest: +SKIP
        >>> out[0].token_ids, out[0].logprobs, out[0].finish_reason     # doctest: +SKIP
    """

    def __init__(self, model, *, pad_token_id: int = 0, max_batch_size: int | None = None, prefix_cache: bool = True,
                 lean: bool = True):
        self.model = model
        self.lean = bool(lean) and lean_decoder.supports(model)
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self.prefix_cache = prefix_cache
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self._store, self._store_version = {}, None

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

    def shares_weights(self, model) -> bool:
        return model is self.model

    def load_weights(self, state_dict, strict: bool = True) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=strict)
        self.clear_cache()

    def clear_cache(self) -> None:
        self._store, self._store_version = {}, None

    def sleep(self) -> None:
        self.clear_cache()

    def _weights_version(self):
        return tuple(p._version for p in self.model.parameters()) + (self.device, self.model.dtype)

    # -- cache plumbing (our KVCache, or DynamicCache across transformers versions) --
    def _make_cache(self, pairs=None, batch=0, capacity=0):
        if self.lean:
            return lean_decoder.KVCache(self.model, batch, capacity, pairs)
        from transformers import DynamicCache

        if pairs is None:
            try:
                return DynamicCache(config=self.model.config)
            except TypeError:  # older transformers
                return DynamicCache()
        try:
            return DynamicCache(ddp_cache_data=pairs)
        except TypeError:
            return DynamicCache.from_legacy_cache(tuple(pairs))

    @staticmethod
    def _layers(cache):
        if isinstance(cache, lean_decoder.KVCache):
            return cache.layers
        if hasattr(cache, "layers"):
            return [(layer.keys, layer.values) for layer in cache.layers]
        return list(zip(cache.key_cache, cache.value_cache))

    def _forward(self, ids, mask, pos, cache, last_only):
        if self.lean:
            return lean_decoder.forward(self.model, ids, mask, pos, cache, last_only)
        kw = {self._cache_kw: cache, "use_cache": True}
        if last_only and self._keep_kw:
            kw[self._keep_kw] = 1
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw).logits
        return logits[:, -1]

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, *, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=None,
                 cache_keys=None):
        """See Engine.generate. cache_keys: optional hashable per prompt naming the conversation it continues
        (e.g. the rollout index); the KV of that key's previous prompt + completion is reused."""
        caps = caps_list(max_new_tokens, len(prompts))
        if cache_keys is not None and len(cache_keys) != len(prompts):
            raise ValueError("cache_keys must have one entry per prompt")
        out = [Generation([], [], "length") for _ in prompts]
        rows = [i for i, c in enumerate(caps) if c > 0]
        if any(len(prompts[i]) == 0 for i in rows):
            raise ValueError("prompts must be non-empty")
        gen = torch.Generator(self.device).manual_seed(int(seed)) if seed is not None else None
        if not self.prefix_cache or self._store_version != self._weights_version():
            self._store = {}
        old, self._store = self._store, {}
        chunk = self.max_batch_size or max(len(rows), 1)
        was_training = self.model.training
        self.model.eval()
        try:
            for c0 in range(0, len(rows), chunk):
                idx = rows[c0:c0 + chunk]
                keys = [cache_keys[i] if cache_keys is not None and self.prefix_cache else None for i in idx]
                res = self._generate_batch([list(prompts[i]) for i in idx], [caps[i] for i in idx], float(temperature),
                                           float(top_p), stop_token_ids, gen, keys, old)
                for i, g in zip(idx, res):
                    out[i] = g
        finally:
            self.model.train(was_training)
        self._store_version = self._weights_version()
        return out

    def _start(self, prompts, keys, old, maxcap):
        """Build the batch's first forward: reused KV (right-aligned) + the new tokens (left-padded).

        Returns (ids [B, S], mask [B, P+S], pos [B, S], cache)."""
        dev, B = self.device, len(prompts)
        reuse = []
        for p, key in zip(prompts, keys):
            ent = old.get(key) if key is not None else None
            n = min(_common_prefix(ent.seq, p), len(p) - 1) if ent is not None else 0
            reuse.append((n, ent))
        P = max(n for n, _ in reuse)
        S = max(len(p) - n for p, (n, _) in zip(prompts, reuse))
        pad = self.pad_token_id
        ids, mask, pos = [], [], []
        for p, (n, _) in zip(prompts, reuse):
            s = len(p) - n
            ids.append([pad] * (S - s) + p[n:])
            mask.append([0] * (P - n) + [1] * n + [0] * (S - s) + [1] * s)
            pos.append([0] * (S - s) + list(range(n, len(p))))
        pairs = None
        if P > 0:
            groups = {}  # reused rows grouped by the cache tensors they come from
            for b, (n, ent) in enumerate(reuse):
                if n > 0:
                    groups.setdefault(id(ent.src), []).append((b, n, ent))
            first = next(iter(groups.values()))[0][2].src
            pairs = [(k.new_zeros((B, k.shape[1], P, k.shape[3])), v.new_zeros((B, v.shape[1], P, v.shape[3])))
                     for k, v in first]
            for members in groups.values():
                src = members[0][2].src
                ns = torch.tensor([n for _, n, _ in members], device=dev)
                G = len(members)
                # index [G, P]: target column P-n+j of a row reads source column cols[j] (0 in padding)
                idx = torch.zeros((G, P), dtype=torch.long, device=dev)
                start = torch.arange(G, device=dev) * P + P - ns
                within = torch.arange(int(ns.sum()), device=dev) - (ns.cumsum(0) - ns).repeat_interleave(ns)
                idx.view(-1)[start.repeat_interleave(ns) + within] = torch.cat([e.cols[:n] for _, n, e in members])
                rows_src = torch.tensor([e.row for _, _, e in members], device=dev)
                rows_dst = torch.tensor([b for b, _, _ in members], device=dev)
                for (k, v), (ks, vs) in zip(pairs, src):  # [G, P, H, D] -> rows of [B, H, P, D]
                    k[rows_dst] = ks[rows_src[:, None], :, idx].transpose(1, 2)
                    v[rows_dst] = vs[rows_src[:, None], :, idx].transpose(1, 2)
        cache = self._make_cache(pairs, B, P + S + maxcap)
        as_t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        return as_t(ids), as_t(mask), as_t(pos), cache

    def _save(self, cache, mask, cache_rows, out_rows, prompts, keys, toks, n_out):
        """Store, per key, where the KV of its fed tokens is (the last sample was not fed)."""
        src = self._layers(cache)
        cols = mask.nonzero()[:, 1].split(mask.sum(1).tolist())  # per cache row: its non-padded columns
        for r, o in zip(cache_rows.tolist(), out_rows.tolist()):
            if keys[o] is None:
                continue
            fed = len(prompts[o]) + n_out[o] - 1
            self._store[keys[o]] = _Cached(prompts[o] + toks[o][:n_out[o] - 1], src, r, cols[r][:fed])

    def _generate_batch(self, prompts, caps, temperature, top_p, stop_token_ids, gen, keys, old):
        dev, B = self.device, len(prompts)
        ids, mask, pos, cache = self._start(prompts, keys, old, max(caps))
        cap_t = torch.tensor(caps, device=dev)
        stops = torch.tensor(sorted(set(int(t) for t in stop_token_ids)) or [-1], device=dev)
        maxcap = max(caps)
        toks = torch.full((B, maxcap), -1, dtype=torch.long, device=dev)
        lps = torch.zeros((B, maxcap), dtype=torch.float32, device=dev)
        n_out = torch.zeros(B, dtype=torch.long, device=dev)
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        active = torch.arange(B, device=dev)  # output row of each cache row
        alive = torch.ones(B, dtype=torch.bool, device=dev)  # cache rows still generating
        saving = any(k is not None for k in keys)
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
                if saving:
                    gone = (~alive).nonzero()[:, 0]
                    self._save(cache, mask, gone, active[gone], prompts, keys, toks.tolist(), n_out.tolist())
                keep = alive.nonzero()[:, 0]
                cache.batch_select_indices(keep)
                active, alive, tok, mask, next_pos = active[keep], alive[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self._forward(tok[:, None], mask, next_pos[:, None], cache, last_only=False)
            next_pos = next_pos + 1
        n_out, stopped, toks, lps = n_out.tolist(), stopped.tolist(), toks.tolist(), lps.tolist()
        if saving:
            self._save(cache, mask, torch.arange(active.numel()), active, prompts, keys, toks, n_out)
        return [Generation(toks[b][:n_out[b]], lps[b][:n_out[b]], "stop" if stopped[b] else "length")
                for b in range(B)]
