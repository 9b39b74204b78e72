"""Packed forward of actor and critic equals the per-sequence forward; heads read position t-1; the forward at
chosen positions (the last layer's MLP only there) equals the full one."""
import pytest
import torch

from compactionrl_fast.train import model as M
from compactionrl_fast.train.config import ModelConfig
from compactionrl_fast.train.model import (action_index, actor_logprobs, build_actor, critic_from_actor,
                                           critic_values, forward_tables, packed_hidden)

from ._tiny import hand_batch, tiny_models


def test_packed_hidden_matches_per_sequence():
    actor, critic = tiny_models()
    b = hand_batch()
    for model in (actor, critic):
        h = packed_hidden(model, b.input_ids, b.position_ids, b.cu_attn)
        dec = model.backbone if model is critic else model.get_decoder()
        cu = b.cu_attn.tolist()
        for a0, a1 in zip(cu[:-1], cu[1:]):
            ref = dec(input_ids=b.input_ids[a0:a1][None]).last_hidden_state[0]
            torch.testing.assert_close(h[a0:a1], ref, atol=1e-5, rtol=1e-5)


def test_actor_logprobs_are_next_token_logprobs():
    actor, _ = tiny_models()
    b = hand_batch()
    idx = action_index(b.loss_mask, b.cu_attn)
    lp, ent = actor_logprobs(actor, b, idx, temperature=0.7, return_entropy=True)
    cu = b.cu_attn.tolist()
    ref = torch.zeros(b.input_ids.numel())
    ref_ent = torch.zeros(b.input_ids.numel())
    for a0, a1 in zip(cu[:-1], cu[1:]):
        logits = actor(input_ids=b.input_ids[a0:a1][None]).logits[0].double() / 0.7
        logp = torch.log_softmax(logits, -1)
        ref[a0 + 1:a1] = logp[:-1].gather(1, b.input_ids[a0 + 1:a1, None])[:, 0].float()
        ref_ent[a0 + 1:a1] = (-(logp.exp() * logp).sum(-1))[:-1].float()
    torch.testing.assert_close(lp, ref[idx], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent[idx], atol=1e-5, rtol=1e-5)


def test_critic_values_start_at_zero_and_have_gradients():
    _, critic = tiny_models()
    b = hand_batch()
    idx = action_index(b.loss_mask, b.cu_attn)
    v = critic_values(critic, b, idx)
    assert v.dtype == torch.float32 and v.shape == idx.shape and bool((v == 0).all())
    v.sum().backward()
    assert critic.weight.grad is not None and critic.weight.grad.abs().sum() > 0


def test_trainable_first_token_is_rejected():
    b = hand_batch()
    b.loss_mask[0] = True
    with pytest.raises(ValueError, match="first token"):
        action_index(b.loss_mask, b.cu_attn)


