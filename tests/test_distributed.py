"""Distributed exactness of the loss reductions: 2 processes (gloo, 127.0.0.1), each splitting its half
of a batch into 3 micro-batches of different token counts, with the global denominator from
`global_token_count` / `global_denominator`; accumulated and all-reduced gradients equal the
single-process full-batch gradients."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import compactionrl_fast as crf
from tests.utils import packed_batch

WORLD = 2
# 8 rollouts of 1-3 segments; each rank's 4 rollouts become micro-batches of 1, 1 and 2 rollouts
CASE = [[(30, "rand"), (7, "all")], [(55, "rand")], [(12, "all"), (0, "rand"), (40, "rand")], [(90, "rand")],
        [(5, "none"), (33, "rand")], [(61, "rand"), (9, "all")], [(1, "all")], [(120, "rand"), (20, "none")]]
MICRO = [(0, 1), (1, 2), (2, 4)]
BACKENDS = ["auto"]  # the reduction weights are shared Python logic; each backend is checked in tests/ops


def problem():
    """The full batch and its inputs; logprobs = base + feats @ theta, values = value_head(hidden)."""
    b = packed_batch(CASE, seed=11, index_dtype=torch.int64)
    T, H = b["loss_mask"].numel(), 24
    g = torch.Generator().manual_seed(11)
    x = dict(base=torch.randn(T, generator=g, dtype=torch.float64) * 0.5 - 2.0,
             feats=torch.randn(T, 4, generator=g, dtype=torch.float64) * 0.3,
             advantages=torch.randn(T, generator=g), hidden=torch.randn(T, H, generator=g),
             returns=torch.randn(T, generator=g), old_values=torch.randn(T, generator=g))
    x["old_logprobs"] = (x["base"] + 0.4 * torch.randn(T, generator=g, dtype=torch.float64)).float()
    return b, x


def params():
    g = torch.Generator().manual_seed(12)
    return dict(theta=torch.randn(4, generator=g, dtype=torch.float64), weight=torch.randn(24, generator=g) * 0.2,
                bias=torch.randn((), generator=g))


def rollouts(b, x, r0, r1):
    """Rollouts [r0, r1) of the batch as their own packed batch (offsets rebased)."""
    s0, s1 = int(b["cu_segments"][r0]), int(b["cu_segments"][r1])
    t0, t1 = int(b["cu_seqlens"][s0]), int(b["cu_seqlens"][s1])
    sub = dict(loss_mask=b["loss_mask"][t0:t1], cu_seqlens=b["cu_seqlens"][s0:s1 + 1] - t0,
               cu_segments=b["cu_segments"][r0:r1 + 1] - s0)
    return sub, {k: v[t0:t1] for k, v in x.items()}


def losses(b, x, p, reduction, backend, denominator=None):
    """Policy loss + value-head loss of one (micro-)batch; gradients go to p's leaves."""
    kw = dict(cu_seqlens=b["cu_seqlens"], cu_segments=b["cu_segments"], reduction=reduction,
              denominator=denominator, backend=backend)
    logp = x["base"] + x["feats"] @ p["theta"]
    pl, _ = crf.ppo_policy_loss(logp, x["old_logprobs"], x["advantages"], b["loss_mask"], dual_clip=3.0, **kw)
    vl, _ = crf.value_head_loss(x["hidden"], p["weight"], p["bias"], x["old_values"], x["returns"], b["loss_mask"],
                                clip=0.2, **kw)
    return pl, vl


def fresh(p):
    return {k: v.clone().requires_grad_() for k, v in p.items()}


def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        b, x = problem()
        p0 = params()
        half = len(CASE) // WORLD
        mine, mx = rollouts(b, x, rank * half, (rank + 1) * half)
        micro = [rollouts(mine, mx, r0, r1) for r0, r1 in MICRO]
        assert len({m[0]["loss_mask"].numel() for m in micro}) == 3  # different token counts
        for backend in BACKENDS:
            for reduction in ("token-mean", "segment-mean", "rollout-mean"):
                if reduction == "token-mean":
                    d = crf.global_token_count(mine["loss_mask"])
                    assert d == int(b["loss_mask"].sum())
                else:
                    d = crf.global_denominator(reduction, mine["loss_mask"], cu_seqlens=mine["cu_seqlens"],
                                               cu_segments=mine["cu_segments"])
                p = fresh(p0)
                total = torch.zeros(2, dtype=torch.float64)
                for mb, mbx in micro:
                    pl, vl = losses(mb, mbx, p, reduction, backend, denominator=d)
                    (pl + vl).backward()
                    total += torch.stack([pl.detach(), vl.detach()]).double()
                grads = torch.cat([p[k].grad.double().reshape(-1) for k in ("theta", "weight", "bias")])
                dist.all_reduce(grads)
                dist.all_reduce(total)
                if rank == 0:  # the full batch in one process, local denominators
                    q = fresh(p0)
                    pl, vl = losses(b, x, q, reduction, backend)
                    (pl + vl).backward()
                    want = torch.cat([q[k].grad.double().reshape(-1) for k in ("theta", "weight", "bias")])
                    torch.testing.assert_close(grads, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()),
                                               msg=lambda s: f"{backend} {reduction}: {s}")
                    torch.testing.assert_close(total, torch.stack([pl.detach(), vl.detach()]).double(),
                                               rtol=1e-6, atol=1e-7)
    finally:
        # both ranks tear gloo down together: a rank that exits while its peer still works aborts at times
        # ("terminate called without an active exception", SIGABRT)
        dist.barrier()
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_micro_batches_and_ranks_reproduce_full_batch_gradient():
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD, join=True)


def test_global_counts_without_distributed():
    mask = torch.tensor([True, False, True, True])
    cu, cs = torch.tensor([0, 1, 2, 4]), torch.tensor([0, 2, 3])
    assert crf.global_token_count(mask) == 3
    assert crf.global_denominator("segment-mean", mask, cu_seqlens=cu, cu_segments=cs) == 2
    assert crf.global_denominator("rollout-mean", mask, cu_seqlens=cu, cu_segments=cs) == 2
    assert crf.global_denominator("segment-mean", mask) == 1  # no cu_seqlens: one segment
    with pytest.raises(ValueError, match="reduction"):
        crf.global_denominator("sum", mask)
