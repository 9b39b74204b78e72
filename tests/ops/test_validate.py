"""The shared input checks (ops/_validate.py) and the backend choice (ops/_dispatch.py), called directly:
each check accepts what it should, refuses the rest naming the argument; `resolve` follows the table,
the override and the built backends; the checks setting also through segment_gae. Fast (no kernels run)."""
import threading

import pytest
import torch

import compactionrl_fast as crf
from compactionrl_fast.ops import _dispatch as D
from compactionrl_fast.ops import _validate as V

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("COMPACTIONRL_FAST_CHECKS", raising=False)
    monkeypatch.delenv("COMPACTIONRL_FAST_BACKEND", raising=False)


# ------------------------------------------------------------------ checks


def test_check_tensor_accepts_and_returns_the_tensor():
    t = torch.zeros(2, 3, dtype=torch.int32)
    assert V.check_tensor("x", t, dtypes=V.INDEX_DTYPES, ndim=2, device=CPU, numel=6) is t
    assert V.check_tensor("x", t) is t


@pytest.mark.parametrize("kw,t,err,match", [
    (dict(), [1, 2], TypeError, "^x must be a torch.Tensor, got list"),
    (dict(dtypes=V.INDEX_DTYPES), torch.zeros(2), TypeError, r"^x must have dtype in \(int32, int64\), got float32"),
    (dict(ndim=1), torch.zeros(2, 2), ValueError, r"^x must be 1-D, got shape \(2, 2\)"),
    (dict(device=torch.device("meta")), torch.zeros(2), ValueError, "^x is on cpu, expected meta"),
    (dict(numel=3), torch.zeros(2), ValueError, r"^x must have 3 elements, got shape \(2,\)"),
])
def test_check_tensor_refuses_naming_the_argument(kw, t, err, match):
    with pytest.raises(err, match=match):
        V.check_tensor("x", t, **kw)


def test_check_offsets_accepts_valid_offsets():
    assert V.check_offsets("cu", torch.tensor([0, 0, 3, 5]), total=5, device=CPU) == 3
    assert V.check_offsets("cu", torch.tensor([0], dtype=torch.int32), total=0, device=CPU) == 0


@pytest.mark.parametrize("cu,total,err,match", [
    (torch.tensor([0.0, 5.0]), 5, TypeError, "^cu must have dtype"),
    (torch.tensor([[0, 5]]), 5, ValueError, "^cu must be 1-D"),
    (torch.zeros(0, dtype=torch.long), 0, ValueError, "^cu must have at least one element"),
    (torch.tensor([1, 5]), 5, ValueError, r"^cu\[0\] must be 0, got 1"),
    (torch.tensor([0, 4, 3, 5]), 5, ValueError, r"^cu must be non-decreasing, but cu\[2\]=3 < cu\[1\]=4"),
    (torch.tensor([0, 3, 3, 2]), 2, ValueError, r"^cu must be non-decreasing, but cu\[3\]=2 < cu\[2\]=3"),
    (torch.tensor([0, 2, 4]), 5, ValueError, r"^cu\[-1\] must equal N=5, got 4"),
    (torch.tensor([0, 5], device="meta"), 5, ValueError, "^cu is on meta"),
])
def test_check_offsets_refuses_naming_the_argument(cu, total, err, match):
    with pytest.raises(err, match=match):
        V.check_offsets("cu", cu, total=total, device=CPU, total_name="N")


def test_check_offsets_default_total_name():
    with pytest.raises(ValueError, match=r"must equal T=5"):
        V.check_offsets("cu", torch.tensor([0, 4]), total=5, device=CPU)


def test_check_float():
    assert V.check_float("g", 1) == 1.0 and isinstance(V.check_float("g", 1), float)
    assert V.check_float("g", 0.5, 0.0, 1.0) == 0.5
    assert V.check_float("g", 0.0, 0.0, 1.0) == 0.0 and V.check_float("g", 1.0, 0.0, 1.0) == 1.0  # bounds included
    for bad, kind in ((True, "bool"), ("0.5", "str"), (None, "NoneType"), (torch.tensor(0.5), "Tensor")):
        with pytest.raises(TypeError, match=f"^g must be a float, got {kind}"):
            V.check_float("g", bad)
    for bad, lo, hi in ((float("nan"), None, None), (-0.1, 0.0, None), (1.1, None, 1.0)):
        with pytest.raises(ValueError, match=r"^g must be in \["):
            V.check_float("g", bad, lo, hi)


def test_check_choice():
    assert V.check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match="^mode must be one of"):
        V.check_choice("mode", "c", ("a", "b"))


