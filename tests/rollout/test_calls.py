"""Segments from call logs: the built-in loop's calls, recorded per rollout at the engine, rebuilt with
rollout_from_calls, pack bitwise equal to the loop's own rollouts; bad logs fail naming the call."""
import os
import runpy
from dataclasses import fields

import pytest
import torch

from compactionrl_fast.envs import MemoryEnv, memory_config, memory_tokenizer, tiny_llama
from compactionrl_fast.packing import PackedBatch, pack
from compactionrl_fast.rollout import (Call, Engine, TransformersEngine, calls_from_rollout, loop_summary_suffix,
                                       rollout_from_calls, run_rollouts)

from .helpers import FixedEngine, ListEnv

TOK = memory_tokenizer()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CallLog(Engine):
    """Wraps an engine; logs every request as a Call under its rollout (the loop's cache key), as a
    harness would log its calls: no summary marks."""

    def __init__(self, inner):
        self.inner, self.calls = inner, {}

    def generate(self, prompts, max_new_tokens, **kw):
        out = self.inner.generate(prompts, max_new_tokens, **kw)
        for key, p, g in zip(kw["cache_keys"], prompts, out):
            self.calls.setdefault(key, []).append(Call(list(p), list(g.token_ids), list(g.logprobs),
                                                       finish_reason=g.finish_reason))
        return out


def run(engine, envs, cfg, seeds=None):
    log = CallLog(engine)
    ros = run_rollouts(log, envs, TOK, cfg, seeds=seeds)
    return ros, [log.calls.get(i, []) for i in range(len(ros))]


def rebuild(ro, calls, cfg):
    """rollout_from_calls with what a harness knows about the episode besides its calls."""
    final = ro.segments[-1].input_ids if ro.segments and ro.segments[-1].kind == "exec" else None
    return rollout_from_calls(calls, ro.reward, finish_reason=ro.finish_reason, error=ro.error, info=ro.info,
                              summary_suffix=loop_summary_suffix(TOK, cfg), final_context=final, budget=cfg.budget)


