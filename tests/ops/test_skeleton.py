"""The op skeleton: no host sync on CUDA tensors, few eager ops per call, torch.compile without graph
breaks, one dispatch table with a global override, bad offsets never crash a kernel, lazy imports.

Sync-freedom is checked without a GPU: under FakeTensorMode, tensors made with device="cuda" exist on a
CPU-only torch, and any read of device data on the host raises DataDependentOutputException.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compactionrl_fast as crf
from compactionrl_fast.ops import _dispatch
from compactionrl_fast.reference import gae as ref_gae
from tests.utils import CountOps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_batch(T=64):
    dev = "cuda"
    return dict(mask=torch.ones(T, dtype=torch.bool, device=dev), cu=torch.tensor([0, 20, 40, 64], device=dev),
                cs=torch.tensor([0, 2, 3], device=dev), x=torch.zeros(T, device=dev), y=torch.zeros(T, device=dev),
                rr=torch.ones(2, device=dev), h=torch.zeros(T, 8, device=dev, dtype=torch.bfloat16),
                w=torch.zeros(8, device=dev), lm_head=torch.zeros(50, 8, device=dev, dtype=torch.bfloat16),
                targets=torch.zeros(T, dtype=torch.int64, device=dev), dev=dev, T=T)


# (name, call, eager-op budget): what each op may dispatch around its kernels (outputs included); a change
# that adds ops or a host sync fails here.
CALLS = [
    ("segment_gae", lambda b: crf.segment_gae(b["x"], b["y"], b["mask"], b["cu"], b["cs"]), 8),
    ("segment_gae lam tensor", lambda b: crf.segment_gae(b["x"], b["y"], b["mask"], b["cu"], b["cs"],
                                                         lam=torch.full((3,), 0.9, device=b["dev"])), 8),
    ("place_final_rewards", lambda b: crf.place_final_rewards(b["rr"], b["mask"], b["cu"], b["cs"]), 8),
    ("ppo_policy_loss token-mean", lambda b: crf.ppo_policy_loss(b["x"], b["y"], b["y"], b["mask"],
                                                                 cu_seqlens=b["cu"], cu_segments=b["cs"]), 8),
    ("ppo_policy_loss denominator", lambda b: crf.ppo_policy_loss(b["x"], b["y"], b["y"], b["mask"], denominator=512.0), 8),
    ("ppo_policy_loss tensor denominator", lambda b: crf.ppo_policy_loss(
        b["x"], b["y"], b["y"], b["mask"], denominator=torch.full((), 40.0, device=b["dev"])), 8),
    ("ppo_policy_loss rollout-mean", lambda b: crf.ppo_policy_loss(b["x"], b["y"], b["y"], b["mask"], cu_seqlens=b["cu"],
                                                                   cu_segments=b["cs"], reduction="rollout-mean"), 8),
    ("value_loss", lambda b: crf.value_loss(b["x"], b["y"], b["y"], b["mask"], cu_seqlens=b["cu"], clip=0.2), 8),
    ("global_token_count", lambda b: crf.global_token_count(b["mask"], as_tensor=True), 8),
    ("value_head_loss", lambda b: crf.value_head_loss(b["h"], b["w"], None, b["x"], b["y"], b["mask"], clip=0.2), 8),
    ("linear_logprobs", lambda b: crf.linear_logprobs(b["h"], b["lm_head"], b["targets"], return_entropy=True,
                                                      temperature=0.7), 8),
]


@pytest.mark.skipif(not _dispatch.has_triton(), reason="the CUDA default backend is triton")
@pytest.mark.parametrize("name,call,budget", CALLS, ids=[c[0] for c in CALLS])
def test_no_host_sync_on_cuda_and_op_budget(name, call, budget):
    with FakeTensorMode():
        b = _fake_batch()
        counter = CountOps()
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
        counter = CountOps()
        with counter:
            out = ll._fwd_backward(ctx, None, g, g, None, None)
    assert dict(counter.ops) == {"compactionrl_fast.linear_logprobs_bwd.default": 1}
    assert out[0].shape == h.shape and out[1].shape == w.shape and all(o is None for o in out[2:])


@pytest.mark.parametrize("backend", [b for b in ("cpp", "triton") if b in _dispatch.available(torch.device("cpu"))])
def test_segment_gae_and_rewards_compile_fullgraph(backend):
    torch._dynamo.reset()
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    cu, cs = torch.tensor([0, 5, 8]), torch.tensor([0, 2])
    values = torch.linspace(0, 1, 8)

    def step(rr, values, mask, cu, cs):
        rew = crf.place_final_rewards(rr, mask, cu, cs)
        return crf.segment_gae(rew, values, mask, cu, cs, backend=backend)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    adv, ret = compiled(torch.tensor([1.0]), values, mask, cu, cs)
    want_adv, want_ret = ref_gae.segment_gae(ref_gae.place_final_rewards(torch.tensor([1.0]), mask, cu, cs), values,
                                             mask, cu, cs)
    torch.testing.assert_close(adv, want_adv.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, want_ret.float(), atol=1e-6, rtol=1e-6)


def test_place_final_rewards_matches_reference_on_random_layouts():
    from tests.utils import packed_batch, random_case

    for seed in range(6):
        b = packed_batch(random_case(seed), seed=seed, index_dtype=(torch.int32, torch.int64)[seed % 2])
        R = b["cu_segments"].numel() - 1
        rr = torch.randn(R)
        for mode in ("paper", "stitched"):
            got = crf.place_final_rewards(rr, b["loss_mask"], b["cu_seqlens"], b["cu_segments"], mode=mode)
            want = ref_gae.place_final_rewards(rr, b["loss_mask"], b["cu_seqlens"], b["cu_segments"], mode=mode)
            torch.testing.assert_close(got, want.float(), atol=0, rtol=0)


def test_place_final_rewards_bad_inputs():
    mask, cu, cs = torch.ones(4, dtype=torch.bool), torch.tensor([0, 2, 4]), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="rollout_rewards"):
        crf.place_final_rewards(torch.ones(2), mask, cu, cs)
    with pytest.raises(TypeError, match="rollout_rewards"):
        crf.place_final_rewards(torch.ones(1, dtype=torch.long), mask, cu, cs)
    with pytest.raises(ValueError, match="cu_seqlens"):
        crf.place_final_rewards(torch.ones(1), mask, torch.tensor([0, 3, 2]), cs)
    with pytest.raises(ValueError, match="cu_segments"):
        crf.place_final_rewards(torch.ones(1), mask, cu, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="mode"):
        crf.place_final_rewards(torch.ones(1), mask, cu, cs, mode="last")
    with pytest.raises(TypeError, match="loss_mask"):
        crf.place_final_rewards(torch.ones(1), mask.float(), cu, cs)


def test_segment_gae_names_the_bad_argument():
    mask, cu = torch.ones(4, dtype=torch.bool), torch.tensor([0, 4])
    with pytest.raises(TypeError, match="rewards must be a torch.Tensor"):
        crf.segment_gae(None, torch.zeros(4), mask, cu)
    with pytest.raises(ValueError, match="loss_mask has 3"):
        crf.segment_gae(torch.zeros(4), torch.zeros(4), mask[:3], torch.tensor([0, 3]))


def test_dispatch_table_and_override(monkeypatch):
    cpu = torch.device("cpu")
    assert _dispatch.resolve("auto", cpu, op="segment_gae") == _dispatch.available(cpu)[0]
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "torch")
    assert _dispatch.resolve("auto", cpu, op="segment_gae") == "torch"
    assert _dispatch.resolve("auto", cpu, op="linear_logprobs") == "torch"
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "cuda")  # not for CPU tensors: falls back to the table
    assert _dispatch.resolve("auto", cpu, op="segment_gae") == _dispatch.available(cpu)[0]
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "fastest")
    with pytest.raises(ValueError, match="COMPACTIONRL_FAST_BACKEND"):
        _dispatch.resolve("auto", cpu, op="segment_gae")
    with pytest.raises(ValueError, match="no cuda backend"):
        _dispatch.resolve("cuda", torch.device("cuda"), op="linear_logprobs")


def test_checks_setting(monkeypatch):
    from compactionrl_fast.ops._validate import value_checks

    t = torch.zeros(1)
    assert value_checks(t)
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "0")
    assert not value_checks(t)
    with pytest.raises(TypeError, match="cu_seqlens"):  # dtype checks stay on
        crf.segment_gae(torch.zeros(4), torch.zeros(4), torch.ones(4, dtype=torch.bool), torch.tensor([0.0, 4.0]))
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "maybe")
    with pytest.raises(ValueError, match="COMPACTIONRL_FAST_CHECKS"):
        value_checks(t)


BAD_OFFSETS = {"decreasing": [0, 7, 4, 10], "past_T": [0, 4, 7, 1 << 30], "huge": [0, 4, 1 << 40, 10],
               "negative": [0, -3, 7, 10], "last_short": [0, 4, 7, 9]}


@pytest.mark.parametrize("backend", [b for b in ("cpp", "triton", "torch") if b in _dispatch.available(torch.device("cpu"))])
def test_bad_offsets_with_checks_off_never_crash(backend):
    """COMPACTIONRL_FAST_CHECKS=0: every bad layout gives a clear error or some numbers, in a subprocess
    (a segfault must fail this test, not kill pytest)."""
    script = textwrap.dedent(f"""
        import torch, compactionrl_fast as crf
        T = 10
        mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
        x = torch.linspace(-1, 1, T)
        for name, cu in {BAD_OFFSETS!r}.items():
            for idx in (torch.int32, torch.int64):
                if idx == torch.int32 and max(abs(c) for c in cu) >= 2**31:
                    continue
                cu_t = torch.tensor(cu, dtype=idx)
                cs = torch.tensor([0, 2, 3], dtype=idx)
                for op in ("gae", "rewards", "ppo", "value"):
                    try:
                        if op == "gae":
                            crf.segment_gae(x, x, mask, cu_t, cs, backend={backend!r})
                        elif op == "rewards":
                            crf.place_final_rewards(torch.ones(2), mask, cu_t, cs)
                        elif op == "ppo":
                            crf.ppo_policy_loss(x, x, x, mask, cu_seqlens=cu_t, cu_segments=cs, reduction="segment-mean",
                                                backend={backend!r})
                        else:
                            crf.value_loss(x, x, x, mask, cu_seqlens=cu_t, cu_segments=cs, reduction="rollout-mean",
                                           backend={backend!r})
                    except (ValueError, TypeError, IndexError, RuntimeError) as e:
                        pass
        print("survived")
    """)
    env = dict(os.environ, COMPACTIONRL_FAST_CHECKS="0", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "survived" in p.stdout, f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"


def test_raw_cpp_gae_op_rejects_bad_offsets():
    if not hasattr(torch.ops.compactionrl_fast, "segment_gae") or _dispatch.cpp_ext() is None:
        pytest.skip("needs the compiled extension")
    x, mask = torch.zeros(10), torch.ones(10, dtype=torch.bool)
    for cu in ([0, 4, 1 << 40, 10], [0, 7, 4, 10], [0, 4, 7, 1 << 30]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            torch.ops.compactionrl_fast.segment_gae(x, x, mask, torch.tensor(cu), torch.tensor([0, 3]), None, 1.0, 1.0,
                                                    0, 1.5, 1, 1.0)


def test_import_is_lazy():
    """`import compactionrl_fast` loads the ops only: no transformers, no runtime, no trainer."""
    script = ("import sys, compactionrl_fast as c; bad = [m for m in ('transformers', 'compactionrl_fast.rollout', "
              "'compactionrl_fast.train', 'compactionrl_fast.integrations', 'compactionrl_fast.envs') if m in sys.modules];"
              " assert not bad, bad; c.PackedBatch; c.MemoryEnv; assert 'compactionrl_fast.envs' in sys.modules; print('ok')")
    p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]


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
    from compactionrl_fast.kernels import _launch as klaunch
    from compactionrl_fast.kernels import gae as kgae

    launches = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs.get("WRITE")))

    for k in ("_gae_params_kernel", "_gae_chunk_kernel", "_gae_lookback_kernel"):
        monkeypatch.setattr(kgae, k, Stub(k))
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
        outer, inner, calls = CountOps(), CountOps(), []
        with outer:  # the public op: its custom op runs its fake impl here
            crf.segment_gae(x, x, mask, cu, cs, **kw)
        with monkeypatch.context() as m:  # the arguments the public op hands its custom op
            m.setattr(torch.ops.compactionrl_fast, "segment_gae_triton", lambda *a: calls.append(a) or (x, x))
            crf.segment_gae(x, x, mask, cu, cs, **kw)
        with inner:  # the launcher the custom op runs (its device guard left out: no CUDA here)
            kgae._segment_gae_fwd(*calls[0])
    chunked = R < 2 * SMS
    assert [n for n, _, _ in launches] == ["_gae_params_kernel"] + ["_gae_chunk_kernel"] * (1 + chunked), launches
    assert [w for _, _, w in launches[1:]] == [False] * chunked + [True], launches
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
    from compactionrl_fast.kernels import _launch as klaunch
    from compactionrl_fast.kernels import gae as kgae

    launches = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs))

    for k in ("_gae_params_kernel", "_gae_chunk_kernel", "_gae_lookback_kernel"):
        monkeypatch.setattr(kgae, k, Stub(k))
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
        with CountOps() as counter:
            kgae._segment_gae_fwd(*calls[0])
    assert [n for n, _, _ in launches] == ["_gae_params_kernel", "_gae_lookback_kernel"], launches
    assert set(counter.ops) == {"aten.empty.memory_format", "aten.unbind.int"}, counter.ops  # unbind: views
    _, grid, kw = launches[0]
    assert kw["ZERO_WS"] and grid == (R,)
    _, grid, kw = launches[1]
    assert grid == (-(-T // kgae.LOOKBACK_TILE),) and kw["TILE"] == kgae.LOOKBACK_TILE and kw["BLOCK"] == kgae.BLOCK
    assert kw["num_warps"] == kgae.NUM_WARPS


@pytest.mark.skipif("triton" not in _dispatch.available(torch.device("cpu")), reason="needs the Triton interpreter")
@pytest.mark.parametrize("cross", ["paper", "none", "stitched"])
@pytest.mark.parametrize("lam,length", [(0.95, "rollout"), ("adaptive", "rollout"), ("adaptive", "segment"),
                                        ("tensor", "rollout")])
@pytest.mark.parametrize("lam_critic", [1.0, None, 0.9])
def test_gae_params_kernel_matches_reference(cross, lam, length, lam_critic):
    """The one place that turns modes into per-segment numbers (Triton port) against the reference's own
    statement of them, on layouts with empty, untrainable and single-token segments."""
    from compactionrl_fast.kernels import gae as kgae
    from compactionrl_fast.ops.gae import CROSS_MODES, LAM_ADAPTIVE_ROLLOUT, LAM_ADAPTIVE_SEGMENT, LAM_CONST, LAM_TENSOR
    from tests.utils import SHAPE_TABLE, packed_batch

    case = SHAPE_TABLE["empty_segments"] + SHAPE_TABLE["no_trainable"] + SHAPE_TABLE["four_segments"] + \
        SHAPE_TABLE["single_token"]
    b = packed_batch(case, index_dtype=torch.int64)
    S = b["cu_seqlens"].numel() - 1
    lam_arg, lam_seg, lam_val = lam, None, 0.0
    if lam == "tensor":
        lam_arg = lam_seg = torch.rand(S, generator=torch.Generator().manual_seed(1))
        mode = LAM_TENSOR
    elif lam == "adaptive":
        mode = LAM_ADAPTIVE_ROLLOUT if length == "rollout" else LAM_ADAPTIVE_SEGMENT
    else:
        mode, lam_val = LAM_CONST, lam
    got = kgae.gae_params(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], lam_seg, 0.99, lam_val, mode, 1.5,
                          CROSS_MODES[cross], -1.0 if lam_critic is None else lam_critic)
    want = ref_gae.segment_params(b["loss_mask"], b["cu_seqlens"], b["cu_segments"], gamma=0.99, lam=lam_arg,
                                  cross_segment=cross, lam_critic=lam_critic, adaptive_alpha=1.5,
                                  adaptive_length=length)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_every_registered_op_has_a_fake_impl():
    """Every op of torch.ops.compactionrl_fast traces (fake/Meta) besides its device kernels."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "op_kernels.py")], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert " 0 problems" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