def _varlen(seed=0, lens=(7, 0, 1, 12, 30, 3, 1, 9)):
    """Packed inputs of attention sequences of `lens` (empty, single-token, long ones; several buckets)."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *lens]).cumsum(0)
    ids = torch.randint(0, 34, (int(cu[-1]),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    return ids, pos, cu, g


def _assert_at_positions_equal_full(model, ids, pos, cu, p, g, *more):
    """packed_hidden(positions=p) (and with each of `more`'s keyword sets) equals packed_hidden()[p] in float64:
    the hidden states and every parameter's gradient under a random weighting drawn from `g`."""
    w = torch.randn(p.numel(), model.config.hidden_size, generator=g, dtype=torch.float64)
    out = []
    for kw in (dict(), dict(positions=p), *more):
        model.zero_grad()
        h = packed_hidden(model, ids, pos, cu, **kw)
        h = h[p] if not kw else h
        (h * w).sum().backward()
        out.append((h.detach(), [q.grad.clone() for q in model.parameters() if q.grad is not None]))
    for h, grads in out[1:]:
        torch.testing.assert_close(h, out[0][0], rtol=1e-12, atol=1e-12)
        assert len(grads) == len(out[0][1])
        for a, b in zip(grads, out[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layers", [1, 2])
def test_hidden_at_positions_equals_the_full_forward_float64(arch, layers):
    """packed_hidden(positions=p) = packed_hidden()[p], values and every parameter's gradient, in float64, with
    p in random order, missing whole buckets (the 1-token sequences) and both layer counts."""
    torch.manual_seed(1)
    cfg = ModelConfig(arch=arch, hidden_size=16, num_layers=layers, num_heads=2, intermediate_size=32,
                      max_positions=64)
    actor = build_actor(cfg, 34).double()
    for model in (actor, critic_from_actor(actor)):
        ids, pos, cu, g = _varlen()
        p = torch.tensor([0, 6, 8, 14, 19, 20, 35, 49, 50, 51, 54, 62])[torch.randperm(12, generator=g)]
        assert len(forward_tables(cu)) > 1 and all(int(cu[i]) not in p.tolist() for i in (2, 6))  # 1-token rows
        _assert_at_positions_equal_full(model, ids, pos, cu, p, g, dict(positions=p, tables=forward_tables(cu, 0.8, p)))


def test_the_last_layers_queries_and_mlp_run_only_at_the_positions():
    """What makes the forward at positions cheaper: the last layer's MLP sees N rows and its query projection
    N + padding rows (by row), not every padded token, while its keys see every token; a decoder layer of unknown
    structure runs whole (same numbers)."""
    torch.manual_seed(0)
    actor = build_actor(ModelConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                                    max_positions=64), 34)
    ids, pos, cu, _ = _varlen()
    p = torch.tensor([3, 9, 20, 40, 45])
    last = actor.get_decoder().layers[-1]
    seen = {"mlp": [], "q": [], "k": []}
    hooks = [getattr(last, path[0]).get_submodule(path[1]).register_forward_hook(
        lambda m, a, o, key=key: seen[key].append(a[0].shape[:-1]))
        for key, path in (("mlp", ("mlp", "")), ("q", ("self_attn", "q_proj")), ("k", ("self_attn", "k_proj")))]
    try:
        h = packed_hidden(actor, ids, pos, cu, positions=p)
        rows = lambda key: sum(s.numel() for s in seen[key])  # noqa: E731
        tables = forward_tables(cu, 0.8, p)
        padded = sum(b.mask.numel() for b in tables if b.keep.numel())
        assert rows("mlp") == p.numel()
        assert rows("q") == sum(b.qcol.numel() for b in tables) < padded and rows("k") == padded
        for v in seen.values():
            v.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(M, "_PRE_NORM_LAYERS", ())
            whole = packed_hidden(actor, ids, pos, cu, positions=p)
        assert rows("mlp") > 2 * p.numel() and rows("q") == rows("k")  # every padded token of the buckets it reads
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(whole, h, rtol=1e-5, atol=1e-6)
    assert packed_hidden(actor, ids, pos, cu, positions=p[:0]).shape == (0, 16)


@pytest.mark.parametrize("variant", ["gqa", "eager", "sliding"])
def test_hidden_at_positions_for_other_attention_layouts_float64(variant):
    """Grouped keys and values (GQA) go through the selected queries too; eager attention and a Qwen2 sliding
    window run the last layer's attention on every position (`_selectable`): all equal the full forward."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(2)
    kw = dict(vocab_size=34, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1 if variant == "gqa" else 4, max_position_embeddings=64)
    if variant == "sliding":
        cfg = Qwen2Config(**kw, use_sliding_window=True, sliding_window=5, max_window_layers=0)
    else:
        cfg = LlamaConfig(**kw)
    actor = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager" if variant == "eager" else "sdpa")
    actor = actor.double()
    selectable = M._selectable(actor.get_decoder().layers[-1].self_attn)
    assert selectable == (variant == "gqa")
    ids, pos, cu, g = _varlen(3)
    p = torch.tensor([0, 6, 8, 14, 19, 20, 35, 49, 50, 51, 54, 62])[torch.randperm(12, generator=g)]
    _assert_at_positions_equal_full(actor, ids, pos, cu, p, g)


def test_tables_without_positions_are_refused_for_a_forward_at_positions():
    actor, _ = tiny_models()
    ids, pos, cu, _ = _varlen()
    with pytest.raises(ValueError, match="without positions"):
        packed_hidden(actor, ids, pos, cu, positions=torch.tensor([3]), tables=forward_tables(cu))
