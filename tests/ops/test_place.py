"""place_final_rewards on every backend against the float64 reference (compactionrl_fast/reference/gae.py):
"cpp" (csrc/cpu/place.cpp), "triton" (kernels/place.py, under the interpreter), "torch-tuned" (the cummax
composite) and the CUDA C++ kernels (csrc/cuda/place_kernels.cuh) run on the host through
tests/cuda_host_emu.h. Outputs start as NaN (COMPACTIONRL_FAST_POISON, set by tests/conftest.py), so a token
a kernel forgets to write fails. Layouts: tests/utils.py's shape table (empty segments, segments with no
trainable token, single tokens, segments longer than a kernel step), random batches, both index dtypes,
"paper" and "stitched"."""
from __future__ import annotations

import ctypes

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.kernels import _launch as klaunch
from compactionrl_fast.ops import _dispatch
from compactionrl_fast.ops import gae as ops_gae
from compactionrl_fast.reference import gae as ref
from tests.utils import SHAPE_TABLE, RecordOps, build_host_lib, packed_batch, random_case, stub_launches

CPU = torch.device("cpu")
BACKENDS = [b for b in ("cpp", "triton", "torch-tuned", "torch") if b in _dispatch.available(CPU)]
MODES = ("paper", "stitched")
IDX = (torch.int32, torch.int64)


def _cases():
    cases = dict(SHAPE_TABLE)
    cases.update({f"random{k}": random_case(k, n_rollouts=5, max_len=300) for k in range(3)})
    # a rollout whose trainable tokens are all in its first segment, behind long untrainable ones
    cases["late_untrainable"] = [[(50, "rand"), (900, "none"), (3, "none")], [(700, "none")], [(2, "all")]]
    cases["no_rollout_trainable"] = [[(40, "none"), (0, "none")], [(3, "none")]]
    return cases


CASES = _cases()


def _inputs(case, seed, idx):
    b = packed_batch(CASES[case], seed=seed, index_dtype=idx)
    R = b["cu_segments"].numel() - 1
    rr = torch.randn(R, generator=torch.Generator().manual_seed(seed)) + 3.0  # never 0: a placed reward shows
    return rr, b["loss_mask"], b["cu_seqlens"], b["cu_segments"]


def _check(got, rr, mask, cu, cs, mode):
    want = ref.place_final_rewards(rr, mask, cu, cs, mode=mode)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    torch.testing.assert_close(got, want.float(), atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_backend_matches_the_reference(backend, mode, case):
    for k, idx in enumerate(IDX):
        rr, mask, cu, cs = _inputs(case, seed=k, idx=idx)
        _check(crf.place_final_rewards(rr, mask, cu, cs, mode, backend=backend), rr, mask, cu, cs, mode)


@pytest.mark.parametrize("backend", BACKENDS)
def test_defaults_float64_rewards_and_strided_inputs(backend):
    m = torch.tensor([True, True, False, True, False, True, False, False])[::1]
    cu = torch.tensor([0, 3, 6, 8, 8])
    rr = torch.tensor([2.0, 0.0, 3.0, 0.0, 4.0, 0.0, 5.0, 0.0], dtype=torch.float64)[::2]  # one per segment
    got = crf.place_final_rewards(rr, m, cu, backend=backend)
    assert got.tolist() == [0.0, 2.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0]
    got = crf.place_final_rewards(torch.tensor([7.0]), m, cu, torch.tensor([0, 4]), "stitched", backend=backend)
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 7.0, 0.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    e = torch.zeros(0, dtype=torch.bool)
    assert crf.place_final_rewards(torch.zeros(0), e, torch.tensor([0]), backend=backend).shape == (0,)
    out = crf.place_final_rewards(torch.ones(2), e, torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]),
                                  "stitched", backend=backend)
    assert out.shape == (0,)
    out = crf.place_final_rewards(torch.ones(1), torch.ones(3, dtype=torch.bool), torch.tensor([0, 0, 3]),
                                  torch.tensor([0, 2]), backend=backend)
    assert out.tolist() == [0.0, 0.0, 1.0]


def test_backend_argument_is_checked():
    mask, cu = torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="^backend must be one of"):
        crf.place_final_rewards(torch.ones(1), mask, cu, backend="gpu")
    with pytest.raises(ValueError, match="backend='cuda' is not available for cpu tensors"):
        crf.place_final_rewards(torch.ones(1), mask, cu, backend="cuda")


def test_auto_is_the_first_available_of_cpp_triton_torch():
    assert _dispatch.TABLE["place_final_rewards"]["cuda"] == ("triton", "cuda", "torch-tuned", "torch")
    assert _dispatch.TABLE["place_final_rewards"]["cpu"] == ("cpp", "triton", "torch-tuned", "torch")
    rec = RecordOps()
    with rec:
        crf.place_final_rewards(torch.ones(1), torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]))
    want = {"cpp": "place_final_rewards", "triton": "place_final_rewards_triton",
            "torch-tuned": "place_final_rewards_torch"}[_dispatch.available(CPU)[0]]
    assert rec.ops[f"compactionrl_fast.{want}.default"] == 1