@pytest.mark.parametrize("reduction", ["token-mean", "segment-mean", "rollout-mean", "sum"])
@pytest.mark.parametrize("den", [None, 0.0, 37.0, "tensor", "negative"])
@pytest.mark.parametrize("layout", ["packed", "one segment", "no rollouts"])
def test_segment_weights_backends_agree(reduction, den, layout):
    """The per-segment reduction weights: C++ (CPU) and the Triton kernel (interpreter) against the torch
    formulation, on layouts with empty and untrainable segments."""
    from compactionrl_fast.ops import _reduction as red
    from tests.utils import SHAPE_TABLE, packed_batch

    if den is not None and reduction == "sum":
        pytest.skip("no denominator with 'sum'")
    b = packed_batch(SHAPE_TABLE["empty_segments"] + SHAPE_TABLE["no_trainable"] + SHAPE_TABLE["four_segments"],
                     index_dtype=torch.int64)
    cu = None if layout == "one segment" else b["cu_seqlens"]
    cs = b["cu_segments"] if layout == "packed" else None
    d = {"tensor": torch.tensor(41.0), "negative": torch.tensor(-2.0)}.get(den, den)
    want = red.segment_weights_torch(b["loss_mask"], cu, cs, reduction, d)
    got = [red.segment_weights(b["loss_mask"], cu, cs, reduction, d)]
    if "triton" in _dispatch.available(torch.device("cpu")):
        from compactionrl_fast.kernels.segments import segment_weights as launch

        counts = red.segment_counts(b["loss_mask"], cu) if cu is not None else torch.count_nonzero(b["loss_mask"]).reshape(1)
        got.append(launch(counts, cs, red._CODES[reduction], d))
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-15, atol=0, equal_nan=True)
    if den == "negative":
        assert want.isnan().all()


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


