"""Packed forward of actor and critic equals the per-sequence forward; heads read position t-1."""
import pytest
import torch

from compactionrl_fast.train.model import (action_index, actor_logprobs, critic_values, packed_hidden)

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
