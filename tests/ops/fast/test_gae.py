"""compactionrl_fast.ops.gae's Python entry on the cpp and torch backends, fast (a few seconds): every
argument check with the argument named, every lambda / cross-segment / layout branch against the reference
called directly, placed segments, dtypes and strides, the fake impl and its registration. The Triton and
CUDA kernels are tested in tests/ops/test_gae.py."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops import gae as ops_gae
from compactionrl_fast.reference import gae as ref
from tests.utils import CountOps, SHAPE_TABLE, packed_batch

BACKENDS = ("cpp", "torch")
OP = {"cpp": "compactionrl_fast.segment_gae.default", "torch": None}


def _batch(name="four_segments", index_dtype=torch.int64):
    return packed_batch(SHAPE_TABLE[name], seed=3, index_dtype=index_dtype)


def _args(b):
    return b["rewards"], b["values"], b["loss_mask"], b["cu_seqlens"], b["cu_segments"]


def _close(got, want):
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [
    dict(gamma=0.9, lam=0.8, cross_segment="paper", lam_critic=1.0),
    dict(gamma=0.97, lam=0.7, cross_segment="none", lam_critic=None),
    dict(gamma=0.95, lam=0.6, cross_segment="stitched", lam_critic=0.5),
    dict(gamma=1.0, lam="adaptive", cross_segment="paper", adaptive_length="rollout", adaptive_alpha=2.0),
    dict(gamma=0.9, lam="adaptive", cross_segment="stitched", adaptive_length="segment", lam_critic=None),
    dict(gamma=0.99, lam="adaptive", cross_segment="none", adaptive_length="segment", adaptive_alpha=0.7),
])
def test_matches_reference(backend, kw):
    b = _batch()
    want = ref.segment_gae(*_args(b), **kw)
    with CountOps() as ops:
        got = crf.segment_gae(*_args(b), backend=backend, **kw)
    for g, w in zip(got, want):
        _close(g, w)
    if OP[backend]:
        assert ops.ops[OP[backend]] == 1, ops.ops
    else:
        assert not any(k.startswith("compactionrl_fast.") for k in ops.ops), ops.ops


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cross", ["paper", "stitched"])
def test_per_segment_lambda_tensor(backend, cross):
    b = _batch()
    S = b["cu_seqlens"].numel() - 1
    lam = torch.linspace(0.1, 1.0, S, dtype=torch.float64).requires_grad_()
    want = ref.segment_gae(*_args(b), gamma=0.9, lam=lam.detach(), cross_segment=cross, lam_critic=None)
    got = crf.segment_gae(*_args(b), gamma=0.9, lam=lam, cross_segment=cross, lam_critic=None, backend=backend)
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_defaults_and_no_cu_segments(backend):
    # defaults: gamma 1, adaptive lambda (alpha 1.5, rollout length), paper, lam_critic 1; cu_segments None:
    # every segment its own rollout
    b = _batch()
    r, v, m, cu, _ = _args(b)
    want = ref.segment_gae(r, v, m, cu, torch.arange(cu.numel()))
    for g, w in zip(crf.segment_gae(r, v, m, cu, backend=backend), want):
        _close(g, w)
    want_roll = ref.segment_gae(*_args(b))
    assert not torch.allclose(want_roll[0], want[0])  # the rollouts matter in this case
    for g, w in zip(crf.segment_gae(*_args(b), backend=backend), want_roll):
        _close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seg_dtype", [torch.int32, torch.int64])
def test_dtypes_strides_and_grad_inputs(backend, seg_dtype):
    # float64 / bf16 inputs needing grad, strided views, int32 offsets with int64 cu_segments
    b = _batch(index_dtype=torch.int32)
    r, v, m, cu, seg = _args(b)
    T = m.numel()
    r2 = torch.zeros(2 * T, dtype=torch.float64)
    r2[::2] = r
    v2 = torch.zeros(2 * T, dtype=torch.bfloat16)
    v2[::2] = v
    m2 = torch.zeros(2 * T, dtype=torch.bool)
    m2[::2] = m
    cu2 = torch.zeros(2 * cu.numel(), dtype=cu.dtype)
    cu2[::2] = cu
    r_in, v_in = r2[::2].requires_grad_(), v2[::2].requires_grad_()
    want = ref.segment_gae(r, v2[::2].float(), m, cu, seg, gamma=0.9, lam=0.9)
    got = crf.segment_gae(r_in, v_in, m2[::2], cu2[::2], seg.to(seg_dtype), gamma=0.9, lam=0.9, backend=backend)
    for g, w in zip(got, want):
        _close(g, w)
        assert not g.requires_grad


def test_default_backend_is_cpp_on_cpu():
    b = _batch()
    with CountOps() as ops:
        got = crf.segment_gae(*_args(b), gamma=0.9, lam=0.9)
    assert ops.ops[OP["cpp"]] == 1, ops.ops
    for g, w in zip(got, ref.segment_gae(*_args(b), gamma=0.9, lam=0.9)):
        _close(g, w)


def test_triton_backend_runs_the_triton_op():
    # routing only (a 7-token batch under the interpreter); the kernels: tests/ops/test_gae.py
    pytest.importorskip("triton")
    m = torch.tensor([True, True, False, True, True, False, True])
    r, v, cu = torch.arange(7.0), torch.ones(7), torch.tensor([0, 3, 7])
    with CountOps() as ops:
        got = crf.segment_gae(r, v, m, cu, gamma=0.9, lam=0.8, backend="triton")
    assert ops.ops["compactionrl_fast.segment_gae_triton.default"] == 1, ops.ops
    for g, w in zip(got, ref.segment_gae(r, v, m, cu, gamma=0.9, lam=0.8)):
        _close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    e = torch.zeros(0)
    adv, ret = crf.segment_gae(e, e, torch.zeros(0, dtype=torch.bool), torch.zeros(1, dtype=torch.int64),
                               torch.zeros(1, dtype=torch.int64), backend=backend)
    assert adv.shape == ret.shape == (0,) and adv.dtype == ret.dtype == torch.float32


# ---------------------------------------------------------------- placed segments (seg_start)


def _placed(b, order):
    """The batch with its segments stored in `order` (a permutation of segment ids): (physical tensors, seg_start)."""
    cu = b["cu_seqlens"].long()
    lens = cu.diff()
    seg_start = torch.zeros(lens.numel(), dtype=torch.int64)
    pos = 0
    for s in order:
        seg_start[s] = pos
        pos += int(lens[s])
    idx = torch.cat([torch.arange(int(seg_start[s]), int(seg_start[s] + lens[s])) for s in range(lens.numel())])
    phys = {}
    for k in ("rewards", "values", "loss_mask"):
        phys[k] = torch.empty_like(b[k]).index_copy_(0, idx, b[k])
    return phys, seg_start, idx


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["four_segments", "empty_segments"])
def test_seg_start_matches_logical_order(backend, name):
    b = _batch(name)
    S = b["cu_seqlens"].numel() - 1
    order = list(range(S))[::-1]
    phys, seg_start, idx = _placed(b, order)
    kw = dict(gamma=0.9, lam="adaptive", cross_segment="paper", adaptive_length="segment", lam_critic=0.7,
              adaptive_alpha=2.5)
    want = ref.segment_gae(*_args(b), **kw)
    with CountOps() as ops:
        got = crf.segment_gae(phys["rewards"], phys["values"], phys["loss_mask"], b["cu_seqlens"], b["cu_segments"],
                              seg_start=seg_start, backend=backend, **kw)
    if OP[backend]:
        assert ops.ops[OP[backend]] == 1, ops.ops
    else:
        assert not any(k.startswith("compactionrl_fast.") for k in ops.ops), ops.ops
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g[idx].double(), w, rtol=1e-5, atol=1e-5)


def test_seg_start_identity_on_torch_is_the_plain_call():
    b = _batch()
    cu = b["cu_seqlens"]
    seg_start = cu[:-1].long()
    want = crf.segment_gae(*_args(b), gamma=0.9, lam=0.9, cross_segment="stitched", backend="torch")
    got = crf.segment_gae(*_args(b), gamma=0.9, lam=0.9, cross_segment="stitched", seg_start=seg_start,
                          backend="torch")
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_placed_index():
    # segments of lengths 2, 0, 3 stored at 3, 5, 0: logical token i lives at physical placed[i]
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    idx = ops_gae._placed_index(torch.tensor([3, 5, 0]), cu)
    assert idx.tolist() == [3, 4, 0, 1, 2] and idx.dtype == torch.int64


@pytest.mark.parametrize("starts, lens, match", [
    ([-1, 2], [2, 2], r"seg_start\[0\]=-1 puts segment 0 \(2 tokens\) outside \[0, T=4\)"),
    ([0, 3], [2, 2], r"seg_start\[1\]=3 puts segment 1 \(2 tokens\) outside \[0, T=4\)"),
    ([2, 3], [2, 2], r"^seg_start\[1\]=3 puts segment 1 \(2 tokens\) outside \[0, T=4\)$"),
    ([0, 1], [2, 2], "^seg_start must place the segments so that they cover \\[0, T\\) without gaps or overlaps$"),
    ([2, 2], [2, 2], "without gaps or overlaps"),
    ([1, 1], [2, 2], "without gaps or overlaps"),
    ([0, 0], [2, 2], "without gaps or overlaps"),
    ([1], [1], r"seg_start\[0\]=1 puts segment 0 \(1 tokens\) outside \[0, T=1\)"),
])
def test_seg_start_refused(starts, lens, match):
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    z = torch.zeros(T)
    with pytest.raises(ValueError, match=match):
        crf.segment_gae(z, z, torch.ones(T, dtype=torch.bool), cu, seg_start=torch.tensor(starts), backend="torch")


def test_seg_start_overlap_of_single_tokens_refused():
    # lens 1, 1, 2 at 0, 0, 2: two one-token segments overlap (a check skipping length-1 segments misses it)
    cu = torch.tensor([0, 1, 2, 4])
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="seg_start must place the segments"):
        crf.segment_gae(z, z, torch.ones(4, dtype=torch.bool), cu, seg_start=torch.tensor([0, 0, 2]),
                        backend="cpp")


def test_seg_start_empty_segments_anywhere_in_range():
    # an empty segment may sit at any start in [0, T] (it covers nothing); single-token segments count
    cu = torch.tensor([0, 1, 1, 3, 4])
    r, v = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 0.25, 0.0, 1.0])
    m = torch.tensor([True, True, False, True])
    seg_start = torch.tensor([3, 4, 0, 2])  # segment 0 (1 token) last, segment 3 (1 token) at 2
    for backend in BACKENDS:
        adv, ret = crf.segment_gae(r, v, m, cu, seg_start=seg_start, gamma=0.5, lam=0.5, backend=backend)
        idx = torch.tensor([3, 0, 1, 2])
        want_a, want_r = ref.segment_gae(r[idx], v[idx], m[idx], cu, gamma=0.5, lam=0.5)
        torch.testing.assert_close(adv[idx].double(), want_a)
        torch.testing.assert_close(ret[idx].double(), want_r)


@pytest.mark.parametrize("kw, err, match", [
    (dict(seg_start=torch.tensor([0.0, 2.0])), TypeError, "^seg_start must have dtype"),
    (dict(seg_start=torch.tensor([0, 2], dtype=torch.int32)), TypeError, "^seg_start must have dtype"),
    (dict(seg_start=torch.tensor([0])), ValueError, "^seg_start must have 2 elements"),
    (dict(seg_start=torch.tensor([[0, 2]])), ValueError, "^seg_start must be 1-D"),
])
def test_seg_start_type_and_shape(kw, err, match):
    z = torch.zeros(4)
    with pytest.raises(err, match=match):
        crf.segment_gae(z, z, torch.ones(4, dtype=torch.bool), torch.tensor([0, 2, 4]), backend="cpp", **kw)


def test_seg_start_not_read_without_value_checks(monkeypatch):
    # COMPACTIONRL_FAST_CHECKS=0: the Python side reads no seg_start value (on CUDA: no host sync); the torch
    # path then places overlapping segments as told, the C++ op refuses them itself
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "0")
    z, m, cu, bad = torch.ones(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 2, 4]), torch.tensor([0, 0])
    adv, _ = crf.segment_gae(z, z, m, cu, seg_start=bad, gamma=0.9, lam=0.9, backend="torch")
    assert adv.shape == (4,)
    with pytest.raises(ValueError, match="^segment_gae: the segments placed by seg_start must cover"):
        crf.segment_gae(z, z, m, cu, seg_start=bad, gamma=0.9, lam=0.9, backend="cpp")


def test_seg_start_without_segments():
    e = torch.zeros(0)
    adv, _ = crf.segment_gae(e, e, torch.zeros(0, dtype=torch.bool), torch.zeros(1, dtype=torch.int64),
                             seg_start=torch.zeros(0, dtype=torch.int64), backend="cpp")
    assert adv.shape == (0,)


def test_seg_start_on_cuda_backend_refused():
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="cuda"):
        crf.segment_gae(z, z, torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]), seg_start=torch.tensor([0]),
                        backend="cuda")


# ---------------------------------------------------------------- argument checks


def _call(**over):
    T = 4
    kw = dict(rewards=torch.zeros(T), values=torch.zeros(T), loss_mask=torch.ones(T, dtype=torch.bool),
              cu_seqlens=torch.tensor([0, 2, 4]), cu_segments=torch.tensor([0, 2]), backend="cpp")
    kw.update(over)
    return crf.segment_gae(**kw)


META = torch.device("meta")


@pytest.mark.parametrize("over, err, match", [
    (dict(loss_mask=torch.ones(4)), TypeError, "^loss_mask must have dtype"),
    (dict(loss_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "^loss_mask must be 1-D"),
    (dict(rewards=torch.zeros(3)), ValueError, "^rewards has 3 elements but loss_mask has 4"),
    (dict(values=torch.zeros(5)), ValueError, "^values has 5 elements but loss_mask has 4: rewards, values and "
                                              r"loss_mask must all be \[T\]"),
    (dict(values=None), TypeError, "^values must be a torch.Tensor"),
    (dict(rewards=torch.zeros(4, dtype=torch.int64)), TypeError, "^rewards must have dtype"),
    (dict(values=torch.zeros(2, 2)), ValueError, "^values must be 1-D"),
    (dict(rewards=torch.zeros(4, device=META)), ValueError, "^rewards is on meta"),
    (dict(values=torch.zeros(4, device=META)), ValueError, "^values is on meta"),
    (dict(cu_seqlens=torch.tensor([0.0, 4.0])), TypeError, "^cu_seqlens must have dtype"),
    (dict(cu_seqlens=torch.tensor([[0, 4]])), ValueError, "^cu_seqlens must be 1-D"),
    (dict(cu_seqlens=torch.tensor([0, 4], device=META)), ValueError, "^cu_seqlens is on meta"),
    (dict(cu_seqlens=torch.tensor([0, 3])), ValueError, r"^cu_seqlens\[-1\] must equal"),
    (dict(cu_segments=torch.tensor([0, 3])), ValueError, r"^cu_segments\[-1\] must equal"),
    (dict(gamma=1.5), ValueError, r"^gamma must be in \[0.0, 1.0\]"),
    (dict(gamma=-0.5), ValueError, r"^gamma must be in \[0.0, 1.0\]"),
    (dict(gamma="x"), TypeError, "^gamma must be a float"),
    (dict(cross_segment="both"), ValueError, "^cross_segment must be one of"),
    (dict(adaptive_length="token"), ValueError, "^adaptive_length must be one of"),
    (dict(adaptive_alpha=0.0), ValueError, "^adaptive_alpha must be > 0, got 0.0"),
    (dict(adaptive_alpha=-1.0), ValueError, r"^adaptive_alpha must be in \[0.0, inf\]"),
    (dict(lam="fixed"), ValueError, "^lam must be a float, a per-segment tensor or 'adaptive', got 'fixed'"),
    (dict(lam=1.5), ValueError, r"^lam must be in \[0.0, 1.0\]"),
    (dict(lam=-0.1), ValueError, r"^lam must be in \[0.0, 1.0\]"),
    (dict(lam=torch.tensor([0.5])), ValueError, "^lam must have 2 elements"),
    (dict(lam=torch.tensor([0.5, 0.5, 0.5])), ValueError, "^lam must have 2 elements"),
    (dict(lam=torch.tensor([[0.5, 0.5]])), ValueError, "^lam must be 1-D"),
    (dict(lam=torch.tensor([0.5, 0.5], device=META)), ValueError, "^lam is on meta"),
    (dict(lam=torch.tensor([1, 1])), TypeError, "^lam must have dtype"),
    (dict(lam=torch.tensor([0.5, 1.5])), ValueError, r"^lam \(per-segment tensor\) must hold values in \[0, 1\]$"),
    (dict(lam=torch.tensor([-0.5, 0.5])), ValueError, r"^lam \(per-segment tensor\)"),
    (dict(lam=torch.tensor([float("nan"), 0.5])), ValueError, r"^lam \(per-segment tensor\)"),
    (dict(lam_critic=2.0), ValueError, r"^lam_critic must be in \[0.0, 1.0\]"),
    (dict(lam_critic=-0.1), ValueError, r"^lam_critic must be in \[0.0, 1.0\]"),
    (dict(seg_start=torch.tensor([0, 2], device=META)), ValueError, "^seg_start is on meta"),
    (dict(backend="nope"), ValueError, "backend"),
    (dict(backend="cuda"), ValueError, "this op has no cuda backend"),
])
def test_refused_naming_the_argument(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


def test_lam_tensor_bounds_are_inclusive():
    adv, _ = _call(lam=torch.tensor([0.0, 1.0]), gamma=0.0)
    assert adv.shape == (4,)
    _call(adaptive_alpha=1e-3, gamma=1.0)


# ---------------------------------------------------------------- place_final_rewards


@pytest.mark.parametrize("mode", ["paper", "stitched"])
@pytest.mark.parametrize("name", ["four_segments", "empty_segments", "no_trainable"])
def test_place_final_rewards_matches_reference(mode, name):
    b = _batch(name, index_dtype=torch.int32)
    R = b["cu_segments"].numel() - 1
    rr = torch.arange(1, R + 1, dtype=torch.float64) * 1.25
    got = crf.place_final_rewards(rr, b["loss_mask"], b["cu_seqlens"], b["cu_segments"], mode=mode)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref.place_final_rewards(rr, b["loss_mask"], b["cu_seqlens"],
                                                                      b["cu_segments"], mode=mode))


def test_place_final_rewards_defaults():
    # default mode "paper", default rollouts (one per segment); strided inputs
    m = torch.tensor([True, True, False, True, False, True])
    cu = torch.tensor([0, 3, 6])
    rr = torch.tensor([2.0, 0.0, 3.0, 0.0])[::2]
    assert crf.place_final_rewards(rr, m, cu).tolist() == [0.0, 2.0, 0.0, 0.0, 0.0, 3.0]
    assert crf.place_final_rewards(torch.tensor([5.0]), m, cu, torch.tensor([0, 2])).tolist() == \
        [0.0, 5.0, 0.0, 0.0, 0.0, 5.0]
    assert crf.place_final_rewards(torch.tensor([5.0]), m, cu, torch.tensor([0, 2]), "stitched").tolist() == \
        [0.0, 0.0, 0.0, 0.0, 0.0, 5.0]


def test_place_final_rewards_detaches():
    rr = torch.tensor([1.0], requires_grad=True)
    out = crf.place_final_rewards(rr, torch.tensor([True, True]), torch.tensor([0, 2]))
    assert out.tolist() == [0.0, 1.0] and not out.requires_grad


@pytest.mark.parametrize("args, err, match", [
    ((torch.zeros(1), torch.ones(2), torch.tensor([0, 2])), TypeError, "^loss_mask must have dtype"),
    ((torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), torch.tensor([0, 2])), ValueError, "^loss_mask must be 1-D"),
    ((torch.zeros(1, dtype=torch.int64), torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])), TypeError,
     "^rollout_rewards must have dtype"),
    ((torch.zeros(1, 1), torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])), ValueError,
     "^rollout_rewards must be 1-D"),
    ((torch.zeros(1, device="meta"), torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])), ValueError,
     "^rollout_rewards is on meta"),
    ((torch.zeros(2), torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])), ValueError,
     r"rollout_rewards must have one reward per rollout \(R=1\), got shape \(2,\)"),
    ((torch.zeros(1), torch.ones(2, dtype=torch.bool), torch.tensor([0, 3])), ValueError, "cu_seqlens"),
])
def test_place_final_rewards_refused(args, err, match):
    with pytest.raises(err, match=match):
        crf.place_final_rewards(*args)


def test_place_final_rewards_mode_refused():
    with pytest.raises(ValueError, match="^mode must be one of"):
        crf.place_final_rewards(torch.zeros(1), torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]), mode="last")


# ---------------------------------------------------------------- fake impl and its registration


def test_fake_impl_shapes():
    r = torch.zeros(5, dtype=torch.float64)
    adv, ret = ops_gae._gae_fake(r, r, torch.ones(7, dtype=torch.bool), None, None, None, 1.0, 1.0, 0, 1.5, 1, 1.0)
    assert adv.shape == ret.shape == (7,) and adv.dtype == ret.dtype == torch.float32


def test_fake_impl_is_registered_for_the_cpp_ops(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.library, "register_fake", lambda name, fn: seen.append((name, fn)))
    ops_gae._register_cpp_fake()
    assert seen == [("compactionrl_fast::segment_gae", ops_gae._gae_fake)]