def test_checks_mode(monkeypatch):
    assert V.checks_mode() == "auto"
    for raw, want in ((" 1 ", "1"), ("0", "0"), ("AUTO", "auto"), ("", "auto")):
        monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", raw)
        assert V.checks_mode() == want
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "yes")
    with pytest.raises(ValueError, match="^COMPACTIONRL_FAST_CHECKS must be one of"):
        V.checks_mode()


def test_value_checks_by_mode_device_and_trust(monkeypatch):
    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    assert V.value_checks(cpu) and not V.value_checks(meta)
    with V.trusted_layout():
        assert not V.value_checks(cpu)
        with V.trusted_layout():
            assert not V.value_checks(cpu)
        assert not V.value_checks(cpu)  # the inner block restores the outer state
    assert V.value_checks(cpu)
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "1")
    with V.trusted_layout():
        assert V.value_checks(cpu)  # "1" checks even trusted layouts
    assert not V.value_checks(meta)
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "0")
    assert not V.value_checks(cpu)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "1")
    assert not V.value_checks(cpu)  # never while torch.compile traces


def test_value_checks_skip_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        t = mode.from_tensor(torch.zeros(2))
        assert not V.value_checks(t)


def test_value_checks_on_cuda_only_when_asked(monkeypatch):
    """A CUDA tensor stand-in (only `.device` is read): value checks run there only with CHECKS=1."""

    class FakeCuda:
        device = CUDA

    assert not V.value_checks(FakeCuda())
    monkeypatch.setenv("COMPACTIONRL_FAST_CHECKS", "1")
    assert V.value_checks(FakeCuda())


def test_trusted_layout_is_per_thread_and_restored_on_error():
    seen = []
    with V.trusted_layout():
        th = threading.Thread(target=lambda: seen.append(V.value_checks(torch.zeros(1))))
        th.start()
        th.join()
    assert seen == [True]
    with pytest.raises(RuntimeError):
        with V.trusted_layout():
            raise RuntimeError("x")
    assert V.value_checks(torch.zeros(1))


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


# ------------------------------------------------------------------ dispatch


def _built(monkeypatch, *, cpp=True, cuda_ext=False, triton=True, interpret=False):
    ext = None if not cpp else type("Ext", (), {"WITH_CUDA": int(cuda_ext)})
    monkeypatch.setattr(D, "cpp_ext", lambda: ext)
    monkeypatch.setattr(D, "_HAS_TRITON", triton)
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")


@pytest.mark.parametrize("cpp,cuda_ext,triton,interpret,want_cpu,want_cuda", [
    (True, True, True, True, ["cpp", "triton", "torch-tuned", "torch"], ["triton", "cuda", "torch-tuned", "torch"]),
    (True, False, True, False, ["cpp", "torch-tuned", "torch"], ["triton", "torch-tuned", "torch"]),
    (False, False, False, True, ["torch-tuned", "torch"], ["torch-tuned", "torch"]),
    # no extension: no cuda backend either
    (False, True, False, False, ["torch-tuned", "torch"], ["torch-tuned", "torch"]),
])
def test_available(monkeypatch, cpp, cuda_ext, triton, interpret, want_cpu, want_cuda):
    _built(monkeypatch, cpp=cpp, cuda_ext=cuda_ext and cpp, triton=triton, interpret=interpret)
    assert D.available(CPU) == want_cpu
    assert D.available(CUDA) == want_cuda


def test_has_cuda_ext_and_triton_flags(monkeypatch):
    monkeypatch.setattr(D, "cpp_ext", lambda: type("Ext", (), {}))
    assert D.has_cuda_ext() is False
    monkeypatch.setattr(D, "cpp_ext", lambda: type("Ext", (), {"WITH_CUDA": 1}))
    assert D.has_cuda_ext() is True
    monkeypatch.setattr(D, "cpp_ext", lambda: None)
    assert D.has_cuda_ext() is False
    monkeypatch.setattr(D, "_HAS_TRITON", False)
    assert D.has_triton() is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert D.triton_interpret() is True
    monkeypatch.delenv("TRITON_INTERPRET")
    assert D.triton_interpret() is False


def test_cpp_ext_is_the_built_extension():
    import compactionrl_fast._C as C

    assert D.cpp_ext() is C


def test_default_backend(monkeypatch):
    assert D.default_backend() == "auto"
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", " Torch ")
    assert D.default_backend() == "torch"
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "")
    assert D.default_backend() == "auto"
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "gpu")
    with pytest.raises(ValueError, match="^COMPACTIONRL_FAST_BACKEND must be one of"):
        D.default_backend()


