"""generate (slime's --custom-generate-function-path) against real HTTP servers speaking SGLang's /generate:
slime's own FakeSGLangServer (tests/test_agent/_fakes.py of the snapshot) for the protocol, and a server
backed by a real tiny model (our TransformersEngine) for a run with compactions whose log-probs must match
the model's forward; then the Samples go through slime's data path into compute_advantages."""
import argparse
import asyncio
import dataclasses
import importlib.util
import os

import pytest
import torch

from .conftest import skip_without_slime

skip_without_slime()

from . import _harness as H  # noqa: E402

from compactionrl_fast.envs.memory import MemoryEnv, memory_config, memory_tokenizer  # noqa: E402
from compactionrl_fast.integrations.slime import SGLangEngine, generate  # noqa: E402

TOK_PATH = "compactionrl_fast.envs.memory.memory_tokenizer"
HERE = "tests.integrations.slime.test_generate"


def _fakes():
    import slime

    path = os.path.join(os.path.dirname(os.path.dirname(slime.__file__)), "tests", "test_agent", "_fakes.py")
    if not os.path.exists(path):
        pytest.skip(f"slime's tests/test_agent/_fakes.py is not beside this slime ({path})")
    spec = importlib.util.spec_from_file_location("slime_test_agent_fakes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class TwoStepEnv:
    """Two turns: the first observation is filler words, the second ends the episode with reward 1."""

    def __init__(self):
        self.n = 0

    def reset(self, seed):
        return "memory", "collect 1 digits answer all in order"

    def step(self, action):
        self.n += 1
        return ("la lo li " * 6).strip(), self.n >= 2, 1.0 if self.n >= 2 else 0.0


def make_two_step_env(args, sample):
    return TwoStepEnv()


def make_memory_env(args, sample):
    return MemoryEnv(n_digits=3, n_fillers=15)


def _args(port, env, **rollout):
    return argparse.Namespace(sglang_router_ip="127.0.0.1", sglang_router_port=port, compaction_env=f"{HERE}.{env}",
                              compaction_tokenizer=TOK_PATH, compaction_rollout=rollout, partial_rollout=False,
                              hf_checkpoint=None, rollout_max_context_len=None)


def _port(url):
    return int(url.rsplit(":", 1)[1])


def test_protocol_against_slimes_fake_server():
    from slime.utils.types import Sample

    fakes = _fakes()
    tok = memory_tokenizer()
    nxt, eos = tok.convert_tokens_to_ids("next"), tok.eos_token_id
    summary = [tok.convert_tokens_to_ids(w) for w in ("digit", "1", "5")]
    turns = [[(-0.5, nxt), (-0.25, eos)], [(-0.1, t) for t in summary] + [(-0.2, eos)], [(-0.75, nxt), (-0.5, eos)]]
    cfg = dataclasses.asdict(memory_config(budget=64, compact_threshold=40))

    async def run():
        async with fakes.FakeSGLangServer([list(t) for t in turns]) as srv:
            args = _args(_port(srv.url), "make_two_step_env", **cfg)
            out = await generate(args, Sample(index=7, prompt="p"), {"max_new_tokens": 16, "temperature": 1.0,
                                                                     "top_p": 1.0, "top_k": -1})
            return out, srv.requests

    samples, requests = asyncio.run(run())
    assert len(requests) == 3  # act, summarize, act
    for req in requests:
        assert req["return_logprob"] is True and isinstance(req["input_ids"], list)
        assert eos in req["sampling_params"]["stop_token_ids"] and req["sampling_params"]["top_k"] == -1
    assert [s.metadata["round_number"] for s in samples] == [0, 1, 2]
    assert [s.metadata["compaction"]["kind"] for s in samples] == ["exec", "summary", "exec"]
    assert {s.rollout_id for s in samples} == {7} and {s.reward for s in samples} == {1.0}
    assert all(s.status == Sample.Status.COMPLETED for s in samples)
    for s, req, t in zip(samples, requests, turns):
        assert s.tokens[:len(req["input_ids"])] == req["input_ids"]  # the prompt the server saw, untouched
        assert len(s.loss_mask) == s.response_length and len(s.rollout_log_probs) == s.response_length
        resp = s.tokens[-s.response_length:]
        lps = [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m]
        assert [x for x, m in zip(resp, s.loss_mask) if m] == [tid for _, tid in t]
        assert lps == [lp for lp, _ in t]
    # the first window's response: the sampled tokens, then the end of turn and the observation (mask 0)
    assert samples[0].loss_mask[:2] == [1, 1] and not any(samples[0].loss_mask[2:])


def test_abort_and_errors():
    from slime.utils.types import Sample

    fakes = _fakes()

    async def run(turns, finish_reason, **kw):
        async with fakes.FakeSGLangServer(turns, finish_reason=finish_reason) as srv:
            args = _args(_port(srv.url), "make_two_step_env", **kw)
            return await generate(args, Sample(index=1), {"max_new_tokens": 8})

    s = asyncio.run(run([[(-0.1, 5)]], "abort"))
    assert isinstance(s, Sample) and s.status == Sample.Status.ABORTED
    with pytest.raises(ValueError, match="--partial-rollout"):
        asyncio.run(generate(argparse.Namespace(partial_rollout=True), Sample(index=1), {}))
    with pytest.raises(ValueError, match="compaction_env is not set"):
        asyncio.run(generate(argparse.Namespace(), Sample(index=1), {}))
    with pytest.raises(ValueError, match="compaction_rollout"):
        asyncio.run(run([], "stop", budget=-3))
    no_tok = _args(1, "make_two_step_env")
    no_tok.compaction_tokenizer = None
    with pytest.raises(ValueError, match="no tokenizer"):
        asyncio.run(generate(no_tok, Sample(index=1), {}))
    with pytest.raises(ValueError, match="compaction_env=.*cannot be loaded"):
        asyncio.run(generate(_args(1, "no_such_factory"), Sample(index=1), {}))


class ResetFails:
    def reset(self, seed):
        raise RuntimeError("the task's container did not start")

    def step(self, action):
        raise AssertionError("never stepped")


def make_env_failing_on_odd(args, sample):
    return ResetFails() if sample.index % 2 else TwoStepEnv()


def test_reset_failure_keeps_slimes_batch_shape():
    """An environment failing at reset gives a FAILED sample, in a list like every other episode's: slime's
    RolloutManager flattens a step's groups by the shape of the first one, and a bare Sample among lists broke it
    ('Sample' object is not iterable, found by slime's train.py job). Here through slime's real _get_rollout_data
    and _convert_samples_to_train_data, each order."""
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.utils.types import Sample

    fakes = _fakes()
    tok = memory_tokenizer()
    eos = tok.eos_token_id
    turns = [[(-0.5, tok.convert_tokens_to_ids("next")), (-0.25, eos)]] * 2

    async def run():
        async with fakes.FakeSGLangServer([list(t) for t in turns]) as srv:
            args = _args(_port(srv.url), "make_env_failing_on_odd")
            return [await generate(args, Sample(index=i, prompt="p"), {"max_new_tokens": 8}) for i in (0, 1)]

    good, failed = asyncio.run(run())
    assert isinstance(failed, list) and len(failed) == 1
    assert failed[0].status == Sample.Status.FAILED and failed[0].rollout_id == 1
    assert failed[0].metadata["compaction"]["finish_reason"] == "error" and failed[0].response_length == 0
    rm = _bare_rollout_manager(H.slime_args(load_debug_rollout_data=None))
    for groups in ([[good], [failed]], [[failed], [good]]):  # slime's groups: n_samples_per_prompt = 1
        rm.generate_rollout = lambda *a, evaluation=False, g=groups: RolloutFnTrainOutput(samples=g)
        data, _ = rm._get_rollout_data(rollout_id=0)
        assert sorted(s.index for s in data) == [0] * len(good) + [1]
        train = rm._convert_samples_to_train_data(data)
        assert sorted(train["rollout_ids"]) == [0] * len(good) + [1]


class _GenerateServer:
    """A local HTTP server answering POST /generate with `self._handle` (async with: started, then closed)."""

    async def __aenter__(self):
        from aiohttp import web
        from aiohttp.test_utils import TestServer

        app = web.Application()
        app.router.add_post("/generate", self._handle)
        self._server = TestServer(app)
        await self._server.start_server()
        self.url = str(self._server.make_url("")).rstrip("/")
        return self

    async def __aexit__(self, *exc):
        await self._server.close()


class SGLangStops(_GenerateServer):
    """/generate over HTTP with SGLang's stop rule, on scripted token streams: each request takes the next stream
    and answers its tokens up to max_new_tokens, ending at the first one in sampling_params["stop_token_ids"]
    (included: slime sends no_stop_trim) with finish_reason "stop", else "length". A server that ignored the
    request's stop tokens would answer the whole stream."""

    def __init__(self, streams):
        self.streams, self.requests = [list(t) for t in streams], []

    async def _handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        sp, stream = body["sampling_params"], self.streams.pop(0)
        stops, out, kind = set(sp.get("stop_token_ids") or ()), [], "length"
        for t in stream[:sp["max_new_tokens"]]:
            out.append(t)
            if t in stops:
                kind = "stop"
                break
        return web.json_response({"text": "", "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in out], "finish_reason": {"type": kind}}})


class FirstActionEnv:
    """Two turns; reward 1 when the first action (the response without its stop token) was exactly "next"."""

    def __init__(self):
        self.actions = []

    def reset(self, seed):
        return "memory", "collect 1 digits answer all in order"

    def step(self, action):
        self.actions.append(action)
        if len(self.actions) == 1:
            return "digit 1 5", False, 0.0
        return "", True, float(self.actions[0] == "next")


ENVS = {}


def make_first_action_env(args, sample):
    ENVS[sample.index] = FirstActionEnv()
    return ENVS[sample.index]


def test_slimes_stop_token_ids_stop_the_loops_responses(tmp_path):
    """--rollout-stop-token-ids (issue 55), through slime's real parse_args and the sampling parameters its
    rollout hands our generate (GenerateState): the engine is asked to stop there, and a response that reaches
    the token ends with it, its action without it, as at the end of turn. The policy's first turn here is
    "next la lo <eos>": with "la" a stop token the environment sees "next" (reward 1), without it "next la lo"
    (reward 0)."""
    from slime.utils.types import Sample

    from ._slime_args import parse

    tok = memory_tokenizer()
    ids = {w: tok.convert_tokens_to_ids(w) for w in ("next", "la", "lo", "answer", "5")}
    eos = tok.eos_token_id
    tok.save_pretrained(tmp_path)
    with open(tmp_path / "compaction.yaml", "w") as f:
        f.write(f"compaction_env: {HERE}.make_first_action_env\n")
    args, sampling_params = parse([
        "--debug-rollout-only", "--rollout-num-gpus", "1", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--num-rollout", "1", "--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "prompts.jsonl"),
        "--rollout-batch-size", "1", "--global-batch-size", "1", "--rollout-max-response-len", "16",
        "--custom-generate-function-path", "compactionrl_fast.integrations.slime.generate",
        "--custom-config-path", str(tmp_path / "compaction.yaml"), "--rollout-stop-token-ids", str(ids["la"])],
        tmp_path / "args.pkl")
    assert args.rollout_stop_token_ids == [ids["la"]] and sampling_params["stop_token_ids"] == [ids["la"]]
    assert args.compaction_env == f"{HERE}.make_first_action_env"  # slime copied the YAML's keys
    streams = [[ids["next"], ids["la"], ids["lo"], eos], [ids["answer"], ids["5"], eos]]

    async def run(args, sampling_params, index):
        async with SGLangStops(streams) as srv:
            args = argparse.Namespace(**dict(vars(args), sglang_router_ip="127.0.0.1",
                                             sglang_router_port=_port(srv.url)))
            out = await generate(args, Sample(index=index, prompt="p"), dict(sampling_params))
            return out, srv.requests

    def first_response(samples):  # the first run of trainable tokens: the first turn's response
        s = samples[0]
        out = []
        for t, m in zip(s.tokens[-s.response_length:], s.loss_mask):
            if not m and out:
                break
            out += [t] if m else []
        return out

    # slime's own arguments and sampling parameters: the loop stops at "la" too
    samples, requests = asyncio.run(run(args, sampling_params, 0))
    assert all({eos, ids["la"]} <= set(r["sampling_params"]["stop_token_ids"]) for r in requests)
    assert ENVS[0].actions == ["next", "answer 5"] and {s.reward for s in samples} == {1.0}
    assert first_response(samples) == [ids["next"], ids["la"]] and samples[0].status == Sample.Status.COMPLETED
    # sampling parameters without the key (a custom rollout function's): --rollout-stop-token-ids still holds
    no_key = {k: v for k, v in sampling_params.items() if k != "stop_token_ids"}
    samples, _ = asyncio.run(run(args, no_key, 1))
    assert ENVS[1].actions == ["next", "answer 5"] and first_response(samples) == [ids["next"], ids["la"]]
    # an eval dataset's own stop_token_ids replace the flag's in slime's sampling parameters: those hold
    samples, requests = asyncio.run(run(args, dict(sampling_params, stop_token_ids=[ids["lo"]]), 2))
    assert all(ids["la"] not in r["sampling_params"]["stop_token_ids"] for r in requests)
    assert ENVS[2].actions == ["next la", "answer 5"] and {s.reward for s in samples} == {0.0}
    # without slime's stop token the same policy's first turn runs to the end of turn: another result
    plain = argparse.Namespace(**dict(vars(args), rollout_stop_token_ids=None))
    samples, requests = asyncio.run(run(plain, dict(sampling_params, stop_token_ids=None), 3))
    assert all(ids["la"] not in r["sampling_params"]["stop_token_ids"] for r in requests)
    assert ENVS[3].actions == ["next la lo", "answer 5"] and {s.reward for s in samples} == {0.0}
    assert first_response(samples) == [ids["next"], ids["la"], ids["lo"], eos]


def _bare_rollout_manager(args):
    from slime.ray.rollout import RolloutManager

    rm = RolloutManager.__ray_actor_class__.__new__(RolloutManager.__ray_actor_class__)
    rm.args, rm.data_source = args, None
    rm.custom_reward_post_process_func = rm.custom_convert_samples_to_train_data_func = None
    return rm


class ModelServer(_GenerateServer):
    """/generate over HTTP backed by TransformersEngine (a real model), SGLang's request and response shape."""

    def __init__(self, engine):
        self.engine, self.requests = engine, 0

    async def _handle(self, request):
        from aiohttp import web

        body = await request.json()
        sp = body["sampling_params"]
        g = self.engine.generate([body["input_ids"]], [sp["max_new_tokens"]], temperature=sp["temperature"],
                                 top_p=sp["top_p"], stop_token_ids=sp["stop_token_ids"],
                                 seed=sp.get("sampling_seed"))[0]
        self.requests += 1
        return web.json_response({"text": "", "meta_info": {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(g.logprobs, g.token_ids)],
            "finish_reason": {"type": g.finish_reason}}})


@pytest.mark.slow
def test_real_model_logprobs_and_advantages():
    from slime.utils.types import Sample

    from compactionrl_fast.envs.models import tiny_llama
    from compactionrl_fast.rollout.engines import TransformersEngine

    tok = memory_tokenizer()
    model = tiny_llama(len(tok), seed=3)
    cfg = dataclasses.asdict(memory_config(max_turns=12, seed=5))

    async def run():
        async with ModelServer(TransformersEngine(model, pad_token_id=tok.pad_token_id)) as srv:
            args = _args(_port(srv.url), "make_memory_env", **cfg)
            outs = await asyncio.gather(*(generate(args, Sample(index=i, prompt=f"p{i}"),
                                                   {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0})
                                          for i in range(3)))
            return [s for o in outs for s in o]

    samples = asyncio.run(run())
    kinds = [s.metadata["compaction"]["kind"] for s in samples]
    assert "summary" in kinds, "the memory task's budget must force compactions"
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(s.tokens)
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
            first = len(s.tokens) - s.response_length
            pos = torch.arange(first, len(s.tokens))
            want = logp[pos - 1, ids[pos]]
            m = torch.tensor(s.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(s.rollout_log_probs)[m], want[m], rtol=1e-4, atol=1e-4)
    # these Samples through slime's data path: compute_advantages equals the packed batch's numbers
    ps = H.init_parallel(0, 1, H.free_port())
    try:
        from slime.backends.megatron_utils.loss import compute_advantages_and_returns

        inputs = H.token_inputs(samples, seed=9)
        args = H.slime_args(kl_coef=0.02)
        rd = H.add_token_inputs(H.rank_data(H.train_data(samples, args, 1), args, 0, 1), inputs)
        compute_advantages_and_returns(args, rd)
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    rollouts = _rollouts_of(samples)
    exp = H.expected(rollouts, samples, inputs, kl_coef=0.02, dtype="float64", gamma=1.0, lam="adaptive")
    for i, p in enumerate(rd["partition"]):
        torch.testing.assert_close(rd["advantages"][i].double(), exp[p][0], rtol=1e-5, atol=1e-5)


def _rollouts_of(samples):
    """Rollout records rebuilt from the Samples (tokens, masks), rollout id = position: for the oracle."""
    from compactionrl_fast.rollout.records import Rollout, Segment

    by = {}
    for s in samples:
        by.setdefault(s.rollout_id, []).append(s)
    out = []
    for rid in sorted(by):
        assert rid == len(out)
        segs = []
        for s in sorted(by[rid], key=lambda s: s.metadata["round_number"]):
            first = len(s.tokens) - s.response_length
            segs.append(Segment(s.metadata["compaction"]["kind"], s.tokens, [False] * first +
                                [bool(m) for m in s.loss_mask], [0.0] * len(s.tokens)))
        out.append(Rollout(segments=segs, reward=by[rid][0].reward))
    return out


def test_engine_generate_sync():
    fakes = _fakes()

    async def serve():
        async with fakes.FakeSGLangServer([[(-0.5, 4), (-0.25, 2)], [(-0.1, 3)]], finish_reason="length") as srv:
            eng = SGLangEngine(srv.url)
            loop = asyncio.get_running_loop()
            one = [await loop.run_in_executor(None, lambda: eng.generate([p], 4, stop_token_ids=[2])[0])
                   for p in ([1, 2], [3])]  # one at a time: the fake answers in order
            return one, srv.requests

    g, reqs = asyncio.run(serve())
    assert [x.token_ids for x in g] == [[4, 2], [3]] and [x.finish_reason for x in g] == ["stop", "length"]
    assert g[0].logprobs == [-0.5, -0.25] and [r["input_ids"] for r in reqs] == [[1, 2], [3]]


def test_harness_calls_give_the_loops_samples_and_advantages():
    """A slime harness that logs its LLM calls: samples_from_calls gives the same Samples (hence the same
    advantages) as the loop's own segments, where one Sample per segment with the full reward each and no order
    (slime's TrajectoryManager) would not be linked at all."""
    from slime.utils.types import Sample

    from compactionrl_fast.envs.memory import expert_rollouts
    from compactionrl_fast.integrations.slime import samples_from_calls, samples_from_rollout
    from compactionrl_fast.rollout import calls_from_rollout, loop_summary_suffix

    cfg = memory_config()
    rollouts = expert_rollouts(4, seed=2, config=cfg)
    assert any(ro.compactions for ro in rollouts)
    suffix = loop_summary_suffix(memory_tokenizer(), cfg)
    for i, ro in enumerate(rollouts):
        final = ro.segments[-1].input_ids if ro.segments[-1].kind == "exec" else None
        got = samples_from_calls(calls_from_rollout(ro), ro.reward, Sample(index=i), finish_reason=ro.finish_reason,
                                 summary_suffix=suffix, final_context=final)
        want = samples_from_rollout(ro, Sample(index=i))
        fields = ("tokens", "response_length", "loss_mask", "rollout_log_probs", "reward", "rollout_id", "status")
        assert [[getattr(s, f) for f in fields] + [s.metadata["round_number"]] for s in got] == \
               [[getattr(s, f) for f in fields] + [s.metadata["round_number"]] for s in want]
