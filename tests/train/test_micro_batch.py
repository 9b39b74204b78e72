"""A micro-batch's layout (train/micro_batch.py): derived once, where the batch is, and moved whole."""
import copy

import pytest
import torch

from compactionrl_fast.train import diagnostics, micro_batch
from compactionrl_fast.train.config import TrainConfig
from compactionrl_fast.train.micro_batch import (Denominators, MicroBatch, concat_layout, denominator, layout_on,
                                            placed_rewards, reward_mode, selected_offsets)

from ._tiny import hand_batch
from .test_trainer import _FakeWorld


def _cfg(**kw):
    return TrainConfig(lam=1.0, **kw)


def _tensors(x):
    """Every tensor in x's fields, lists, tuples and dicts."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


@pytest.mark.parametrize("summaries", [True, False])
def test_build_derives_the_segment_ids_once(monkeypatch, summaries):
    """segment_ids is the one derivation every part of the layout shares (the policy mask, the loss offsets,
    the diagnostics' part)."""
    calls, real = [], diagnostics.segment_ids
    monkeypatch.setattr(diagnostics, "segment_ids", lambda b: calls.append(b) or real(b))
    b = hand_batch()
    cfg = _cfg(train_summary_tokens=summaries)
    mb = MicroBatch.build(b, cfg)
    assert len(calls) == 1
    seg = real(b)[0]
    assert torch.equal(mb.policy_mask, micro_batch.policy_mask(b, cfg, seg)[mb.idx])
    assert mb.n_policy == int(mb.policy_mask.sum()) and mb.n_tokens == int(b.loss_mask.sum())


def test_build_fields_equal_their_derivations():
    b = hand_batch(seed=3)
    cfg = _cfg(cross_segment="stitched")
    mb = MicroBatch.build(b, cfg)
    seg, roll, n = diagnostics.segment_ids(b)
    assert torch.equal(mb.idx, b.loss_mask.nonzero()[:, 0])  # every segment is its own attention sequence
    assert mb.reward_mode == reward_mode(cfg) == "stitched"
    assert mb.loss_cu.tolist() == [0] + n.cumsum(0).tolist() and bool(mb.value_mask.all())
    assert torch.equal(mb.rollout_logprobs, b.rollout_logprobs[mb.idx])
    assert mb.diag["shape"] == diagnostics.layout_part(b, cfg, mb.idx, (seg, roll, n))["shape"]
    for name, pos in mb.diag["pos"].items():
        assert torch.equal(pos, diagnostics.layout_part(b, cfg, mb.idx, (seg, roll, n))["pos"][name])


def test_placed_rewards_reuse_the_packed_ones_in_the_same_mode():
    from compactionrl_fast.ops import place_final_rewards
    from compactionrl_fast.packing import pack

    from ._tiny import tiny_rollouts

    rollouts = tiny_rollouts(3)
    for mode in ("paper", "stitched"):
        b = pack(rollouts, reward_mode=mode)
        for cross in ("paper", "stitched", "none"):
            cfg = _cfg(cross_segment=cross)
            got = placed_rewards(b, cfg)
            want = place_final_rewards(b.rollout_rewards.float(), b.loss_mask, b.cu_seqlens, b.cu_segments,
                                       mode=reward_mode(cfg))
            assert torch.equal(got, want)
            assert (got is b.rewards) == (reward_mode(cfg) == mode)  # placed once, at packing


def test_the_gap_diagnostics_place_only_the_other_mode(monkeypatch):
    from compactionrl_fast import ops

    b = hand_batch()
    cfg = _cfg(cross_segment="stitched")
    mb = MicroBatch.build(b, cfg)
    modes, real = [], ops.place_final_rewards
    monkeypatch.setattr(ops, "place_final_rewards",
                        lambda *a, mode, **k: modes.append(mode) or real(*a, mode=mode, **k))
    out = diagnostics.advantage_gap(mb, torch.zeros(b.loss_mask.numel()), cfg)
    assert modes == ["paper"] and "gap_abs_mean" in out


def test_selected_offsets_and_concat_layout_stay_on_the_batch_device():
    b = hand_batch()
    seg = diagnostics.segment_ids(b)[0]
    idx = b.loss_mask.nonzero()[:, 0]
    cu, mask = selected_offsets(b, idx, b.loss_mask, seg)
    assert cu.tolist() == [0] + diagnostics.segment_ids(b)[2].cumsum(0).tolist() and bool(mask.all())
    meta = copy.copy(b)
    for k, v in vars(b).items():
        setattr(meta, k, v.to("meta"))
    cu, mask = selected_offsets(meta, idx.to("meta"), meta.loss_mask, seg.to("meta"))
    assert cu.device.type == mask.device.type == "meta" and cu.shape == (b.cu_seqlens.numel(),)
    out = concat_layout([meta, meta], [meta.loss_mask, meta.loss_mask])
    assert [t.device.type for t in out] == ["meta"] * 3
    assert [t.numel() for t in out] == [2 * b.loss_mask.numel(), 2 * b.cu_seqlens.numel() - 1,
                                        2 * b.cu_segments.numel() - 1]
    assert [t.device.type for t in concat_layout([], [torch.zeros(0, dtype=torch.bool)])] == ["cpu"] * 3


def test_map_and_layout_on_move_every_tensor_but_the_host_copies():
    b = hand_batch()
    cfg = _cfg()
    mb = layout_on(b, cfg)
    assert mb.idx.device.type == "cpu" and mb.batch.loss_mask is b.loss_mask  # on the CPU: not copied
    moved = layout_on(b, cfg, "meta")
    fields = [f for f in vars(moved) if f not in ("batch", "host")]
    assert all(t.device.type == "meta" for f in fields for t in _tensors(getattr(moved, f)))
    assert all(t.device.type == "meta" for t in _tensors(vars(moved.batch)))
    assert len(_tensors(moved.tables)) == len(_tensors(mb.tables)) > 0
    assert all(t.device.type == "cpu" for t in _tensors(vars(moved.host)))
    assert moved.host is not None and torch.equal(moved.host.loss_mask, b.loss_mask)
    assert b.loss_mask.device.type == "cpu" and mb.idx.device.type == "cpu"  # the original is not moved
    assert moved.n_tokens == mb.n_tokens and moved.reward_mode == mb.reward_mode


class _Recorder:
    """Stands in for ops.global_denominator: records where its inputs are and returns `value` there."""

    def __init__(self, monkeypatch, value=0):
        from compactionrl_fast import ops

        self.calls, self.value = [], value
        monkeypatch.setattr(ops, "global_denominator", self)

    def __call__(self, reduction, mask, cu_seqlens, cu_segments, group, as_tensor):
        self.calls.append((reduction, mask.device.type, cu_seqlens.device.type, cu_segments.device.type, group,
                           as_tensor))
        return torch.tensor(self.value) if as_tensor else self.value


def test_denominator_over_nccl_moves_the_layout_to_the_device(monkeypatch):
    b = hand_batch()
    w = _FakeWorld(monkeypatch, backend="nccl")
    rec = _Recorder(monkeypatch)
    d = denominator([b], [b.loss_mask], "segment-mean", group="g", device="meta")
    assert rec.calls == [("segment-mean", "meta", "meta", "meta", "g", True)] and w.backend_groups == ["g"]
    assert isinstance(d, torch.Tensor) and int(d) == 1  # at least 1, still a tensor


def test_denominators_build_per_minibatch_and_where_the_backend_says(monkeypatch):
    mbs = [MicroBatch.build(hand_batch(seed=s), _cfg()) for s in range(3)]
    cfg = _cfg(loss_reduction="rollout-mean")
    one = Denominators.build(mbs, [[0], [1, 2]], cfg)
    assert one.value == sum(int(m.batch.loss_mask.sum()) for m in mbs)
    assert one.policy == [3, 6]  # rollouts with a trainable token
    w = _FakeWorld(monkeypatch, backend="nccl")
    rec = _Recorder(monkeypatch, value=5)
    d = Denominators.build(mbs, [[0], [1, 2]], cfg, group="g", device="meta")
    assert [c[0] for c in rec.calls] == ["token-mean", "rollout-mean", "rollout-mean"]
    assert all(c[1:] == ("meta", "meta", "meta", "g", True) for c in rec.calls)
    assert set(w.backend_groups) == {"g"}
    assert all(isinstance(x, torch.Tensor) and int(x) == 5 for x in [d.value, *d.policy])
    w = _FakeWorld(monkeypatch, backend="gloo")
    rec.calls.clear()
    d = Denominators.build(mbs, [[0, 1, 2]], cfg, group="g", device="meta")
    assert all(c[1:] == ("cpu", "cpu", "cpu", "g", False) for c in rec.calls) and d.policy == [5]
