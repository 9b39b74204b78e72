"""The `compaction_agent` loop against the real verl 0.9.1: run with a `server_manager` backed by our
TransformersEngine (a tiny Llama on the memory task), its outputs through verl's own
`AgentLoopWorkerTQ._agent_loop_postprocess`, compared with the same episode through `run_rollouts`."""
import asyncio

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.v1", reason="verl's V1 path is not importable (`make test-integrations`)")
from omegaconf import OmegaConf  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from compactionrl_fast.envs.memory import MemoryEnv, memory_config, memory_tokenizer  # noqa: E402
from compactionrl_fast.envs.models import tiny_llama  # noqa: E402
from compactionrl_fast.integrations.verl import agent_loop as VA  # noqa: E402
from compactionrl_fast.integrations.verl.engine import ServerManagerEngine  # noqa: E402
from compactionrl_fast.rollout import run_rollouts  # noqa: E402
from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine  # noqa: E402
from tests.integrations.verl.test_agent import MemoryTQ, _worker  # noqa: E402

ROLLOUT = dict(seed=11, max_turns=12)  # RolloutConfig fields on top of the memory task's (budget 128, ...)


class EngineServer:
    """verl's LLMServerClient.generate over our engine: one prompt per call, the request's seed and caps."""

    def __init__(self, engine, versions=None):
        self.engine, self.calls, self.versions = engine, [], versions  # versions: call -> weight version

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        self.calls.append((request_id, dict(sampling_params)))
        p = sampling_params
        (g,) = self.engine.generate([prompt_ids], p["max_tokens"], temperature=p["temperature"], top_p=p["top_p"],
                                    stop_token_ids=p["stop_token_ids"], seed=p.get("seed"))
        # what verl's LLMServerClient returns: the server's weight version as the call's min and max
        v = self.versions(len(self.calls)) if self.versions else None
        extra = {} if v is None else {"global_steps": v, "min_global_steps": v, "max_global_steps": v}
        return TokenOutput(token_ids=g.token_ids, log_probs=g.logprobs, stop_reason="completed", extra_fields=extra)


def _config(use_v1=True, **compaction):
    sec = dict(env="compactionrl_fast.envs.memory:MemoryEnv", env_kwargs={"n_digits": 4, "n_fillers": 6},
               rollout=dict(ROLLOUT, **{k: v for k, v in vars(memory_config()).items()
                                        if k in ("budget", "compact_threshold", "keep_recent_turns", "max_compactions",
                                                 "max_response_tokens", "summary_max_tokens", "summary_instruction",
                                                 "resume_template", "truncation_marker")}))
    sec.update(compaction)
    return OmegaConf.create({"trainer": {"use_v1": use_v1}, "compaction": sec,
                             "actor_rollout_ref": {"rollout": {"n": 2}}})


def _loop(config, server):
    loop = object.__new__(VA.CompactionAgentLoop)
    loop.config, loop.server_manager, loop.tokenizer = config, server, memory_tokenizer()
    return loop


@pytest.fixture(scope="module")
def engine():
    tok = memory_tokenizer()
    return TransformersEngine(tiny_llama(len(tok), seed=5), pad_token_id=tok.pad_token_id, prefix_cache=False)


def test_agent_loop_through_verl_postprocess_equals_run_rollouts(engine, monkeypatch):
    import verl.trainer.ppo.v1 as v1

    tq = MemoryTQ()
    monkeypatch.setattr(v1.agent_loop_tq, "tq", tq)
    server = EngineServer(engine)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    outs = asyncio.run(_loop(_config(), server).run(sampling, uid="p7", session_id=1, index=3, raw_prompt=[]))
    # the session's sampling seed: compaction.rollout.seed mixed with the task seed and the session index
    cfg = memory_config(**ROLLOUT)
    cfg = cfg.replace(seed=VA.session_seed(cfg.seed, 3, 1))
    (want,) = run_rollouts(engine, [MemoryEnv(n_digits=4, n_fillers=6)], memory_tokenizer(), cfg, seeds=[3])
    segs = [s for s in want.segments if any(s.loss_mask)]
    assert want.compactions >= 1 and len(segs) == len(outs) >= 3  # compacted: exec, summary, exec, ...
    asyncio.run(_worker()._agent_loop_postprocess(outs, False, uid="p7", session_id=1, raw_prompt=[], global_steps=1))
    assert sorted(tq.rows) == [f"p7_1_{i}" for i in range(len(segs))]
    for i, s in enumerate(segs):
        row = tq.rows[f"p7_1_{i}"]
        start = s.loss_mask.index(True)
        assert row["prompts"].tolist() == s.input_ids[:start]
        assert row["responses"].tolist() == s.input_ids[start:]
        assert row["response_mask"].tolist() == [int(m) for m in s.loss_mask[start:]]
        torch.testing.assert_close(row["rollout_log_probs"], torch.tensor(s.logprobs[start:], dtype=torch.float32))
        assert row["extra_fields"]["segment_index"] == i and row["extra_fields"]["rollout_id"] == "p7_1"
        assert row["extra_fields"]["seed"] == 3
        assert row["extra_fields"]["segment_kind"] == s.kind
        assert float(row["rm_scores"].sum()) == want.reward  # verl copied the last output's reward
    assert {r for r, _ in server.calls} == {"p7_1-0"}  # one sticky session
    assert all(p["logprobs"] is True and "seed" in p for _, p in server.calls)


