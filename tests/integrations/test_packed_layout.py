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

    from compactionrl_fast.integrations import padded

    assert doctest.testmod(padded, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_bad_inputs_name_the_argument_exactly():
    """Each check names its own argument (the messages above only need to contain the name)."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        packed_layout(torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="response_mask must be 2-D"):
        segment_gae_padded(torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="rollout_ids must have one entry per row"):
        packed_layout(mask, rollout_ids=[0])
    with pytest.raises(ValueError, match=r"rollout_ids must be 1-D \[B\], got shape \(2, 1\)"):
        packed_layout(mask, rollout_ids=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="segment_index must have one entry per row"):
        packed_layout(mask, segment_index=[0])
    with pytest.raises(TypeError, match="^segment_index must hold integers$"):
        packed_layout(mask, segment_index=[0.5, 1.0])
    with pytest.raises(TypeError, match="^segment_index must hold integers$"):  # unhashable: not cached either
        crf.integrations.padded.row_table(2, 3, segment_index=[[0], [1]])
    with pytest.raises(TypeError, match="keep must have dtype"):
        packed_layout(mask, keep=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"keep must have the shape of response_mask \(2, 3\), got \(2, 4\)"):
        packed_layout(mask, keep=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="^keep must include every trainable token"):
        packed_layout(mask, keep=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep is on meta"):
        packed_layout(mask, keep=torch.ones(2, 3, dtype=torch.bool, device="meta"))
    for name in ("token_rewards", "values"):
        args = {"token_rewards": torch.zeros(2, 3), "values": torch.zeros(2, 3)}
        args[name] = torch.zeros(3, 2)
        with pytest.raises(ValueError, match=rf"{name} must have shape \[B, L\] = \[2, 3\] .*got \(3, 2\)"):
            segment_gae_padded(args["token_rewards"], args["values"], mask)
        args[name] = [[0.0] * 3] * 2
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            segment_gae_padded(args["token_rewards"], args["values"], mask)
    lay = packed_layout(mask)
    with pytest.raises(ValueError, match=r"^x must have shape"):
        lay.pack(torch.zeros(3, 2))
    with pytest.raises(TypeError, match="^values must be a torch.Tensor"):
        lay.pack([[0.0] * 3] * 2, "values")
    with pytest.raises(ValueError, match="^x is on meta"):
        lay.pack(torch.zeros(2, 3, device="meta"))
    with pytest.raises(ValueError, match=r"^y must have 6 packed tokens"):
        lay.unpack(torch.zeros(5))
    with pytest.raises(TypeError, match="^adv must be a torch.Tensor"):
        lay.unpack([0.0] * 6, name="adv")
    with pytest.raises(ValueError, match="^y is on meta"):
        lay.unpack(torch.zeros(6, device="meta"))


def test_pack_unpack_keep_trailing_dims_and_numpy_ids():
    import numpy as np

    mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    lay = packed_layout(mask, rollout_ids=np.array(["a", "a"], dtype=object), segment_index=np.array([1, 0]))
    assert lay.order.tolist() == [1, 0] and lay.cu_segments.tolist() == [0, 2]
    x = torch.arange(2 * 3 * 4.0).view(2, 3, 4)  # [B, L, D], e.g. hidden states
    packed = lay.pack(x)
    assert packed.shape == (4, 4) and torch.equal(packed, x.reshape(6, 4)[[4, 5, 0, 2]])
    back = lay.unpack(packed, fill=-1.0)
    assert back.shape == (2, 3, 4) and torch.equal(back, torch.where(mask[..., None], x, -1.0))


def test_empty_batch_layout():
    lay = packed_layout(torch.zeros(0, 3, dtype=torch.bool))
    assert lay.num_tokens == 0 and lay.cu_seqlens.tolist() == [0] and lay.cu_segments.tolist() == [0]
    assert lay.order.dtype == lay.index.dtype == torch.int64


def test_row_table_values_and_cache(monkeypatch):
    import collections

    import numpy as np

    from compactionrl_fast.integrations import padded

    monkeypatch.setattr(padded, "_TABLES", collections.OrderedDict())
    t = padded.row_table(3, 4, ["a", "b", "a"])
    assert t.order == (0, 2, 1) and t.cu_segments.tolist() == [0, 2, 3] and t.seg_start.tolist() == [0, 8, 4]
    assert t.cu_seqlens.tolist() == t.rows.tolist() == [0, 4, 8, 12] and t.cu_segments.dtype == torch.int64
    assert padded.row_table(3, 4, ["a", "b", "a"]) is t  # cached
    ident = padded.row_table(3, 4, ["a", "a", "b"])
    assert ident.order == (0, 1, 2) and ident.seg_start is None  # rows already in segment order
    empty_rows = padded.row_table(2, 0)
    assert empty_rows.cu_seqlens.tolist() == [0, 0, 0] and empty_rows.cu_seqlens.dtype == torch.int64
    # the key covers everything the table depends on
    assert padded.row_table(3, 4, ["a", "b", "a"], segment_index=[1, 0, 0]).order == (2, 0, 1)
    meta = padded.row_table(3, 4, ["a", "b", "a"], device="meta")
    assert {t.device.type for t in (meta.cu_seqlens, meta.cu_segments, meta.seg_start, meta.rows)} == {"meta"}
    ids = torch.tensor([0, 1, 0])
    assert padded.row_table(3, 4, ids).cu_segments.tolist() == [0, 2, 3]
    ids[1] = 0  # changed in place: same object, new rollouts
    assert padded.row_table(3, 4, ids).cu_segments.tolist() == [0, 3]
    assert padded.row_table(3, 4, np.array([0, 1, 2])).cu_segments.tolist() == [0, 1, 2, 3]
    assert padded.row_table(3, 4, np.array([0, 0, 0])).cu_segments.tolist() == [0, 3]
    # the 8 most recent tables stay cached, the oldest goes first
    padded._TABLES.clear()
    tables = [padded.row_table(1, n + 1) for n in range(padded._TABLES_MAX)]
    assert all(padded.row_table(1, n + 1) is tables[n] for n in range(padded._TABLES_MAX))
    newest = padded.row_table(1, 100)
    assert padded.row_table(1, 100) is newest and padded.row_table(1, 1) is not tables[0]


@pytest.mark.parametrize("one_pass", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16, torch.float32, torch.float64])
def test_mask_of_any_dtype_is_checked_for_0_and_1(dtype, one_pass, monkeypatch):
    """as_bool_mask's checks (the C++ pass mask_to_bool; without it, reductions: integers' range, floats'
    nonzero == equal-to-1) reject exactly the masks with a value other than 0 or 1: NaN, inf, fractions,
    negatives, 2."""
    from compactionrl_fast.integrations.padded import as_bool_mask
    from compactionrl_fast.ops import _mask

    if one_pass and not _mask._HAS_MASK_OP:
        pytest.skip("the extension lacks mask_to_bool")
    monkeypatch.setattr(_mask, "_HAS_MASK_OP", one_pass)

    g = torch.Generator().manual_seed(3)
    good = (torch.rand(4, 33, generator=g) > 0.4).to(dtype)
    assert torch.equal(as_bool_mask("response_mask", good), good != 0)
    bads = [2, 3] + ([] if dtype == torch.uint8 else [-1]) + ([0.5, 0.999, float("nan"), float("inf"), -0.25]
                                                              if dtype.is_floating_point else [])
    for v in bads:
        if float(torch.tensor(v, dtype=dtype)) in (0.0, 1.0):
            continue  # 0.999 is 1 in bfloat16
        bad = good.clone()
        bad[2, 17] = v
        with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
            as_bool_mask("response_mask", bad)
    neg_zero = good.clone()
    if dtype.is_floating_point:
        neg_zero[0, 0] = -0.0
    assert torch.equal(as_bool_mask("response_mask", neg_zero), neg_zero != 0)


def test_one_pass_mask_conversion_counts_across_blocks():
    """mask_to_bool over several of its blocks (64K values), a non-contiguous input and a bad value in the
    last block: the bool mask, the count of True values and the refusal."""
    from compactionrl_fast.integrations import padded
    from compactionrl_fast.ops import _mask

    if not _mask._HAS_MASK_OP:
        pytest.skip("the extension lacks mask_to_bool")
    g = torch.Generator().manual_seed(4)
    good = torch.rand(5, 70_001, generator=g) > 0.3
    for m in (good.long(), good.float(), good.double().t().contiguous().t()):
        out, count = _mask.bool_mask_and_count("response_mask", m)
        assert torch.equal(out, good) and count == int(good.sum())
    assert _mask.bool_mask_and_count("response_mask", good) == (good, None)
    bad = good.float()
    bad[4, 70_000] = 0.5
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        padded.as_bool_mask("response_mask", bad)
