"""Actor and critic (Hugging Face causal LMs) and their packed forward over a `PackedBatch`.

The actor is a causal LM. The critic is an independent copy of the actor's decoder plus a scalar value
head (`value_head`), initialised from the actor. Both run over the packed batch: the attention
sequences (`cu_attn`) are padded into [A, Lmax] with a key-padding mask on CPU (measured the fastest
option for short sequences there), or run packed with flash-attention varlen (position ids) on GPU
when the model was built with `attn_implementation="flash_attention_2"`.

The log-prob and value of token t come from the hidden state at position t-1 of the same attention
sequence (the state before the action), so only trainable tokens are ever sent through the heads.
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import torch
from torch import nn

from .config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(cfg: ModelConfig, vocab_size: int, *, pad_token_id=None, bos_token_id=None, eos_token_id=None):
    """A small Llama or Qwen2 config of the sizes in `cfg` for a vocabulary of `vocab_size`."""
    from transformers import LlamaConfig, Qwen2Config

    kw = dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_positions,
              tie_word_embeddings=cfg.tie_embeddings, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
              eos_token_id=eos_token_id)
    if cfg.arch == "llama":
        return LlamaConfig(**kw)
    if cfg.arch == "qwen2":
        return Qwen2Config(**kw)
    raise ValueError(f"model.arch must be 'llama' or 'qwen2', got {cfg.arch!r}")


def default_attn_implementation(device) -> str:
    """flash_attention_2 on CUDA where flash-attn is installed, else SDPA."""
    if torch.device(device).type == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return "sdpa"


def build_actor(cfg: ModelConfig, vocab_size: int = None, *, device="cpu", attn_implementation=None, **token_ids):
    """The actor: `cfg.pretrained` loaded from Hugging Face, or a fresh model from `hf_config`."""
    from transformers import AutoModelForCausalLM

    attn = attn_implementation or default_attn_implementation(device)
    dtype = DTYPES[cfg.dtype]
    if cfg.pretrained:
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained, dtype=dtype, attn_implementation=attn)
    else:
        if vocab_size is None:
            raise ValueError("vocab_size is needed to build a fresh model (model.pretrained is not set)")
        model = AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size, **token_ids), dtype=dtype,
                                                 attn_implementation=attn)
    return model.to(device)


class Critic(nn.Module):
    """Decoder of the actor's architecture plus a scalar value head: `weight` [H], `bias` [1]."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        p = next(backbone.parameters())
        # zero head: the critic starts predicting 0 and value pre-training fits it
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=p.dtype, device=p.device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=p.dtype, device=p.device))

    @property
    def config(self):
        return self.backbone.config


def critic_from_actor(actor) -> Critic:
    """An independent critic initialised from the actor's decoder weights."""
    backbone = copy.deepcopy(actor.get_decoder())
    return Critic(backbone, actor.config.hidden_size)


def decoder(model) -> nn.Module:
    return model.backbone if isinstance(model, Critic) else model.get_decoder()


# ----------------------------------------------------------------------------------------------
# packed forward


def packed_hidden(model, input_ids, position_ids, cu_attn, *, positions=None, pad_ratio=0.8, tables=None):
    """Last hidden states of the decoder of `model` (actor or critic) over packed sequences: [T, H], or
    [N, H] at the packed `positions` [N] (then the last layer's residual MLP and the final norm run only there:
    `_decoder_at`).

    On the padded path, sequences are sorted by length and run in buckets padded to their longest
    (at most 1 - pad_ratio of a bucket is padding; one call when lengths are alike).

    Args:
        input_ids: [T] int64; position_ids: [T] int64 (0 at the start of each attention sequence);
        cu_attn: [A+1] int64 attention-sequence offsets.
        positions: [N] int64, distinct, in [0, T); None for all.
        tables: `forward_tables(cu_attn, pad_ratio, positions)` built beforehand (on the host: no host read
            here); None builds them.
    """
    dec = decoder(model)
    T = input_ids.numel()
    if getattr(dec.config, "_attn_implementation", "") == "flash_attention_2":
        # one packed row: HF derives the varlen boundaries from the position-id restarts
        inputs = dict(input_ids=input_ids[None], position_ids=position_ids[None])
        if positions is None:
            return dec(**inputs, use_cache=False).last_hidden_state[0]
        return _decoder_at(dec, torch.zeros_like(positions), positions, **inputs)
    n_out = T if positions is None else positions.numel()
    out = None
    for b in forward_tables(cu_attn, pad_ratio, positions) if tables is None else tables:
        if positions is not None and b.keep is None:
            raise ValueError("packed_hidden: `tables` were built without positions; build them with "
                             "forward_tables(cu_attn, pad_ratio, positions)")
        if positions is not None and b.keep.numel() == 0:  # no wanted position in this bucket (a host-known shape)
            continue
        A, L = b.mask.shape
        ids = input_ids.new_zeros(A, L).index_put_((b.seq, b.col), input_ids[b.tok])
        pos = position_ids.new_zeros(A, L).index_put_((b.seq, b.col), position_ids[b.tok])
        inputs = dict(input_ids=ids, attention_mask=b.mask, position_ids=pos)
        if positions is None:
            h, dst = dec(**inputs, use_cache=False).last_hidden_state[b.seq, b.col], b.tok
        else:
            queries = None if b.qcol is None else (b.qcol, b.qflat)
            h, dst = _decoder_at(dec, b.seq[b.keep], b.col[b.keep], queries=queries, **inputs), b.slot
        if out is None:
            out = h.new_zeros(n_out, h.shape[-1])
        out = out.index_copy(0, dst, h)
    return out if out is not None else input_ids.new_zeros(n_out, dec.config.hidden_size, dtype=torch.float32)