@pytest.mark.parametrize("versions,want", [(lambda c: 3 if c <= 2 else 4, (3, 4)), (None, (5, 5))])
def test_outputs_carry_the_weight_versions_verl_reads(engine, versions, want):
    """Every output has verl's min_global_steps / max_global_steps (its metrics and staleness control read
    them): the first and last weight version the servers reported over the rollout; without any, the
    step the sample was drawn for. And the schema keys of verl's own loops."""
    server = EngineServer(engine, versions)
    outs = asyncio.run(_loop(_config(), server).run({"temperature": 1.0, "top_p": 1.0}, uid="p", session_id=0,
                                                    index=3, global_steps=5))
    assert len(server.calls) > 2 and len(outs) >= 2
    for o in outs:
        assert (o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]) == want
        assert o.extra_fields["turn_scores"] == [] and o.extra_fields["tool_rewards"] == []


def test_engine_applies_caps_stops_and_verl_sampling(engine):
    server = EngineServer(engine)
    eng = ServerManagerEngine(server, {"temperature": 0.5, "top_k": -1}, request_id="r")
    gens = asyncio.run(eng.generate([[3, 4], [5]], [2, 3], temperature=1.0, top_p=0.9, stop_token_ids=(2,), seed=4))
    assert [len(g.token_ids) <= c for g, c in zip(gens, [2, 3])] == [True, True]
    assert [p["max_tokens"] for _, p in server.calls] == [2, 3]
    assert all(p["temperature"] == 0.5 and p["top_p"] == 0.9 and p["stop_token_ids"] == [2] for _, p in server.calls)


def test_agent_loop_errors_name_the_key(engine):
    server = EngineServer(engine)
    with pytest.raises(ValueError, match="trainer.use_v1"):
        asyncio.run(_loop(_config(use_v1=False), server).run({}, uid="u", session_id=0, index=0))
    with pytest.raises(ValueError, match="compaction.env"):
        asyncio.run(_loop(_config(env="no_such_module:Env"), server).run({}, uid="u", session_id=0, index=0))
    with pytest.raises(ValueError, match="compaction.rollout"):
        asyncio.run(_loop(_config(rollout={"budget": -1}), server).run({}, uid="u", session_id=0, index=0))
    with pytest.raises(ValueError, match="compaction.seed_key"):
        asyncio.run(_loop(_config(seed_key="level"), server).run({}, uid="u", session_id=0, index=0))
    with pytest.raises(ValueError, match="compaction"):
        asyncio.run(_loop(OmegaConf.create({"trainer": {"use_v1": True}}), server).run({}, uid="u", index=0))


def test_engine_needs_logprobs():
    class NoLogprobs:
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            return TokenOutput(token_ids=[1, 2], log_probs=None)

    with pytest.raises(ValueError, match="log_probs"):
        asyncio.run(ServerManagerEngine(NoLogprobs()).generate([[1]], 2))
    with pytest.raises(TypeError, match="server_manager"):
        ServerManagerEngine(object())


def test_session_seeds_differ_by_task_and_session_and_repeat_exactly():
    """compaction.rollout.seed: every session of a job gets its own sampling seed, a function of the configured
    seed, the task seed and the session index only (so a relaunch, or another data-parallel layout, samples the
    same rollouts), in [0, 2**31)."""
    seeds = {VA.session_seed(7, task, s) for task in range(50) for s in range(4)}
    assert len(seeds) == 200 and all(0 <= x < 2 ** 31 for x in seeds)
    assert VA.session_seed(7, 3, 1) == VA.session_seed(7, 3, 1) != VA.session_seed(8, 3, 1)