def test_resolve_follows_each_ops_order(monkeypatch):
    _built(monkeypatch, cpp=True, cuda_ext=True, triton=True, interpret=True)
    assert D.resolve("auto", CPU, op="segment_gae") == "cpp"
    assert D.resolve("auto", CPU, op="linear_logprobs") == "torch-tuned"  # the tuned torch path first on CPU
    assert D.resolve("auto", CUDA, op="value_loss") == "triton"
    assert D.resolve("auto", CUDA, op="place_final_rewards") == "triton"
    assert D.resolve("auto", CPU) == "cpp"  # no op: the built order
    assert D.resolve("triton", CPU, op="segment_gae") == "triton"
    assert D.resolve("torch", CUDA, op="value_head") == "torch"
    assert D.resolve("torch-tuned", CUDA, op="value_head") == "torch-tuned"
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "cuda")
    assert D.resolve("auto", CUDA, op="ppo_policy_loss") == "cuda"
    assert D.resolve("auto", CUDA, op="value_head") == "triton"  # the op has no cuda backend: its own order
    assert D.resolve("auto", CPU, op="segment_gae") == "cpp"


def test_resolve_says_why_a_backend_is_missing(monkeypatch):
    _built(monkeypatch, cpp=False, cuda_ext=False, triton=True, interpret=False)
    with pytest.raises(ValueError, match="^backend must be one of"):
        D.resolve("fast", CPU, op="segment_gae")
    # each message names the backend, the cause and the fix (not asserted word for word)
    with pytest.raises(ValueError, match="^backend='triton' is not available for cpu tensors: .*CPU tensors with "
                                         "TRITON_INTERPRET=1 set before triton is imported"):
        D.resolve("triton", CPU, op="segment_gae")
    with pytest.raises(ValueError, match=r"^backend='cpp' is not available for cpu tensors: .*needs CPU tensors and "
                                         r"the compiled extension compactionrl_fast\._C.*pip install"):
        D.resolve("cpp", CPU, op="segment_gae")
    with pytest.raises(ValueError, match="^backend='cuda' is not available for cuda tensors: .*needs CUDA tensors .*"
                                         "COMPACTIONRL_FAST_BUILD_CUDA in the README"):
        D.resolve("cuda", CUDA, op="segment_gae")
    with pytest.raises(ValueError, match="no cuda backend"):
        D.resolve("cuda", CUDA, op="linear_logprobs")
    with pytest.raises(ValueError, match="no torch-tuned backend"):
        D.resolve("torch-tuned", CPU, op="segment_gae")
    monkeypatch.setattr(D, "_HAS_TRITON", False)
    with pytest.raises(ValueError, match="triton is not installed"):
        D.resolve("triton", CUDA, op="segment_gae")


def test_table_covers_every_op_with_torch():
    for op, row in D.TABLE.items():
        assert set(row) == {"cuda", "cpu", "ops"}
        for order in (row["cuda"], row["cpu"]):
            assert "torch" in order and set(order) <= set(D.BACKENDS) - {"auto"}
        # "torch" is the reference, run in Python by the op; every other backend is a registered custom op
        assert set(row["ops"]) == set(row["cuda"] + row["cpu"]) - {"torch"}, op
        for b, name in row["ops"].items():
            assert D.custom_op(op, b) is getattr(torch.ops.compactionrl_fast, name)
        assert D.custom_op(op, "torch") is None


def test_torch_is_the_reference_for_every_public_op():
    """backend="torch" gives the float64 reference's numbers (as float32) for the ops that have a tuned path."""
    import compactionrl_fast as crf
    from compactionrl_fast.reference import gae as ref_gae, losses as ref_losses
    from compactionrl_fast.reference.linear_logprobs import linear_logprobs as ref_llp

    g = torch.Generator().manual_seed(0)
    h, w, bias = torch.randn(9, 5, generator=g), torch.randn(5, generator=g), torch.randn((), generator=g)
    assert torch.equal(crf.value_head(h, w, bias, backend="torch"), ref_losses.value_head(h, w, bias).float())
    W, y = torch.randn(7, 5, generator=g), torch.randint(0, 7, (9,), generator=g)
    lp, ent = crf.linear_logprobs(h, W, y, temperature=0.7, return_entropy=True, chunk_size=2, backend="torch")
    rlp, rent = ref_llp(h, W, y, temperature=0.7, return_entropy=True)
    assert torch.equal(lp, rlp.float()) and torch.equal(ent, rent.float())
    mask = torch.rand(9, generator=g) < 0.6
    cu, cu_seg, rr = torch.tensor([0, 0, 4, 5, 9]), torch.tensor([0, 3, 4]), torch.randn(2, generator=g)
    for mode in ("paper", "stitched"):
        out = crf.place_final_rewards(rr, mask, cu, cu_seg, mode=mode, backend="torch")
        assert torch.equal(out, ref_gae.place_final_rewards(rr, mask, cu, cu_seg, mode=mode).float())


