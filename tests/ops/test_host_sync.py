"""No host sync on CUDA tensors and few eager ops per call: every registered op on its spec's cases, the
registered backwards, and segment_gae's Triton glue down to its (stubbed) launches.

Sync-freedom is checked without a GPU: under FakeTensorMode, tensors made with device="cuda" exist on a
CPU-only torch, and any read of device data on the host raises DataDependentOutputException.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compactionrl_fast as crf
from compactionrl_fast.kernels import _launch as klaunch
from compactionrl_fast.ops import _dispatch
from tests.ops import registry_runs as reg
from tests.utils import RecordOps, stub_launches


def _fake_batch(T=64):
    dev = "cuda"
    return dict(mask=torch.ones(T, dtype=torch.bool, device=dev), cu=torch.tensor([0, 20, 40, 64], device=dev),
                cs=torch.tensor([0, 2, 3], device=dev), x=torch.zeros(T, device=dev), y=torch.zeros(T, device=dev),
                rr=torch.ones(2, device=dev), h=torch.zeros(T, 8, device=dev, dtype=torch.bfloat16),
                w=torch.zeros(8, device=dev), lm_head=torch.zeros(50, 8, device=dev, dtype=torch.bfloat16),
                targets=torch.zeros(T, dtype=torch.int64, device=dev), dev=dev, T=T)


# Every registered op's spec cases (compactionrl_fast/ops/_registry.py: a new op is checked with no edit here),
# within its spec's eager-op budget: what it may dispatch around its kernels (outputs included); a change that
# adds ops or a host sync fails here.
REGISTERED = [(s.name, c) for s in reg.public_specs() for c in s.cases(torch.device("cpu"))]


@pytest.mark.skipif(not _dispatch.has_triton(), reason="the CUDA default backend is triton")
@pytest.mark.parametrize("op,case", REGISTERED, ids=[f"{o}-{c}" for o, c in REGISTERED])
def test_registered_op_has_no_host_sync_on_cuda(op, case):
    spec = reg.SPECS[op]
    with FakeTensorMode():
        kw = spec.cases(torch.device("cuda"))[case]
        counter = RecordOps()
        with counter:
            spec.fn(**kw)  # a host read of device data raises DataDependentOutputException here
    assert counter.total <= spec.budget, f"{op} {case}: {counter.total} ops > {spec.budget}: {dict(counter.ops)}"


# (name, call, eager-op budget): the calls the specs' cases do not make (other backends and arguments, the
# functions built on the ops)
CALLS = [
    ("place_final_rewards stitched torch-tuned", lambda b: crf.place_final_rewards(
        b["rr"], b["mask"], b["cu"], b["cs"], "stitched", backend="torch-tuned"), 8),
    ("ppo_policy_loss denominator", lambda b: crf.ppo_policy_loss(b["x"], b["y"], b["y"], b["mask"], denominator=512.0), 8),
    ("global_token_count", lambda b: crf.global_token_count(b["mask"], as_tensor=True), 8),
    ("value_head_loss", lambda b: crf.value_head_loss(b["h"], b["w"], None, b["x"], b["y"], b["mask"], clip=0.2), 8),
    ("linear_logprobs bf16", lambda b: crf.linear_logprobs(b["h"], b["lm_head"], b["targets"], return_entropy=True,
                                                           temperature=0.7), 8),
]


@pytest.mark.skipif(not _dispatch.has_triton(), reason="the CUDA default backend is triton")
@pytest.mark.parametrize("name,call,budget", CALLS, ids=[c[0] for c in CALLS])
def test_no_host_sync_on_cuda_and_op_budget(name, call, budget):
    with FakeTensorMode():
        b = _fake_batch()
        counter = RecordOps()
        with counter:
            call(b)  # a host read of device data raises DataDependentOutputException here
    assert counter.total <= budget, f"{name}: {counter.total} ops > {budget}: {dict(counter.ops)}"


def test_fake_mode_catches_a_sync():
    """The check above can fail: a host read under FakeTensorMode raises."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with FakeTensorMode():
        m = torch.ones(8, dtype=torch.bool, device="cuda")
        with pytest.raises(DataDependentOutputException):
            m.sum().item()
        with pytest.raises(DataDependentOutputException):
            crf.global_token_count(m)  # the Python-int variant syncs by design


