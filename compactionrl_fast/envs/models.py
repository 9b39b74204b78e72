"""A tiny randomly initialised Hugging Face Llama for the built-in task (the demo and the tests)."""
from __future__ import annotations

import torch


def tiny_llama(vocab_size: int, *, layers: int = 2, d_model: int = 64, heads: int = 2, mlp: int = 256,
               max_positions: int = 512, seed: int = 0, pad_token_id: int = 0, eos_token_id: int = 2):
    """LlamaForCausalLM with tied embeddings (2 layers, d_model 64, 2 heads of size 32, MLP 256: about 110K
    parameters for the memory task's 34 tokens), float32, eval mode, on CPU. Head size 32: the least vLLM's
    CPU attention takes, so the same model runs on both engines."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=True, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                      bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.eval()
