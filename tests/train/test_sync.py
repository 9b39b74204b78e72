"""Weight sync and the sampler-vs-learner guard (train/sync.py) in `fit`, on the tiny task with an engine that
holds its own copy of the actor (a TransformersEngine on a deep copy: it behaves as vLLM does towards the
trainer); the thread tuner standing down when torch ignores set_num_threads; VLLMEngine's sync paths on a
stand-in `LLM` (the real engine: tests/vllm/, `make test-vllm`)."""
import copy
import math

import pytest
import torch

from compactionrl_fast.app import runner
from compactionrl_fast.rollout.engines.transformers_engine import TransformersEngine
from compactionrl_fast.train import loop as train_loop, sync
from compactionrl_fast.train.model import critic_from_actor
from compactionrl_fast.train.sync import SamplerMismatchError, check_sampler, push_weights
from compactionrl_fast.train.loop import fit
from compactionrl_fast.train.trainer import make_state

from ._tiny import tiny_train_config


class CopyEngine(TransformersEngine):
    """The embedded engine on its own copy of the weights; counts loads."""

    def __init__(self, model, **kw):
        super().__init__(copy.deepcopy(model), **kw)
        self.loads = 0

    def load_weights(self, state_dict, strict=True):
        self.loads += 1
        super().load_weights(state_dict, strict)


def _setup(tmp, **kw):
    cfg = tiny_train_config(tmp / "run", **{"steps": 3, "actor_lr": 1e-2, **kw})
    tok, make_envs, rcfg = runner.task(cfg)
    actor = runner.build(cfg, tok)
    state = make_state(cfg, actor, critic_from_actor(actor))
    rows = []

    class Log:
        def log(self, step, metrics):
            rows.append((step, dict(metrics)))

    def run(engine):
        fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=runner.packer(cfg),
            run_dir=cfg.run_dir, log=Log())
        return rows

    return cfg, tok, actor, run


def test_fit_syncs_an_engine_with_its_own_weights(tmp_path):
    cfg, tok, actor, run = _setup(tmp_path)
    stale = runner.build(_reseed(cfg, 5), tok)
    engine = CopyEngine(stale, pad_token_id=tok.pad_token_id)  # other weights: the start-of-RL sync fixes them
    rows = run(engine)
    assert engine.loads == 1 + cfg.steps  # at the start, then after every actor update
    for k, v in actor.state_dict().items():
        assert torch.equal(engine.model.state_dict()[k], v), k
    gaps = [m["sampler/logp_absdiff_max"] for _, m in rows if "sampler/logp_absdiff_max" in m]
    assert len(gaps) == 1 + cfg.steps  # the first (critic-only) step and every actor step
    assert max(gaps) <= 1e-4
    assert all(m["time/weight_sync_s"] > 0 for _, m in rows)


def _reseed(cfg, seed):
    from compactionrl_fast.train.config_load import update

    return update(cfg, {"seed": seed})


def test_a_skipped_sync_is_caught(tmp_path, monkeypatch):
    """Without the sync after an update the engine samples from the old policy: the next step stops."""
    cfg, tok, actor, run = _setup(tmp_path)
    engine = CopyEngine(actor, pad_token_id=tok.pad_token_id)
    monkeypatch.setattr(train_loop, "push_weights", lambda engine, actor: 0.0)
    with pytest.raises(SamplerMismatchError, match=r"step 2: .* > sampler_logp_tol = 0.001.*not synced"):
        run(engine)
    assert engine.loads == 0


def test_a_skipped_first_sync_is_caught_on_a_critic_only_step(tmp_path, monkeypatch):
    cfg, tok, actor, run = _setup(tmp_path)
    engine = CopyEngine(runner.build(_reseed(cfg, 5), tok), pad_token_id=tok.pad_token_id)
    monkeypatch.setattr(train_loop, "push_weights", lambda engine, actor: 0.0)
    with pytest.raises(SamplerMismatchError, match="step 0"):
        run(engine)


def test_the_guard_can_be_turned_off(tmp_path, monkeypatch):
    cfg, tok, actor, run = _setup(tmp_path, sampler_logp_tol=None)
    monkeypatch.setattr(train_loop, "push_weights", lambda engine, actor: 0.0)
    rows = run(CopyEngine(actor, pad_token_id=tok.pad_token_id))
    assert max(m["sampler/logp_absdiff_max"] for _, m in rows if "sampler/logp_absdiff_max" in m) > 1e-3


def test_an_engine_on_the_actor_is_never_loaded(tmp_path):
    cfg, tok, actor, run = _setup(tmp_path, steps=1)
    engine = TransformersEngine(actor, pad_token_id=tok.pad_token_id)
    engine.load_weights = lambda *a, **k: pytest.fail("the engine shares the actor: nothing to load")
    rows = run(engine)
    assert engine.shares_weights(actor) and all(m["time/weight_sync_s"] == 0 for _, m in rows)
    assert push_weights(engine, actor) == 0.0


def test_check_sampler():
    check_sampler(1e-3, 1e-3, 0, None)
    check_sampler(5.0, None, 0, None)  # off
    check_sampler(None, 1e-3, 0, None)  # nothing measured this step
    for bad in (2e-3, math.inf, math.nan):
        with pytest.raises(SamplerMismatchError, match="weights were not synced"):
            check_sampler(bad, 1e-3, 4, object())


def test_thread_tuner_stands_down_when_set_num_threads_is_ignored(monkeypatch):
    from compactionrl_fast.train.threads import ThreadTuner

    have = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker does
    tuner = ThreadTuner(choices=[have, have + 1])
    with pytest.warns(RuntimeWarning, match="had no effect"):
        for _ in range(4):
            with tuner.step() as n:
                assert n == have  # the count in force, never one that was not applied
    assert tuner.locked and tuner.choices == [have] and tuner.history == []


class _StandInLLM:
    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, {k: (list(v) if k == "weights_iterator" else v) for k, v in kwargs.items()}))

    def apply_model(self, fn):
        class M:
            def load_weights(_, it):
                self.calls.append(("apply_model", list(it)))
        return [fn(M())]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))


@pytest.mark.parametrize("reload,in_process", [(True, True), (True, False), (False, True)])
def test_vllm_engine_sync_paths(reload, in_process):
    from compactionrl_fast.rollout.engines.vllm_engine import VLLMEngine

    eng = object.__new__(VLLMEngine)
    eng.llm, eng.reload, eng.in_process, eng._sync_dir = _StandInLLM(), reload, in_process, None
    sd = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(2)}
    eng.load_weights(sd)
    (method, arg), last = eng.llm.calls
    assert last == ("reset_prefix_cache", None)  # cached KV belongs to the old weights
    if reload and in_process:
        assert method == "reload_weights" and [k for k, _ in arg["weights_iterator"]] == list(sd)
    elif reload:
        from safetensors.torch import load_file

        assert method == "reload_weights"
        got = load_file(arg["weights_path"] + "/model.safetensors")
        assert all(torch.equal(got[k], v) for k, v in sd.items())
    else:
        assert method == "apply_model" and [k for k, _ in arg] == list(sd)
    assert not eng.shares_weights(None)


def test_vllm_row_seeds_do_not_repeat_across_calls():
    """The loop seeds its calls (turns) with consecutive numbers: no (call, row) pair may share a row seed."""
    from compactionrl_fast.rollout.engines.vllm_engine import row_seed

    seeds = [row_seed(s, i) for s in range(1000, 1064) for i in range(256)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 1 << 63 for x in seeds)
    assert row_seed(7, 3) == row_seed(7, 3)
