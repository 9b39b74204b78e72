"""Naive PyTorch oracle for `linear_logprobs` (docs/ops.md): the full [T, V] logits in float64.

Differentiable by plain autograd, so the tests take its gradients as the truth. `naive_linear_logprobs`
is the same composition in the inputs' dtype, the way a trainer writes it: the benchmark baseline and
the "PyTorch in bf16" error yardstick of the tests.
"""
from __future__ import annotations

import torch


def linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False):
    """logp[t] = log_softmax((hidden @ weight.T + bias) / temperature)[t, targets[t]], in float64.

    Args:
        hidden: [T, H] float; weight: [V, H] float; targets: [T] int64 in [0, V); bias: [V] or None.

    Returns:
        logprobs [T] float64, and entropy [T] float64 (-sum_v p log p) when return_entropy.
    """
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # [T, V]
    logp = logp_all.gather(1, targets.long()[:, None])[:, 0]
    if not return_entropy:
        return logp
    # p log p -> 0 as p -> 0: a -inf logit (a masked token) adds 0, not 0 * -inf = NaN; log p is replaced
    # before the product, so its gradient is 0 there too (a NaN logit still makes the row NaN)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp, entropy


def naive_linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False):
    """The usual composition in the inputs' dtype (logits materialised, softmax in float32)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [T, V] float32
    logp = logp_all.gather(1, targets.long()[:, None])[:, 0]
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
