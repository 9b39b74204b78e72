"""Kernel launches per call on the Triton path (the one CUDA tensors take), every launch counted under the
interpreter whichever kernel it is: segment_gae in each plan; the loss ops, whose reduction weights and loss
kernel finish the sum without a torch op."""
from __future__ import annotations

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops import _dispatch
from compactionrl_fast.reference import gae as ref_gae


def _count_triton_launches(monkeypatch):
    """Every Triton launch under the interpreter, whichever kernel: the list of kernel names it fills."""
    from triton.runtime.interpreter import InterpretedFunction

    log, run = [], InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            log.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted_run)
    return log


@pytest.mark.skipif("triton" not in _dispatch.available(torch.device("cpu")), reason="needs the Triton interpreter")
@pytest.mark.parametrize("chunk,cross,lam,want,plan", [(0, "none", 0.9, 2, None), (0, "paper", "adaptive", 2, None),
                                                       (None, "paper", "adaptive", 3, None),
                                                       (40, "stitched", 0.9, 3, None),
                                                       (None, "paper", "adaptive", 2, "lookback")])
def test_gae_triton_launch_count(monkeypatch, chunk, cross, lam, want, plan):
    """Kernel launches per call under the interpreter: the per-rollout plan is 2 (the per-segment numbers, the
    scan); the chunk plan for few long rollouts is 3 (numbers, chunk maps, the write pass that composes the
    later chunks' maps itself); the single-pass look-back plan is 2 (its flags zeroed by the first)."""
    import functools

    from compactionrl_fast.kernels import gae as kgae
    from tests.utils import packed_batch

    log = _count_triton_launches(monkeypatch)
    monkeypatch.setattr(kgae, "segment_gae_fwd", functools.partial(kgae.segment_gae_fwd, chunk=chunk, block=32,
                                                                   plan=plan, tile=32))
    b = packed_batch([[(40, "rand"), (30, "rand")], [(50, "rand")]], index_dtype=torch.int64)
    adv, ret = crf.segment_gae(b["rewards"], b["values"], b["loss_mask"], b["cu_seqlens"], b["cu_segments"], lam=lam,
                               cross_segment=cross, backend="triton")
    want_adv, want_ret = ref_gae.segment_gae(b["rewards"], b["values"], b["loss_mask"], b["cu_seqlens"],
                                             b["cu_segments"], lam=lam, cross_segment=cross)
    torch.testing.assert_close(adv, want_adv.float(), atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(ret, want_ret.float(), atol=2e-6, rtol=2e-6)
    assert len(log) == want <= 3, log


LOSS_LAUNCH_CASES = [  # (reduction, layout, denominator, kernel launches: [counts +] weights + loss with its finish)
    ("token-mean", "none", None, 2), ("token-mean", "packed", None, 3), ("token-mean", "packed", 300.0, 2),
    ("token-mean", "packed", "tensor", 2), ("segment-mean", "packed", None, 3), ("segment-mean", "packed", 7.0, 3),
    ("rollout-mean", "packed", None, 3), ("rollout-mean", "segments", "tensor", 3), ("sum", "packed", None, 2),
]


@pytest.mark.skipif("triton" not in _dispatch.available(torch.device("cpu")), reason="needs the Triton interpreter")
@pytest.mark.parametrize("loss", ["ppo_policy_loss", "value_loss"])
@pytest.mark.parametrize("reduction,layout,den,want", LOSS_LAUNCH_CASES)
def test_loss_triton_launch_count(monkeypatch, loss, reduction, layout, den, want):
    """Kernel launches per loss call on the Triton path (the one CUDA tensors take): the reduction weights
    (a counts kernel when they need counts, one program for the weights), then the loss kernel, whose last
    program adds the partials: at most 3, and no torch op finishes the reduction. Every Triton launch is
    counted (the interpreter's launch entry point is wrapped), whichever kernel it is."""
    from compactionrl_fast.reference import losses as ref_losses
    from tests.utils import packed_batch

    log = _count_triton_launches(monkeypatch)
    # 2,500 tokens: three loss programs, so the finish adds partials written by other programs
    b = packed_batch([[(900, "rand"), (0, "rand"), (700, "rand")], [(5, "all")], [(895, "rand")]], index_dtype=torch.int64)
    T = b["loss_mask"].numel()
    g = torch.Generator().manual_seed(3)
    x, y, z = (torch.randn(T, generator=g) * 0.3 for _ in range(3))
    layout_kw = {"none": {}, "segments": dict(cu_seqlens=b["cu_seqlens"]),
                 "packed": dict(cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"])}[layout]
    kw = dict(layout_kw, reduction=reduction, denominator=torch.tensor(250.0) if den == "tensor" else den)
    if loss == "ppo_policy_loss":
        args = (x, x + y, z, b["loss_mask"])
        got, m = crf.ppo_policy_loss(*args, **kw, backend="triton")
        want_loss, want_m = ref_losses.ppo_policy_loss(*args, **kw)
    else:
        args = (x, x + y, z, b["loss_mask"])
        got, m = crf.value_loss(*args, clip=0.1, **kw, backend="triton")
        want_loss, want_m = ref_losses.value_loss(*args, clip=0.1, **kw)
    assert len(log) == want <= 3, log
    assert log.count(f"{loss.replace('_policy', '')}_fwd_kernel") == 1, log
    torch.testing.assert_close(got.double(), want_loss, rtol=1e-5, atol=1e-7)
    for k, v in m.items():
        torch.testing.assert_close(v.double(), want_m[k], rtol=1e-5, atol=1e-6, msg=k)