# ---------------------------------------------------------------- the Triton kernels at small steps


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton (run under TRITON_INTERPRET=1)")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["long_multiblock", "late_untrainable", "empty_segments", "no_trainable", "random1"])
def test_triton_kernel_scans_several_steps(mode, case):
    """16 mask bytes per step: long segments and long untrainable runs take many steps of the backward scan."""
    from compactionrl_fast.kernels.place import place_final_rewards_fwd

    for k, idx in enumerate(IDX):
        rr, mask, cu, cs = _inputs(case, seed=10 + k, idx=idx)
        _check(place_final_rewards_fwd(rr, mask, cu, cs, mode == "stitched", block=16), rr, mask, cu, cs, mode)


# ---------------------------------------------------------------- the CUDA kernels, run on the host


@pytest.fixture(scope="module", params=[(8, 2), (128, 4)], ids=["block=8x2", "block=128x4"])
def place_host_lib(request, tmp_path_factory):
    """csrc/cuda/place_kernels.cuh built with g++ over tests/cuda_host_emu.h: a small block (segments span many
    windows) and the GPU block shape."""
    threads, items = request.param
    lib = build_host_lib(tmp_path_factory.mktemp("place_cuda_host"), "place_cuda_host.cpp",
                         {"CRF_PLACE_THREADS": threads, "CRF_PLACE_ITEMS": items}, "place_host.so")
    lib.crf_place_host.restype = None
    lib.crf_place_host.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p]
    return lib, threads


