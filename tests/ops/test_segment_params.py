"""segment_params (segment_gae's per-segment numbers alone): every backend against the reference's
`segment_params` on shape-table and random layouts (empty, untrainable and single-token segments, both index
dtypes, every lambda and cross-segment mode), the argument checks, routing, torch.compile, and agreement with
what segment_gae does with the same numbers."""
import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.kernels import modes
from compactionrl_fast.ops._dispatch import available
from compactionrl_fast.reference import gae as ref
from tests.utils import RecordOps, SHAPE_TABLE, packed_batch, random_case

BACKENDS = [b for b in ("cpp", "triton", "torch") if b in available(torch.device("cpu"))]
LAMS = [(0.95, "rollout"), ("adaptive", "rollout"), ("adaptive", "segment"), ("tensor", "rollout")]
CASE = SHAPE_TABLE["empty_segments"] + SHAPE_TABLE["no_trainable"] + SHAPE_TABLE["four_segments"] + \
    SHAPE_TABLE["single_token"]


def _lam(lam, S, seed=1):
    """The lam argument: a float32 per-segment tensor for "tensor" (the ops read lam as float32)."""
    return torch.rand(S, generator=torch.Generator().manual_seed(seed)) if lam == "tensor" else lam


def _check(b, backend, **kw):
    got = crf.segment_params(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], backend=backend, **kw)
    want = ref.segment_params(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], **kw)
    assert got.dtype == torch.float64 and got.shape == want.shape == (4, b["cu_seqlens"].numel() - 1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cross", list(modes.CROSS_SEGMENT))
@pytest.mark.parametrize("lam,length", LAMS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_matches_reference_shape_table(backend, cross, lam, length, index_dtype):
    b = packed_batch(CASE, index_dtype=index_dtype)
    S = b["cu_seqlens"].numel() - 1
    for lam_critic in (1.0, None, 0.9):
        _check(b, backend, gamma=0.99, lam=_lam(lam, S), cross_segment=cross, lam_critic=lam_critic,
               adaptive_alpha=1.5, adaptive_length=length)


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow) if b == "triton" else b
                                     for b in BACKENDS])
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_random(backend, seed):
    b = packed_batch(random_case(seed, max_len=60), seed=seed, index_dtype=(torch.int32, torch.int64)[seed % 2])
    S = b["cu_seqlens"].numel() - 1
    for cross in modes.CROSS_SEGMENT:
        for lam, length in LAMS:
            _check(b, backend, gamma=0.9, lam=_lam(lam, S, seed), cross_segment=cross, adaptive_alpha=2.0,
                   adaptive_length=length, lam_critic=None if seed % 2 else 0.95)


@pytest.mark.parametrize("backend", BACKENDS)
def test_defaults_no_cu_segments_and_empty(backend):
    b = packed_batch(CASE)
    got = crf.segment_params(b["loss_mask"], b["cu_seqlens"], backend=backend)
    torch.testing.assert_close(got, ref.segment_params(b["loss_mask"], b["cu_seqlens"]), rtol=1e-12, atol=0)
    assert bool((got[2] == 1).all()) and bool((got[3] == 1).all())  # one segment per rollout: nothing later
    for T, cu, cs in ((0, [0], [0]), (0, [0, 0, 0], [0, 2]), (0, [0, 0], [0, 0, 1])):  # no token; empty segments
        m = torch.zeros(T, dtype=torch.bool)
        got = crf.segment_params(m, torch.tensor(cu), torch.tensor(cs), backend=backend)
        torch.testing.assert_close(got, ref.segment_params(m, torch.tensor(cu), torch.tensor(cs)), rtol=0, atol=0)


def test_is_what_segment_gae_scales_by():
    """The paper's advantages are the "none" ones times row 2, segment by segment (lam_critic 1 and one
    segment per rollout leave nothing else between them)."""
    b = packed_batch(SHAPE_TABLE["four_segments"])
    args = (b["rewards"], b["values"], b["loss_mask"], b["cu_seqlens"], b["cu_segments"])
    kw = dict(gamma=0.99, lam="adaptive")
    scale = crf.segment_params(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], **kw)[2]
    seg = torch.repeat_interleave(torch.arange(scale.numel()), b["cu_seqlens"].diff().long())
    paper, _ = crf.segment_gae(*args, cross_segment="paper", **kw)
    none, _ = crf.segment_gae(*args, cross_segment="none", **kw)
    torch.testing.assert_close(paper.double(), none.double() * scale[seg], rtol=1e-6, atol=1e-6)


def test_default_backend_is_cpp_on_cpu_and_triton_runs_the_triton_op():
    b = packed_batch(CASE)
    args = (b["loss_mask"], b["cu_seqlens"], b["cu_segments"])
    for backend, op in (("auto", "segment_gae_params"), ("triton", "segment_gae_params_triton")):
        if backend == "triton" and "triton" not in BACKENDS or "cpp" not in BACKENDS:
            continue
        with RecordOps() as ops:
            crf.segment_params(*args, backend=backend)
        assert ops.ops[f"compactionrl_fast.{op}.default"] == 1, ops.ops


@pytest.mark.parametrize("kw,exc,match", [
    (dict(cross_segment="bogus"), ValueError, "cross_segment"),
    (dict(gamma=1.5), ValueError, "gamma"),
    (dict(lam="fixed"), ValueError, "lam"),
    (dict(lam=torch.full((3,), 0.5)), ValueError, "lam"),
    (dict(lam=torch.full((9,), 2.0)), ValueError, "lam"),
    (dict(lam_critic=-0.1), ValueError, "lam_critic"),
    (dict(adaptive_alpha=0.0), ValueError, "adaptive_alpha"),
    (dict(adaptive_length="episode"), ValueError, "adaptive_length"),
    (dict(backend="cuda"), ValueError, "backend"),
])
def test_bad_arguments_name_the_argument(kw, exc, match):
    b = packed_batch(SHAPE_TABLE["four_segments"])  # S = 9
    with pytest.raises(exc, match=match):
        crf.segment_params(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], **kw)


def test_bad_layout_names_the_argument():
    m = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match="cu_seqlens"):
        crf.segment_params(m, torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match="cu_segments"):
        crf.segment_params(m, torch.tensor([0, 3, 5]), torch.tensor([0, 3]))
    with pytest.raises(TypeError, match="loss_mask"):
        crf.segment_params(m.float(), torch.tensor([0, 3, 5]))


@pytest.mark.parametrize("backend", [b for b in ("cpp", "triton") if b in BACKENDS])
def test_compiles_fullgraph(backend):
    torch._dynamo.reset()
    b = packed_batch(SHAPE_TABLE["four_segments"])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(mask, cu, cs):
        return crf.segment_params(mask, cu, cs, gamma=0.9, backend=backend) * 2

    got = f(b["loss_mask"], b["cu_seqlens"], b["cu_segments"])
    torch.testing.assert_close(got, 2 * ref.segment_params(b["loss_mask"], b["cu_seqlens"], b["cu_segments"],
                                                           gamma=0.9), rtol=1e-12, atol=0)
