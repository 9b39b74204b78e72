"""The Hugging Face forward the real-engine tests compare sampled log-probs with."""
import torch

from compactionrl_fast.packing import pack


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