def _place_host(lib, rr, mask, cu, cs, stitched):
    out = klaunch.empty(mask.numel())  # NaN under the tests: the zero kernel must write every token
    rr = rr.float().contiguous()
    ptr = lambda t: t.data_ptr() if t.numel() else None
    lib.crf_place_host(ptr(rr), ptr(mask), ptr(cu), ptr(cs), mask.numel(), cu.numel() - 1, cs.numel() - 1,
                       int(stitched), int(cu.dtype == torch.int64), ptr(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_cuda_kernels_on_host_match_reference(place_host_lib, mode):
    lib, threads = place_host_lib
    cases = list(CASES) if threads <= 8 else ["long_multiblock", "late_untrainable", "random0"]  # 128 threads: slow
    for case in cases:
        for k, idx in enumerate(IDX):
            rr, mask, cu, cs = _inputs(case, seed=20 + k, idx=idx)
            _check(_place_host(lib, rr, mask, cu, cs, mode == "stitched"), rr, mask, cu, cs, mode)


# ---------------------------------------------------------------- bad offsets

BAD = {"decreasing": [0, 7, 4, 10], "past_T": [0, 4, 7, 1 << 30], "negative": [0, -3, 7, 10], "last_short": [0, 4, 7, 9],
       "first_not_0": [2, 4, 7, 10]}
BAD_CS = {"ok": [0, 2, 3], "decreasing": [0, 3, 2], "past_S": [0, 2, 9], "negative": [0, -1, 3]}


def _bad_layouts():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    for name, cu in BAD.items():
        for cs_name, cs in BAD_CS.items():
            for idx in IDX:
                yield f"{name}/{cs_name}", mask, torch.tensor(cu, dtype=idx), torch.tensor(cs, dtype=idx)


def _clamped_run(place, label, mask, cu, cs):
    rr = torch.tensor([2.0, 5.0])
    for stitched in (False, True):
        out = place(rr, mask, cu, cs, stitched)
        assert out.shape == (10,) and out.dtype == torch.float32, label
        assert bool(torch.isin(out, torch.tensor([0.0, 2.0, 5.0])).all()), (label, out)  # written, no garbage
        assert not bool(out[~mask].any()), (label, out)  # only trainable tokens get a reward


@pytest.mark.parametrize("backend", [b for b in ("triton", "torch-tuned") if b in BACKENDS])
def test_unchecked_bad_offsets_are_clamped(backend):
    """The kernels that never read offsets on the host clamp them: some rewards, on trainable tokens only."""
    op = getattr(torch.ops.compactionrl_fast, {"triton": "place_final_rewards_triton",
                                               "torch-tuned": "place_final_rewards_torch"}[backend])
    for label, mask, cu, cs in _bad_layouts():
        _clamped_run(op, label, mask, cu, cs)


@pytest.mark.slow
def test_cuda_kernels_on_host_clamp_bad_offsets(place_host_lib):
    lib, threads = place_host_lib
    if threads > 8:
        pytest.skip("small blocks only")
    for label, mask, cu, cs in _bad_layouts():
        _clamped_run(lambda *a: _place_host(lib, *a), label, mask, cu, cs)


@pytest.mark.skipif("cpp" not in BACKENDS, reason="needs the compiled extension")
def test_raw_cpp_op_rejects_bad_offsets():
    """The C++ op indexes with the offsets, so it checks them itself (the Python checks may be off)."""
    op = torch.ops.compactionrl_fast.place_final_rewards
    for name, cu in BAD.items():
        for idx in IDX:
            with pytest.raises(ValueError, match=r"^place_final_rewards: cu_seqlens"):
                op(torch.ones(2), torch.ones(10, dtype=torch.bool), torch.tensor(cu, dtype=idx),
                   torch.tensor([0, 2, 3], dtype=idx), False)
    good = torch.tensor([0, 4, 7, 10])
    for cs_name, cs in BAD_CS.items():
        if cs_name != "ok":
            with pytest.raises(ValueError, match=r"^place_final_rewards \(cu_segments\)"):
                op(torch.ones(2), torch.ones(10, dtype=torch.bool), good, torch.tensor(cs), False)
    with pytest.raises(ValueError, match="rollout_rewards must be"):
        op(torch.ones(3), torch.ones(10, dtype=torch.bool), good, torch.tensor([0, 2, 3]), False)
    with pytest.raises(TypeError, match="share one dtype"):
        op(torch.ones(2), torch.ones(10, dtype=torch.bool), good, torch.tensor([0, 2, 3], dtype=torch.int32), False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checks_off_still_refuse_or_clamp(monkeypatch, backend):
    """COMPACTIONRL_FAST_CHECKS=0 (no Python value checks): cpp raises the C++ check's ValueError, the others
    clamp."""
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "0")
    mask = torch.ones(10, dtype=torch.bool)
    cu, cs = torch.tensor([0, 7, 4, 10]), torch.tensor([0, 2, 3])
    if backend == "cpp":
        with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
            crf.place_final_rewards(torch.ones(2), mask, cu, cs, backend=backend)
    else:
        out = crf.place_final_rewards(torch.ones(2), mask, cu, cs, backend=backend)
        assert bool(torch.isin(out, torch.tensor([0.0, 1.0])).all())


# ---------------------------------------------------------------- no host read on CUDA tensors


@pytest.mark.parametrize("stitched", [False, True])
@pytest.mark.parametrize("idx", IDX)
def test_torch_backend_has_no_host_read_off_the_cpu(stitched, idx):
    """The composite on meta tensors (standing in for a GPU: a host read of one raises): every buffer on the
    inputs' device, a bounded number of ops."""
    mask = torch.empty(64, dtype=torch.bool, device="meta")
    cu, cs = torch.empty(4, dtype=idx, device="meta"), torch.empty(3, dtype=idx, device="meta")
    rec = RecordOps()
    with rec:
        out = ops_gae._place_final_rewards(torch.empty(2, device="meta"), mask, cu, cs, stitched)
    assert out.device.type == "meta" and out.shape == (64,) and out.dtype == torch.float32
    assert rec.total <= 32, dict(rec.ops)
    with pytest.raises(Exception, match="meta"):
        mask.any().item()  # the check above can fail


@pytest.mark.skipif(not _dispatch.has_triton(), reason="needs triton")
@pytest.mark.parametrize("stitched", [False, True])
@pytest.mark.parametrize("idx", IDX)
def test_triton_glue_on_cuda_launches_and_ops(monkeypatch, stitched, idx):
    """The Triton launcher on fake CUDA tensors, its launches stubbed: the zero fill over ceil(T/ZERO_BLOCK)
    programs, then one program per rollout at the sizes kernels/place.py's `AOT` compiles; no host read, and no
    op but the output's allocation (the device guard left out: no CUDA here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compactionrl_fast.kernels import place as kplace

    launches = stub_launches(monkeypatch, kplace, ("_zero_kernel", "_place_kernel"))
    monkeypatch.setattr(klaunch, "POISON", False)
    with FakeTensorMode():
        T, R = 5000, 3
        mask = torch.ones(T, dtype=torch.bool, device="cuda")
        cu = torch.tensor([0, 100, 2000, 4000, 4500, T], dtype=idx, device="cuda")
        cs = torch.tensor([0, 2, 4, 5], dtype=idx, device="cuda")
        rr, rec = torch.ones(R, device="cuda"), RecordOps()
        with rec:
            out = kplace._place_final_rewards_fwd(rr, mask, cu, cs, stitched)
    assert out.shape == (T,) and out.device.type == "cuda"
    assert [(n, g) for n, g, _ in launches] == [("_zero_kernel", (-(-T // kplace.ZERO_BLOCK),)), ("_place_kernel", (R,))]
    assert launches[0][2]["BLOCK"] == kplace.ZERO_BLOCK
    assert launches[1][2] == dict(STITCHED=stitched, BLOCK=kplace.BLOCK, num_warps=kplace.NUM_WARPS)
    assert dict(rec.ops) == {"aten.empty.memory_format": 1}, dict(rec.ops)