class _LastLayerInputs(Exception):
    """Stops a decoder's forward at its last layer, carrying that layer's (args, kwargs)."""


# decoder layers known to be pre-norm residual blocks: h + attn(norm1(h)), then r + mlp(norm2(r))
_PRE_NORM_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")


def _decoder_at(dec, seq, col, queries=None, **inputs):
    """Hidden states [n, H] at (seq [n], col [n]) of the decoder's output on the HF `inputs` ([rows, width]).

    The heads read a few positions (the states before trainable tokens), and only the last layer's keys and
    values need every position. So HF runs every layer but the last (its mask and rotary embeddings as it builds
    them, captured at the last layer's call), and the last layer computes its keys and values at every position
    but its queries, attention, residual MLP and final norm only at (seq, col) (`_attention_at`; with
    `queries` = (qcol [rows, Q], qflat [n]) of `forward_tables` and SDPA attention, else its attention runs on
    every position). Other decoder layers: the full forward, then the selection."""
    last = dec.layers[-1]
    if type(last).__name__ not in _PRE_NORM_LAYERS:
        return dec(**inputs, use_cache=False).last_hidden_state[seq, col]

    def stop(module, args, kwargs):
        raise _LastLayerInputs(args, kwargs)

    handle = last.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        dec(**inputs, use_cache=False)
        raise RuntimeError("the decoder's forward did not call its last layer")
    except _LastLayerInputs as e:
        args, kwargs = e.args
    finally:
        handle.remove()
    h = args[0] if args else kwargs.pop("hidden_states")
    x = last.input_layernorm(h)
    attn = last.self_attn
    if queries is not None and _selectable(attn):
        a = _attention_at(attn, x, kwargs["position_embeddings"], *queries)
    else:  # the layer hands its keyword arguments (mask, rotary embeddings, position ids, cache) to its attention
        a = attn(hidden_states=x, **kwargs)[0][seq, col]
    r = h[seq, col] + a
    return dec.norm(r + last.mlp(last.post_attention_layernorm(r)))


def _selectable(attn) -> bool:
    """Whether `_attention_at` computes what this Llama/Qwen2 attention does: SDPA, a full (not sliding-window)
    causal window."""
    return attn.config._attn_implementation == "sdpa" and not getattr(attn, "sliding_window", None)