def test_loss_backward_has_no_host_read_and_refuses_a_second_call():
    """The registered backward scales the saved gradient on the device (no .item() on CUDA tensors), and a
    second backward through the same graph is refused (it would rescale the gradient handed out)."""
    from compactionrl_fast.ops._register import loss_backward

    class Ctx:
        pass

    with FakeTensorMode():
        ctx = Ctx()
        ctx.saved_tensors = (torch.ones(8, device="cuda"),)
        backward = loss_backward("compactionrl_fast::value_loss", 8)
        out = backward(ctx, torch.tensor(2.0, device="cuda"), None, None)
        assert out[0].shape == (8,) and len(out) == 8 and all(o is None for o in out[1:])
        with pytest.raises(RuntimeError, match="second backward"):
            backward(ctx, torch.tensor(2.0, device="cuda"), None, None)


def test_linear_logprobs_backward_has_no_host_read():
    """The registered backward of linear_logprobs (autograd on fake CUDA tensors needs a CUDA build, so the
    formula is called directly): one backward op call, gradients of the right shapes, only for the inputs
    that need them."""
    import importlib

    ll = importlib.import_module("compactionrl_fast.ops.linear_logprobs")

    class Ctx:
        pass

    with FakeTensorMode():
        b = _fake_batch()
        h, w, y = b["h"], b["lm_head"], b["targets"]
        lse, _, ent, rowmax, logsum = torch.ops.compactionrl_fast.linear_logprobs_fwd(h, w, None, y, 1.0, 16, True, True)
        g = torch.ones(b["T"], device=b["dev"])
        ctx = Ctx()
        ctx.saved_tensors, ctx.cfg = (h, w, None, y, lse, ent, rowmax, logsum), (1.0, 16, True)
        ctx.needs_input_grad = (True, True, False) + (False,) * 5
        counter = RecordOps()
        with counter:
            out = ll._fwd_backward(ctx, None, g, g, None, None)
    assert dict(counter.ops) == {"compactionrl_fast.linear_logprobs_bwd.default": 1}
    assert out[0].shape == h.shape and out[1].shape == w.shape and all(o is None for o in out[2:])


SMS = 132  # the fake GPU's SM count: the per-rollout plan from R >= 2 * SMS rollouts


GAE_GLUE_CASES = [  # (id, rollouts, segments per rollout, offsets dtype, keywords of crf.segment_gae)
    ("chunks", 2, 3, torch.int64, {}), ("chunks int32", 2, 3, torch.int32, dict(lam=0.9, cross_segment="stitched")),
    ("chunks lam tensor", 3, 2, torch.int64, dict(lam="tensor", lam_critic=None)),
    ("chunks placed", 2, 2, torch.int64, dict(seg_start=True)),
    ("rollouts", 2 * SMS, 2, torch.int64, {}), ("rollouts int32", 2 * SMS + 5, 1, torch.int32, dict(lam=0.95)),
    ("rollouts lam tensor", 300, 2, torch.int64, dict(lam="tensor", cross_segment="none")),
]