@pytest.mark.parametrize("backend", [b for b in ("cpp", "triton") if b in _dispatch.available(torch.device("cpu"))])
def test_value_ops_compile_fullgraph_forward_and_backward(backend):
    """value_loss, value_head and value_head_loss (and global_token_count as a tensor) trace into one graph,
    forward and backward, and give the eager numbers."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    T, H = 40, 8
    hidden = torch.randn(T, H, generator=g)
    w, b = torch.randn(H, generator=g), torch.randn(1, generator=g)
    old, ret = torch.randn(T, generator=g), torch.randn(T, generator=g)
    mask = torch.rand(T, generator=g) > 0.3
    cu = torch.tensor([0, 7, 7, 25, T])

    def step(hidden, w, b, old, ret, mask, cu):
        den = crf.global_token_count(mask, as_tensor=True)
        v = crf.value_head(hidden, w, b, backend=backend)
        l1, m1 = crf.value_loss(v, old, ret, mask, cu_seqlens=cu, clip=0.2, reduction="segment-mean",
                                backend=backend)
        l2, m2 = crf.value_head_loss(hidden, w, b, old, ret, mask, clip=0.2, denominator=den, backend=backend)
        return l1 + l2, m1["explained_variance"], m2["clip_fraction"]

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (hidden, w, b)]
        out = fn(*leaves, old, ret, mask, cu)
        out[0].backward()
        return [o.detach() for o in out] + [x.grad for x in leaves]

    want = run(step)
    got = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)