def _attention_at(attn, x, position_embeddings, qcol, qflat):
    """The attention block's output [n, H] (after o_proj) at the queries (row a, column qcol[a, j]) picked by
    `qflat` [n] (flat indices into [rows, Q]), with keys and values at every position of `x` [rows, L, H]:
    what `attn(x)[seq, col]` gives, with the queries' projections and attention on n + padding rows, not
    rows x L. `position_embeddings`: (cos, sin) [rows, L, head_dim] as HF built them. Padding entries of qcol
    (0) are real queries whose output is dropped."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..rollout.engines.lean_decoder import apply_rope

    A, L, _ = x.shape
    Q, d = qcol.shape[1], attn.head_dim
    rows = torch.arange(A, device=x.device)[:, None]
    cos, sin = position_embeddings  # [rows, L, d]; unsqueeze(1): the same table for every head
    q = apply_rope(attn.q_proj(x[rows, qcol]).view(A, Q, -1, d).transpose(1, 2), cos[rows, qcol].unsqueeze(1),
                   sin[rows, qcol].unsqueeze(1))
    k = apply_rope(attn.k_proj(x).view(A, L, -1, d).transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))
    v = attn.v_proj(x).view(A, L, -1, d).transpose(1, 2)
    # causal within the row: HF's mask at these query rows (a row's padding comes after its real tokens)
    mask = torch.arange(L, device=x.device) <= qcol[..., None]
    o, _ = sdpa_attention_forward(attn, q, k, v, mask[:, None], scaling=attn.scaling,
                                  dropout=attn.attention_dropout if attn.training else 0.0)
    return attn.o_proj(o.reshape(A * Q, -1)[qflat])


class Bucket(NamedTuple):
    """One call of the padded forward (`forward_tables`): its n tokens go to (seq [n], col [n]) of the padded
    [rows, width] input, from packed positions tok [n]; mask [rows, width] int64 (1: a real token). With
    positions: keep [m] (the bucket's tokens among them, indices into its n, in (row, column) order), slot [m]
    (their places in `positions`), and the queries of the last layer laid out by row: qcol [rows, Q] (their
    columns, 0 past a row's count), qflat [m] (their flat indices into [rows, Q]); else these are None."""
    seq: torch.Tensor
    col: torch.Tensor
    tok: torch.Tensor
    mask: torch.Tensor
    keep: Optional[torch.Tensor] = None
    slot: Optional[torch.Tensor] = None
    qcol: Optional[torch.Tensor] = None
    qflat: Optional[torch.Tensor] = None


def forward_tables(cu_attn, pad_ratio=0.8, positions=None) -> list:
    """The padded forward's index tables of the attention sequences `cu_attn` [A+1]: one `Bucket` per call.
    `positions` [N]: the packed positions whose hidden states are wanted (None: all). Empty sequences are left
    out (they would give fully masked rows). Reads cu_attn and positions on the host: build them where they
    live there."""
    lens = cu_attn.diff().long()
    order = torch.argsort(lens, descending=True, stable=True)
    order = order[lens[order] > 0]
    dev = cu_attn.device
    if positions is not None:  # the slot in positions of each packed position, -1 where it is not wanted
        at = torch.full((int(cu_attn[-1]),), -1, dtype=torch.long, device=dev)
        at[positions] = torch.arange(positions.numel(), device=dev)
    out = []
    for a, b in _buckets(lens[order].tolist(), pad_ratio):
        sel = order[a:b]
        starts, ln = cu_attn[:-1].long()[sel], lens[sel]
        A, L, n = ln.numel(), int(ln.max()), int(ln.sum())
        seq = torch.repeat_interleave(torch.arange(A, device=dev), ln, output_size=n)
        col = torch.arange(n, device=dev) - (torch.cumsum(ln, 0) - ln)[seq]
        mask = torch.zeros(A, L, dtype=torch.long, device=dev).index_put_((seq, col), torch.ones_like(col))
        tok = starts[seq] + col
        if positions is None:
            out.append(Bucket(seq, col, tok, mask))
            continue
        keep = (at[tok] >= 0).nonzero()[:, 0]
        row = seq[keep]  # ascending: the bucket's tokens are in (row, column) order
        count = torch.bincount(row, minlength=A)
        Q = int(count.max()) if keep.numel() else 0
        qflat = row * Q + torch.arange(keep.numel(), device=dev) - (torch.cumsum(count, 0) - count)[row]
        qcol = torch.zeros(A * Q, dtype=torch.long, device=dev).index_put_((qflat,), col[keep]).view(A, Q)
        out.append(Bucket(seq, col, tok, mask, keep, at[tok[keep]], qcol, qflat))
    return out


def _buckets(lens_desc, ratio):
    """Row ranges of sequences sorted by length (descending), a new range whenever a sequence is shorter
    than `ratio` x the range's longest: bounds the padding at 1 - ratio per call."""
    out, start = [], 0
    for i, n in enumerate(lens_desc):
        if n < ratio * lens_desc[start]:
            out.append((start, i))
            start = i
    if lens_desc:
        out.append((start, len(lens_desc)))
    return out


def action_index(loss_mask, cu_attn):
    """Positions [N] of the trainable tokens; raise if one starts an attention sequence (no state before it)."""
    idx = loss_mask.nonzero()[:, 0]
    starts = cu_attn[:-1][cu_attn.diff() > 0]
    if idx.numel() and bool(torch.isin(idx, starts).any()):
        raise ValueError("loss_mask is True on the first token of an attention sequence: nothing predicts it")
    return idx


def actor_logprobs(actor, batch, idx, *, temperature=1.0, return_entropy=False, tables=None):
    """Log-probs [N] (and entropies [N]) of the tokens at positions `idx` under the actor, via `linear_logprobs`;
    `tables`: see `packed_hidden`."""
    from ..ops import linear_logprobs

    hidden = packed_hidden(actor, batch.input_ids, batch.position_ids, batch.cu_attn, positions=idx - 1, tables=tables)
    head = actor.get_output_embeddings()
    return linear_logprobs(hidden, head.weight, batch.input_ids[idx], bias=head.bias,
                           temperature=temperature, return_entropy=return_entropy)


def critic_hidden(critic, batch, idx, tables=None):
    """Hidden states [N, H] of the states before the tokens at positions `idx` (input of the value head)."""
    return packed_hidden(critic, batch.input_ids, batch.position_ids, batch.cu_attn, positions=idx - 1, tables=tables)


def critic_values(critic, batch, idx):
    """Values [N] float32 of the states before the tokens at positions `idx`, via `value_head`."""
    from ..ops import value_head

    return value_head(critic_hidden(critic, batch, idx), critic.weight, critic.bias)