@pytest.mark.skipif(not _dispatch.has_triton(), reason="the CUDA default backend is triton")
@pytest.mark.parametrize("name,R,per,idx,kw", GAE_GLUE_CASES, ids=[c[0] for c in GAE_GLUE_CASES])
def test_segment_gae_cuda_glue_launches_and_ops(monkeypatch, name, R, per, idx, kw):
    """segment_gae on fake CUDA tensors, down to its Triton launches (stubbed: they only record themselves):
    at most 3 launches and at most 8 eager torch ops per call besides the outputs' allocation, counting the
    public wrapper's ops (the custom op's own dispatch excluded) and the launcher's. Both plans: few long
    rollouts (chunks) and R >= 2 * SMs rollouts (one chunk per rollout). A host read raises here."""
    from compactionrl_fast.kernels import gae as kgae

    launches = stub_launches(monkeypatch, kgae, ("_gae_params_kernel", "_gae_chunk_kernel", "_gae_lookback_kernel"))
    monkeypatch.setattr(kgae, "_sm_count", lambda device: SMS)
    monkeypatch.setattr(klaunch, "POISON", False)  # the suite's NaN fill: not an op of a call
    with FakeTensorMode():
        S, T = R * per, 512 * R
        cu = torch.arange(S + 1, dtype=idx, device="cuda") * (T // S)
        cs = torch.arange(R + 1, dtype=idx, device="cuda") * per
        x, mask = torch.zeros(T, device="cuda"), torch.ones(T, dtype=torch.bool, device="cuda")
        kw = dict(kw)
        if kw.get("lam") == "tensor":
            kw["lam"] = torch.full((S,), 0.9, device="cuda")
        if kw.get("seg_start"):
            kw["seg_start"] = torch.arange(S, device="cuda").flip(0) * (T // S)
        outer, inner, calls = RecordOps(), RecordOps(), []
        with outer:  # the public op: its custom op runs its fake impl here
            crf.segment_gae(x, x, mask, cu, cs, **kw)
        with monkeypatch.context() as m:  # the arguments the public op hands its custom op
            m.setattr(torch.ops.compactionrl_fast, "segment_gae_triton", lambda *a: calls.append(a) or (x, x))
            crf.segment_gae(x, x, mask, cu, cs, **kw)
        with inner:  # the launcher the custom op runs (its device guard left out: no CUDA here)
            kgae._segment_gae_fwd(*calls[0])
    chunked = R < 2 * SMS
    assert [n for n, _, _ in launches] == ["_gae_params_kernel"] + ["_gae_chunk_kernel"] * (1 + chunked), launches
    assert [kw.get("WRITE") for _, _, kw in launches[1:]] == [False] * chunked + [True], launches
    assert launches[0][1] == (R,) and (chunked or launches[-1][1] == (R,)), launches  # one program per rollout
    outer.ops.pop("compactionrl_fast.segment_gae_triton.default")
    inner.ops["aten.empty.memory_format"] -= 2  # adv and ret, the outputs
    total = outer.total + inner.total
    assert total <= 8, f"{name}: {total} ops > 8: wrapper {dict(outer.ops)}, launcher {dict(inner.ops)}"


@pytest.mark.skipif(not _dispatch.has_triton(), reason="the CUDA default backend is triton")
def test_segment_gae_cuda_glue_lookback_plan(monkeypatch):
    """The look-back plan on fake CUDA tensors: the per-segment numbers (which also zero the tile counter and
    flags), then one launch with a program per tile of LOOKBACK_TILE tokens, BLOCK tokens per step (the sizes
    tests/test_aot.py compiles); no host read, and no fill launch: the only ops are allocations."""
    from compactionrl_fast.kernels import gae as kgae

    launches = stub_launches(monkeypatch, kgae, ("_gae_params_kernel", "_gae_chunk_kernel", "_gae_lookback_kernel"))
    monkeypatch.setenv("COMPACTIONRL_FAST_GAE_PLAN", "lookback")
    monkeypatch.setattr(klaunch, "POISON", False)
    R, per, T = 6, 2, 6000  # 3 tiles, the last one short
    with FakeTensorMode():
        cu = torch.arange(R * per + 1, device="cuda") * (T // (R * per))
        cs = torch.arange(R + 1, device="cuda") * per
        x, mask = torch.zeros(T, device="cuda"), torch.ones(T, dtype=torch.bool, device="cuda")
        calls = []
        with monkeypatch.context() as m:
            m.setattr(torch.ops.compactionrl_fast, "segment_gae_triton", lambda *a: calls.append(a) or (x, x))
            crf.segment_gae(x, x, mask, cu, cs)
        with RecordOps() as counter:
            kgae._segment_gae_fwd(*calls[0])
    assert [n for n, _, _ in launches] == ["_gae_params_kernel", "_gae_lookback_kernel"], launches
    assert set(counter.ops) == {"aten.empty.memory_format", "aten.unbind.int"}, counter.ops  # unbind: views
    _, grid, kw = launches[0]
    assert kw["ZERO_WS"] and grid == (R,)
    _, grid, kw = launches[1]
    assert grid == (-(-T // kgae.LOOKBACK_TILE),) and kw["TILE"] == kgae.LOOKBACK_TILE and kw["BLOCK"] == kgae.BLOCK
    assert kw["num_warps"] == kgae.NUM_WARPS