def assert_same_batch(a, b):
    for f in fields(PackedBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def ob(n, word="la"):
    return " ".join([word] * n)


# one environment per path of the loop; with compact_threshold 0 the loop compacts only when no response
# fits, so summaries follow summaries and the last call can be a summary
SCRIPTS = [[ob(3)] * 2, [ob(18)] * 5, [ob(18)] * 9, [ob(18)] * 40, [ob(60), ob(90), ob(90), ob(90), ob(5)],
           [ob(5), ""], [ob(200)] * 3, [ob(2)] * 30]


@pytest.fixture(scope="module")
def scripted():
    out = []
    for threshold in (40, 0):
        cfg = memory_config(compact_threshold=threshold, max_turns=20)
        envs = [ListEnv(s) for s in SCRIPTS] + [ListEnv([ob(18)] * 9, fail_at=4)]
        out.append((cfg,) + run(FixedEngine(TOK), envs, cfg))
    return out


@pytest.fixture(scope="module")
def model():
    """A random tiny Llama on the memory task (long junk responses: compactions, truncations)."""
    cfg = memory_config(temperature=1.0, max_turns=10, seed=3)
    envs = [MemoryEnv(n_digits=3 + i % 4, n_fillers=5 + 4 * i, n_blank=i % 2) for i in range(5)]
    eng = TransformersEngine(tiny_llama(len(TOK), seed=1), pad_token_id=TOK.pad_token_id)
    return (cfg,) + run(eng, envs, cfg, seeds=list(range(50, 55)))


def check_round_trip(cfg, ros, calls):
    rebuilt = [rebuild(ro, c, cfg) for ro, c in zip(ros, calls)]
    for sharing in (False, True):
        assert_same_batch(pack(ros, prefix_sharing=sharing), pack(rebuilt, prefix_sharing=sharing))
        assert_same_batch(pack(ros, prefix_sharing=sharing, mask_errors=False, reward_mode="stitched"),
                          pack(rebuilt, prefix_sharing=sharing, mask_errors=False, reward_mode="stitched"))
    for ro, r2, c in zip(ros, rebuilt, calls):
        assert [(s.kind, s.input_ids, s.loss_mask, s.logprobs, s.shared_prefix, s.reward) for s in ro.segments] == \
               [(s.kind, s.input_ids, s.loss_mask, s.logprobs, s.shared_prefix, s.reward) for s in r2.segments]
        assert [(t.response_tokens, t.window) for t in ro.turns] == [(t.response_tokens, t.window) for t in r2.turns]
        # the inverse: the calls the loop made, read back from its rollout
        inv = calls_from_rollout(ro)
        assert [(x.prompt_ids, x.completion_ids, x.completion_logprobs) for x in inv] == \
               [(x.prompt_ids, x.completion_ids, x.completion_logprobs) for x in c]
        # explicit summary marks give the same rollout as the inferred ones
        marked = [Call(x.prompt_ids, x.completion_ids, x.completion_logprobs, is_summary=y.is_summary)
                  for x, y in zip(c, inv)]
        assert_same_batch(pack([rebuild(ro, marked, cfg)], prefix_sharing=True), pack([ro], prefix_sharing=True))
    return rebuilt


def test_round_trip_scripted(scripted):
    kinds = set()
    for cfg, ros, calls in scripted:
        check_round_trip(cfg, ros, calls)
        for ro, c in zip(ros, calls):
            inv = calls_from_rollout(ro)
            kinds.add(min(ro.compactions, 2))
            kinds.add(ro.finish_reason)
            if inv and inv[-1].is_summary:
                kinds.add("last call a summary")
            if any(a.is_summary and b.is_summary for a, b in zip(inv, inv[1:])):
                kinds.add("summary after summary")
            if any(t.observation_truncated for t in ro.turns):
                kinds.add("observation cut")
    assert kinds >= {0, 1, 2, "done", "max_turns", "context_full", "error", "last call a summary",
                     "summary after summary", "observation cut"}


def test_round_trip_tiny_model(model):
    cfg, ros, calls = model
    assert sum(r.compactions for r in ros) >= 3 and any(r.truncated for r in ros)
    check_round_trip(cfg, ros, calls)


def test_defaults_without_suffix_and_final_context(scripted):
    """Without summary_suffix and final_context the layout differs (windows end at the summary prompt /
    the last completion) but the trainable tokens, their log-probs and the segment kinds are the same."""
    cfg, ros, calls = scripted[0]
    loose = [rollout_from_calls(c, ro.reward, finish_reason=ro.finish_reason) for ro, c in zip(ros, calls)]
    for sharing in (False, True):
        a, b = (pack(x, prefix_sharing=sharing, mask_errors=False) for x in (ros, loose))
        assert torch.equal(a.input_ids[a.loss_mask], b.input_ids[b.loss_mask])
        assert torch.equal(a.rollout_logprobs[a.loss_mask], b.rollout_logprobs[b.loss_mask])
        assert torch.equal(a.segment_kind, b.segment_kind) and torch.equal(a.num_turns, b.num_turns)
    s = next(s for r in loose for s in r.segments if s.kind == "summary")
    assert s.shared_prefix == s.loss_mask.index(True)  # the whole summary prompt is the window


def test_plain_rebuild_and_summary_marks():
    a = Call([1, 2], [3, 2], [-0.1, -0.2])
    cut = Call([1, 4], [5], [-0.3])  # does not extend call 0
    ro = rollout_from_calls([a, cut], 1.0)  # inferred: call 0 is a summary (its window: its whole prompt)
    assert [s.kind for s in ro.segments] == ["exec", "summary", "exec"] and ro.compactions == 1
    assert ro.segments[0].input_ids == [1, 2] and ro.segments[1].shared_prefix == 2 and len(ro.turns) == 1
    # marked an ordinary turn: the harness rebuilt its context without a summary, a new window starts
    plain = Call(a.prompt_ids, a.completion_ids, a.completion_logprobs, is_summary=False)
    ro = rollout_from_calls([plain, cut], 1.0)
    assert [s.kind for s in ro.segments] == ["exec", "exec"] and ro.compactions == 0 and len(ro.turns) == 2
    assert [s.input_ids for s in ro.segments] == [[1, 2, 3, 2], [1, 4, 5]]
    ro = rollout_from_calls([a, Call([1, 2, 3, 2, 7], [8], [-0.4])], 1.0, final_context=[1, 2, 3, 2, 7, 8, 9])
    assert [s.kind for s in ro.segments] == ["exec"] and ro.segments[0].input_ids == [1, 2, 3, 2, 7, 8, 9]
    assert ro.segments[0].loss_mask == [False, False, True, True, False, True, False]
    assert [t.observation_tokens for t in ro.turns] == [1, 1]
    assert rollout_from_calls([], 0.0).segments == []
    err = rollout_from_calls([a], 0.0, finish_reason="error")
    assert err.error and pack([err]).errored.tolist() == [True]


@pytest.mark.parametrize("calls, kw, match", [
    ([Call([1, 2], [3], [-0.1]), Call([1, 2, 3], [4, 5], [-0.1])], {},
     r"calls\[1\]: 1 log-probs for a completion of 2"),
    ([Call([1, 2], [3], [-0.1]), Call([], [4], [-0.1])], {}, r"calls\[1\]\.prompt_ids is empty"),
    ([Call([1, 2], [], [])], {}, r"calls\[0\]: completion of 0 tokens with finish_reason=None"),
    ([Call([1, 2], [], [], finish_reason="stop")], {}, r"calls\[0\]: completion of 0 tokens"),
    ([Call([1, 2], [3], [-0.1]), Call(list(range(1, 9)), [3], [-0.1])], {"budget": 6},
     r"calls\[1\]: prompt of 8 tokens is longer than budget=6"),
    ([Call([1, 2.0], [3], [-0.1])], {}, r"calls\[0\]\.prompt_ids must hold int token ids"),
    ([Call([1, 2], ["3"], [-0.1])], {}, r"calls\[0\]\.completion_ids must hold int token ids"),
    ([Call([1, 2], [True], [-0.1])], {}, r"calls\[0\]\.completion_ids must hold int token ids"),
    ([Call([1, -2], [3], [-0.1])], {}, r"calls\[0\]\.prompt_ids must hold int token ids >= 0"),
    ([Call([1, 2], [3], ["x"])], {}, r"calls\[0\]\.completion_logprobs must be a list of numbers"),
    ([Call([1, 2], [3], [float("nan")])], {}, r"calls\[0\]\.completion_logprobs holds NaN"),
    ([Call([1, 2], [3], [-0.1], is_summary=True), Call([1, 2, 3, 4], [5], [-0.1])], {},
     r"calls\[0\] is marked a summary but calls\[1\] continues it"),
    ([Call([1, 2], [3], [-0.1]), Call([1, 2, 3, 9], [5], [-0.1], is_summary=True)], {"summary_suffix": [8]},
     r"calls\[1\]: summary prompt does not end with summary_suffix"),
    ([Call([1, 2], [3], [-0.1]), Call([1, 2, 3, 9], [5], [-0.1], is_summary=True)], {"summary_suffix": 2},
     r"calls\[1\]: summary_suffix \(2 tokens\) reaches into calls\[0\]'s completion"),
    ([Call([1, 2], [3], [-0.1])], {"finish_reason": "bogus"}, r"finish_reason must be one of"),
    ([Call([1, 2], [3], [-0.1])], {"final_context": [1, 2, 3, 4], "budget": 3}, r"final_context of 4 tokens"),
    (["not a call"], {}, r"calls\[0\] must be a Call"),
])
def test_bad_logs_name_the_call(calls, kw, match):
    with pytest.raises(ValueError, match=match):
        rollout_from_calls(calls, 1.0, **kw)


def test_accepted_log_forms():
    """numpy / tensor ids and an empty completion that the sampler ended for lack of room."""
    np = pytest.importorskip("numpy")
    c = Call(np.array([1, 2]), torch.tensor([3, 2]), torch.tensor([-0.5, -0.25]))
    ro = rollout_from_calls([c, Call([1, 2, 3, 2, 4], [], [], finish_reason="length")], 1.0, budget=5)
    assert ro.segments[0].input_ids == [1, 2, 3, 2, 4] and all(type(t) is int for t in ro.segments[0].input_ids)
    assert ro.segments[0].logprobs == [0.0, 0.0, -0.5, -0.25, 0.0] and len(ro.turns) == 2


def test_example_script_runs():
    ns = runpy.run_path(os.path.join(ROOT, "examples", "record_calls.py"))
    ros, batch = ns["main"](n=2, verbose=False)
    assert all(r.compactions >= 1 and r.summaries[0].startswith("seen") for r in ros)
    assert batch.num_trainable == sum(r.num_trainable for r in ros) and (batch.segment_kind == 1).any()
