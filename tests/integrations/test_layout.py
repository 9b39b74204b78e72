"""packed_layout: padded [B, L] batches with per-row rollout ids <-> the packed layout; segment_gae on a
padded compacted batch equals segment_gae on the packed batch; bad inputs."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.integrations import packed_layout, segment_gae_padded
from tests.integrations._batches import padded_from_packed
from tests.utils import SHAPE_TABLE, packed_batch, random_case

CASES = [SHAPE_TABLE[k] for k in ("single_token", "empty_segments", "no_trainable", "four_segments")]
CASES += [random_case(seed, n_rollouts=5, max_len=120) for seed in range(3)]


def test_hand_example_interleaved_rollouts():
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    lay = packed_layout(mask, rollout_ids=["b", "a", "b", "a"], segment_index=[1, 0, 0, 1])
    # rollout "b" first (first appearance): rows 2 (position 0), 0 (position 1); then "a": rows 1, 3
    assert lay.order.tolist() == [2, 0, 1, 3]
    assert lay.cu_seqlens.tolist() == [0, 0, 2, 4, 8]
    assert lay.cu_segments.tolist() == [0, 2, 4]
    assert lay.index.tolist() == [0, 2, 4, 5, 12, 13, 14, 15]
    assert lay.loss_mask.all()
    x = torch.arange(16.0).view(4, 4)
    assert lay.pack(x).tolist() == [0.0, 2.0, 4.0, 5.0, 12.0, 13.0, 14.0, 15.0]
    back = lay.unpack(lay.pack(x), fill=-1.0)
    assert torch.equal(back, torch.where(mask.bool(), x, -1.0))


def test_keep_packs_context_tokens_and_defaults():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    keep = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    lay = packed_layout(mask, keep=keep, index_dtype=torch.int32)
    assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_segments.tolist() == [0, 1]
    assert lay.loss_mask.tolist() == [False, True, True, False, True]
    lay = packed_layout(mask.float())  # float 0/1 masks (verl, OpenRLHF) are accepted
    assert lay.index.tolist() == [1, 2, 4]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_layout_of_shuffled_compacted_batch(case, index_dtype):
    b = packed_batch(CASES[case], seed=case, index_dtype=index_dtype)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=case)
    lay = packed_layout(pad["mask"], ids, segment_index=pos, index_dtype=index_dtype)
    assert lay.cu_seqlens.dtype == lay.cu_segments.dtype == index_dtype
    cs = lay.cu_segments.long().tolist()
    assert len(cs) == b["cu_segments"].numel()  # same number of rollouts
    order = lay.order.tolist()
    for r in range(len(cs) - 1):  # each rollout: rows of one id, in chronological order
        seg_rows = order[cs[r]:cs[r + 1]]
        assert len({int(ids[i]) for i in seg_rows}) == 1
        assert [int(pos[i]) for i in seg_rows] == list(range(len(seg_rows)))
    cu = lay.cu_seqlens.long().tolist()
    for i, row in enumerate(order):  # segment i holds the trainable tokens of its row, left to right
        want = pad["mask"][row].nonzero().squeeze(1) + row * pad["mask"].shape[1]
        assert lay.index[cu[i]:cu[i + 1]].tolist() == want.tolist()
    assert lay.loss_mask.all() and lay.num_tokens == int(b["loss_mask"].sum())
    back = lay.unpack(lay.pack(pad["rewards"]))
    assert torch.equal(back, torch.where(pad["mask"], pad["rewards"], 0.0))


@pytest.mark.parametrize("mode", ["paper", "stitched", "none"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_segment_gae_padded_equals_packed_op(case, mode):
    b = packed_batch(CASES[case], seed=case)
    pad, ids, pos, rows, cols = padded_from_packed(b, seed=case + 10)
    kw = dict(gamma=0.99, lam="adaptive", cross_segment=mode, lam_critic=0.95)
    adv_p, ret_p = segment_gae_padded(pad["rewards"], pad["values"], pad["mask"], ids, segment_index=pos, **kw)
    adv, ret = crf.segment_gae(**b, **kw)
    # equal on every token of the original batch (0 on observation tokens) and 0 on padding
    torch.testing.assert_close(adv_p[rows, cols], adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret_p[rows, cols], ret, rtol=1e-6, atol=1e-6)
    assert not adv_p[~pad["mask"]].any() and not ret_p[~pad["mask"]].any()


def test_rows_in_batch_order_without_segment_index():
    b = packed_batch(SHAPE_TABLE["four_segments"], seed=1)
    pad, ids, pos, rows, cols = padded_from_packed(b, shuffle=False)
    kw = dict(gamma=1.0, lam=0.9, cross_segment="paper")
    adv_p, _ = segment_gae_padded(pad["rewards"], pad["values"], pad["mask"], ids.tolist(), **kw)
    adv, _ = crf.segment_gae(**b, **kw)
    torch.testing.assert_close(adv_p[rows, cols], adv, rtol=1e-6, atol=1e-6)


def test_pack_unpack_gradients():
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    lay = packed_layout(mask, rollout_ids=[1, 1])
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64)
    (lay.pack(x) * w).sum().backward()
    want = torch.zeros(2, 3, dtype=torch.float64)
    want[mask] = w
    torch.testing.assert_close(x.grad, want)
    y = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (lay.unpack(y) * x.detach()).sum().backward()
    torch.testing.assert_close(y.grad, x.detach()[mask])


def test_bad_inputs_name_the_argument():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="response_mask"):
        packed_layout(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="response_mask"):
        packed_layout(torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="rollout_ids"):
        packed_layout(mask, rollout_ids=[0])
    with pytest.raises(ValueError, match="segment_index"):
        packed_layout(mask, rollout_ids=[0, 0], segment_index=[1, 1])
    with pytest.raises(TypeError, match="segment_index"):
        packed_layout(mask, segment_index=[0.5, 1.0])
    with pytest.raises(ValueError, match="keep"):
        packed_layout(mask, keep=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="index_dtype"):
        packed_layout(mask, index_dtype=torch.float32)
    lay = packed_layout(mask)
    with pytest.raises(ValueError, match="values"):
        lay.pack(torch.zeros(3, 2), "values")
    with pytest.raises(ValueError, match="adv"):
        lay.unpack(torch.zeros(5), name="adv")


def test_docstring_examples():
    import doctest

    from compactionrl_fast.integrations import layout

    assert doctest.testmod(layout, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0
