"""torch.compile(fullgraph=True) through the ops, without graph breaks and with the eager numbers:
place_final_rewards then segment_gae; the value ops (value_loss, value_head, value_head_loss,
global_token_count as a tensor) forward and backward; and every registered op on its spec's small case."""
from __future__ import annotations

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops import _dispatch
from compactionrl_fast.reference import gae as ref_gae
from tests.ops import registry_runs as reg


def test_backend_choice_is_marked_constant_as_dynamo_marks_it():
    """_dispatch marks `_resolve` constant for dynamo by hand (importing torch._dynamo for its decorator costs
    about half of the package's import): the flag must be the one the decorator sets."""
    import torch._dynamo

    marked = torch._dynamo.assume_constant_result(lambda: None)
    flags = {k for k in vars(marked) if k.startswith("_dynamo")}
    assert flags == {"_dynamo_marked_constant"} and all(getattr(_dispatch._resolve, k) is True for k in flags)


@pytest.mark.parametrize("backend", [b for b in ("cpp", "triton") if b in _dispatch.available(torch.device("cpu"))])
def test_segment_gae_and_rewards_compile_fullgraph(backend):
    torch._dynamo.reset()
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    cu, cs = torch.tensor([0, 5, 8]), torch.tensor([0, 2])
    values = torch.linspace(0, 1, 8)

    def step(rr, values, mask, cu, cs):
        rew = crf.place_final_rewards(rr, mask, cu, cs, backend=backend)
        return crf.segment_gae(rew, values, mask, cu, cs, backend=backend)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    adv, ret = compiled(torch.tensor([1.0]), values, mask, cu, cs)
    want_adv, want_ret = ref_gae.segment_gae(ref_gae.place_final_rewards(torch.tensor([1.0]), mask, cu, cs), values,
                                             mask, cu, cs)
    torch.testing.assert_close(adv, want_adv.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, want_ret.float(), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
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


def _compile_params():
    out = []
    for spec in reg.public_specs():
        for b in (b for b in spec.cpu if b in ("cpp", "triton", "torch-tuned")
                  and b in _dispatch.available(torch.device("cpu"))):
            out.append(pytest.param(spec.name, b, id=f"{spec.name}-{b}"))
    return out


@pytest.mark.parametrize("op,backend", _compile_params())
def test_registered_op_compiles_fullgraph(op, backend):
    """Every registered op (compactionrl_fast/ops/_registry.py) on its spec's small case: one graph, forward and
    backward, with the eager numbers."""
    torch._dynamo.reset()
    spec = reg.SPECS[op]
    kw = spec.cases(torch.device("cpu"))["small"]
    want = reg.run(spec, kw, backend)
    compiled = torch.compile(lambda **a: spec.fn(**a, backend=backend), fullgraph=True, backend="aot_eager")
    got = reg.run(spec, kw, backend, fn=lambda **a: compiled(**{k: v for k, v in a.items() if k != "backend"}))
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert len(got[0]) == len(want[0]) and len(got[1]) == len(want[1])
