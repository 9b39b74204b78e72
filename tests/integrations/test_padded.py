"""Adapters at kernel speed: the padded batch is read in place (each row a segment, rows of one rollout
anywhere in the batch), and the numbers equal the packed op's, bitwise on the sequential CPU backend."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.integrations import openrlhf, segment_gae_padded, trl, verl
from compactionrl_fast.integrations.padded import row_table
from compactionrl_fast.ops._dispatch import available
from tests.integrations._batches import padded_from_packed
from tests.utils import RecordOps, SHAPE_TABLE, packed_batch, random_case

BACKENDS = [b for b in ("cpp", "triton") if b in available(torch.device("cpu"))] + ["torch"]


def _shift(pad, rows, cols, left):
    """Move every row's tokens to the right end (left padding) when `left`."""
    if not left:
        return pad, cols
    L = pad["mask"].shape[1]
    n = pad["mask"].shape[1] - 3  # padded_from_packed leaves >= 3 garbage columns at the right
    out = {k: torch.roll(v, shifts=L - n, dims=1) for k, v in pad.items()}
    return out, cols + (L - n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["paper", "none", "stitched"])
@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("case", ["empty_segments", "no_trainable", "single_token",
                                  pytest.param("random", marks=pytest.mark.slow)])
def test_gae_padded_equals_packed_bitwise(backend, mode, left, case):
    shape = random_case(3, n_rollouts=6, max_len=90) if case == "random" else SHAPE_TABLE[case]
    b = packed_batch(shape, seed=2)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=7)
    pad, cols = _shift(pad, rows, cols, left)
    kw = dict(gamma=0.99, lam="adaptive", cross_segment=mode, lam_critic=0.95, backend=backend)
    adv_p, ret_p = segment_gae_padded(pad["rewards"], pad["values"], pad["mask"], ids, segment_index=pos, **kw)
    adv, ret = crf.segment_gae(**b, **kw)
    if backend == "triton":
        torch.testing.assert_close(adv_p[rows, cols], adv, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(adv_p[rows, cols], adv) and torch.equal(ret_p[rows, cols], ret)
    assert not adv_p[~pad["mask"]].any() and not ret_p[~pad["mask"]].any()


@pytest.mark.parametrize("B,L", [(1, 1), (1, 7), (4, 1)])
def test_gae_padded_tiny_shapes(B, L):
    g = torch.Generator().manual_seed(B * 10 + L)
    mask = torch.rand(B, L, generator=g) < 0.6
    mask[0] = False  # an all-masked row
    rew, val = torch.randn(B, L, generator=g), torch.randn(B, L, generator=g)
    ids = [0] * B
    adv, ret = segment_gae_padded(rew, val, mask, ids, lam=0.9)
    want_adv, want_ret = crf.segment_gae(rew.reshape(-1), val.reshape(-1), mask.reshape(-1),
                                         torch.arange(0, (B + 1) * L, L), torch.tensor([0, B]), lam=0.9)
    assert torch.equal(adv.reshape(-1), want_adv) and torch.equal(ret.reshape(-1), want_ret)


def test_row_table_is_cached_and_checked():
    t1 = row_table(4, 5, ["a", "b", "a", "c"], [0, 0, 1, 0])
    assert row_table(4, 5, ["a", "b", "a", "c"], [0, 0, 1, 0]) is t1
    assert t1.order == (0, 2, 1, 3) and t1.cu_segments.tolist() == [0, 2, 3, 4]
    assert t1.seg_start.tolist() == [0, 10, 5, 15] and t1.cu_seqlens.tolist() == [0, 5, 10, 15, 20]
    assert row_table(3, 2, [1, 2, 3]).seg_start is None  # rows already in order: no placement
    with pytest.raises(ValueError, match="rollout_ids"):
        row_table(3, 2, [1, 2])
    with pytest.raises(ValueError, match="segment_index.*repeated"):
        row_table(3, 2, [1, 1, 2], [0, 0, 0])
    with pytest.raises(ValueError, match="segment_index.*0..n-1"):
        row_table(3, 2, [1, 1, 2], [0, 2, 0])
    with pytest.raises(ValueError, match="segment_index"):
        row_table(3, 2, [1, 1, 2], [0, 1])
    with pytest.raises(TypeError, match="segment_index"):
        row_table(2, 2, [1, 1], [0.0, 1.0])


def _loss_batch(B=5, L=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.7
    mask[1] = False
    logp = torch.randn(B, L, generator=g) * 0.3 - 1
    old = logp + 0.4 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, L, generator=g) * 2
    junk = torch.full((B, L), float("nan"))  # padding holds garbage: never read
    return mask, torch.where(mask, logp, junk), torch.where(mask, old, junk), torch.where(mask, adv, junk)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_verl_loss_reads_rows_in_place(agg):
    mask, logp, old, adv = _loss_batch()
    lp = logp.clone().requires_grad_()
    loss, metrics = verl.compute_policy_loss_compaction(old, lp, adv, mask, loss_agg_mode=agg,
                                                        config={"clip_ratio": 0.2, "clip_ratio_c": 3.0})
    loss.backward()
    # the packed op on the trainable tokens, one segment per row
    cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
    lp2 = logp[mask].clone().requires_grad_()
    red = {"token-mean": "token-mean", "seq-mean-token-mean": "segment-mean", "token-sum": "sum"}[agg]
    want, _ = crf.ppo_policy_loss(lp2, old[mask], adv[mask], torch.ones(int(mask.sum()), dtype=torch.bool),
                                  cu_seqlens=cu, clip_low=0.2, clip_high=0.2, dual_clip=3.0, reduction=red)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(lp.grad[mask], lp2.grad) and not lp.grad[~mask].any()
    assert all(v == v for v in metrics.values())  # no NaN from the padding


def test_openrlhf_and_trl_losses_read_rows_in_place():
    mask, logp, old, adv = _loss_batch(seed=1)
    for token_level in (True, False):
        loss, clipfrac, kl, _, _ = openrlhf.PolicyLoss(0.2, 0.28, token_level_loss=token_level)(logp, old, adv, mask)
        assert loss == loss and kl == kl
    vl = openrlhf.ValueLoss(0.2)(logp, old, adv, mask)
    assert vl == vl
    pl, pc = trl.policy_loss(logp, old, adv, ~mask, 0.2)
    v2, vc = trl.value_loss(logp, old, adv, ~mask, 0.2)
    assert pl == pl and v2 == v2 and pc == pc and vc == vc


# ---------------------------------------------------------------- CUDA: no host sync, <= 2 launches added

# ops that launch nothing on a GPU: views, detach, and the host->device copies of the cached row table
_NOT_LAUNCHES = ("aten.view", "aten._unsafe_view", "aten.detach", "aten.lift_fresh", "aten.unbind", "aten.alias",
                 "aten.reshape", "aten.as_strided")


def _launches(fn):
    """(kernel launches, op names) that `fn` dispatches: every aten/custom op but views and the like."""
    c = RecordOps()
    with c:
        fn()
    ops = {name: n for name, n in c.ops.items() if not name.startswith(_NOT_LAUNCHES)}
    return sum(ops.values()), ops


@pytest.mark.skipif(not crf.ops._dispatch.has_triton(), reason="the CUDA default backend is triton")
def test_adapters_add_no_host_sync_and_at_most_two_launches_on_cuda():
    """On fake CUDA tensors (a host read of device data raises), each adapter, on a batch whose row table is
    cached, launches at most 2 kernels more than its op on the flattened batch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, L, ids = 4, 16, [7, 3, 7, 5]
    with FakeTensorMode():
        dev = "cuda"
        rew, val, old = (torch.zeros(B, L, device=dev) for _ in range(3))
        mask = torch.ones(B, L, dtype=torch.bool, device=dev)
        mask_f, pad = mask.float(), torch.zeros(B, L, dtype=torch.bool, device=dev)  # pad: TRL's padding mask
        m, cu = mask.reshape(-1), torch.arange(0, B * L + 1, L, device=dev)
        cs = torch.tensor([0, 2, 3, 4], device=dev)
        ops = {
            "gae": lambda: crf.segment_gae(rew.reshape(-1), val.reshape(-1), m, cu, cs),
            "value": lambda: crf.value_loss(val.reshape(-1), old.reshape(-1), rew.reshape(-1), m, clip=0.2),
            "policy": lambda: crf.ppo_policy_loss(val.reshape(-1), old.reshape(-1), rew.reshape(-1), m, clip_low=0.2,
                                                  clip_high=0.2),
        }
        adapters = [
            ("gae", "segment_gae_padded", lambda: segment_gae_padded(rew, val, mask, ids)),
            ("gae", "verl compaction_gae", lambda: verl.compute_compaction_gae(rew, mask_f, values=val, index=ids,
                                                                                config={})),
            ("gae", "openrlhf", lambda: openrlhf.get_advantages_and_returns(val, rew, mask_f, 1.0, 0.95,
                                                                            rollout_ids=ids)),
            ("value", "openrlhf ValueLoss", lambda: openrlhf.ValueLoss(0.2)(val, old, rew, mask)),
            ("value", "trl value_loss", lambda: trl.value_loss(val, old, rew, pad, 0.2)),
            ("policy", "trl policy_loss", lambda: trl.policy_loss(val, old, rew, pad, 0.2)),
        ]
        base = {k: _launches(f)[0] for k, f in ops.items()}
        for op, name, fn in adapters:
            fn()  # builds and caches the row table (host work and host->device copies)
            n, seen = _launches(fn)
            assert n <= base[op] + 2, f"{name}: {n} launches > {base[op]} of the op + 2: {seen}"