def test_dispatch_table_and_override(monkeypatch):
    cpu = torch.device("cpu")
    assert D.resolve("auto", cpu, op="segment_gae") == D.available(cpu)[0]
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "torch")
    assert D.resolve("auto", cpu, op="segment_gae") == "torch"
    assert D.resolve("auto", cpu, op="linear_logprobs") == "torch"
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "torch-tuned")  # ops without it keep their own order
    assert D.resolve("auto", cpu, op="linear_logprobs") == "torch-tuned"
    assert D.resolve("auto", cpu, op="segment_gae") == D.available(cpu)[0]
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "cuda")  # not for CPU tensors: falls back to the table
    assert D.resolve("auto", cpu, op="segment_gae") == D.available(cpu)[0]
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "fastest")
    with pytest.raises(ValueError, match="COMPACTIONRL_FAST_BACKEND"):
        D.resolve("auto", cpu, op="segment_gae")
    with pytest.raises(ValueError, match="no cuda backend"):
        D.resolve("cuda", torch.device("cuda"), op="linear_logprobs")


def test_op_rules():
    """The per-op exceptions to the table (`_op_rule`), and `resolve_backend` applying them."""
    rule, f32, bf16 = D._op_rule, torch.float32, torch.bfloat16
    # value_head "auto" on CPU: C++ for half precision, BLAS (torch-tuned) for float32 and without the C++ op
    assert rule("value_head", "auto", "cpp", "cpu", bf16, False) == "cpp"
    assert rule("value_head", "auto", "cpp", "cpu", f32, False) == "torch-tuned"
    assert rule("value_head", "auto", "triton", "cpu", bf16, False) == "torch-tuned"
    assert rule("value_head", "cpp", "cpp", "cpu", f32, False) == "cpp"  # asked for: kept
    assert rule("value_head", "auto", "triton", "cuda", f32, False) == "triton"
    # linear_logprobs: the interpreter runs float32 only
    with pytest.raises(ValueError, match=r"^backend='triton' on CPU tensors \(the Triton interpreter\) supports "
                                         r"float32 only: the interpreter's bf16/fp16 arithmetic is unreliable; use "
                                         r"backend='torch-tuned'$"):
        rule("linear_logprobs", "auto", "triton", "cpu", bf16, False)
    assert rule("linear_logprobs", "triton", "triton", "cpu", f32, False) == "triton"
    assert rule("linear_logprobs", "triton", "triton", "cuda", bf16, False) == "triton"
    assert rule("linear_logprobs", "torch", "torch", "cpu", bf16, False) == "torch"
    assert rule("linear_logprobs", "torch-tuned", "torch-tuned", "cpu", bf16, False) == "torch-tuned"
    # segment_weights (the loss ops' reduction weights): the cuda loss kernels take Triton's, else torch's
    assert rule("segment_weights", "cuda", "cuda", "cuda", f32, False) == ("cuda" if D.has_triton() else "torch")
    # segment_gae: placed segments are not on the cuda backend
    assert rule("segment_gae", "auto", "cuda", "cuda", f32, True) == "triton"
    with pytest.raises(ValueError, match=r"^seg_start \(placed segments\) is not supported by the cuda backend: use "
                                         r"backend='triton'$"):
        rule("segment_gae", "cuda", "cuda", "cuda", f32, True)
    assert rule("segment_gae", "cuda", "cuda", "cuda", f32, False) == "cuda"
    assert rule("segment_gae", "auto", "triton", "cuda", f32, True) == "triton"
    assert rule("ppo_policy_loss", "auto", "cpp", "cpu", f32, True) == "cpp"
    assert rule(None, "auto", "cpp", "cpu", bf16, False) == "cpp"
    assert D.resolve_backend("auto", CPU, op="value_head", dtype=f32) == "torch-tuned"
    assert D.resolve_backend("auto", CPU, op="value_head", dtype=bf16) == D.resolve("auto", CPU, op="value_head")
    assert D.resolve_backend("torch", CPU) == "torch"


def test_resolve_backend_passes_the_op_and_its_facts(monkeypatch):
    _built(monkeypatch, cpp=True, cuda_ext=True, triton=True, interpret=False)
    assert D.resolve_backend("auto", CPU, op="linear_logprobs") == "torch-tuned"  # the op's order, not the built one
    monkeypatch.setenv("COMPACTIONRL_FAST_BACKEND", "cuda")
    assert D.resolve_backend("auto", CUDA, op="segment_gae") == "cuda"  # placed=False default
    assert D.resolve_backend("auto", CUDA, op="segment_gae", placed=True) == "triton"


def test_check_denominator_names_its_range():
    with pytest.raises(ValueError, match=r"^denominator must be in \[0.0, inf\], got -1.0$"):
        V.check_denominator(-1.0, "token-mean")
    assert V.check_denominator(float("inf"), "segment-mean") == float("inf")  # a float passes unread: inf is allowed
