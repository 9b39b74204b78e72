"""The compaction loop's rules with a scripted engine: trigger, rebuild, k lowering, compaction cap,
truncation, max turns, environment errors, chat-template fidelity."""
import pytest

from compactionrl_fast.envs import memory_config, memory_tokenizer
from compactionrl_fast.rollout import ChatFormat, RolloutConfig, needs_compaction, rebuild, run_rollouts

from .helpers import AsyncListEnv, FixedEngine, ListEnv, Recorder, check_fidelity

TOK = memory_tokenizer()
SUMMARY = "seen 1 2"


def render(msgs, gen=False):
    text = TOK.apply_chat_template([{"role": r, "content": c} for r, c in msgs], tokenize=False,
                                   add_generation_prompt=gen)
    return TOK.encode(text, add_special_tokens=False)


def obs_text(n, word="la"):
    return " ".join([word] * n)


def simulate(obs_lens, cfg, task="collect digits"):
    """Independent model of the rules: (turn indices after which compaction happens, k of each rebuild,
    window lengths at each compaction). Assumes no truncation."""
    C, T = cfg.budget, cfg.compact_threshold
    ctx = len(render([("system", "memory"), ("user", task)]))
    resume = len(render([("system", "memory"), ("user", cfg.resume_template.format(task=task, summary=SUMMARY))]))
    turns, after, ks, windows = [], [], [], []
    for i, n in enumerate(obs_lens):
        L = len(TOK.encode(f"<assistant> next <eos> <user> {obs_text(n)} <eos>", add_special_tokens=False))
        ctx += L
        turns.append(L)
        if i == len(obs_lens) - 1:
            break
        if C - ctx < T and len(after) < cfg.max_compactions:
            after.append(i)
            windows.append(ctx)
            k = min(cfg.keep_recent_turns, len(turns))
            while k > 0 and C - (resume + sum(turns[len(turns) - k:])) < T:
                k -= 1
            turns = turns[len(turns) - k:]
            ks.append(k)
            ctx = resume + sum(turns)
    return after, ks, windows


CASES = {
    "memory_like": ([18] * 8, dict(budget=128, compact_threshold=40)),
    "varying": ([5, 30, 2, 17, 40, 3, 3, 25, 9, 1, 12, 30], dict(budget=150, compact_threshold=30)),
    "k_lowered": ([40, 38, 41, 39, 42, 40], dict(budget=130, compact_threshold=40)),
    "keep3": ([7, 9, 8, 6, 10, 9, 7, 8, 9, 6, 7], dict(budget=100, compact_threshold=25, keep_recent_turns=3)),
    "keep0": ([20] * 7, dict(budget=90, compact_threshold=30, keep_recent_turns=0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_trigger_and_rebuild_match_the_rules(name):
    obs_lens, kw = CASES[name]
    cfg = memory_config(max_compactions=3, max_turns=50, **kw)
    eng = Recorder(FixedEngine(TOK, summary=SUMMARY))
    ro = run_rollouts(eng, [ListEnv([obs_text(n) for n in obs_lens])], TOK, cfg)[0]
    after, ks, windows = simulate(obs_lens, cfg)
    assert ro.finish_reason == "done" and ro.reward == 1.0
    assert all(s.reward == 1.0 for s in ro.segments)
    assert ro.compactions == len(after)
    # the window index of every turn says after which turns compaction happened
    got_after = [i for i in range(len(ro.turns) - 1) if ro.turns[i + 1].window != ro.turns[i].window]
    assert got_after == after
    execs = [s for s in ro.segments if s.kind == "exec"]
    sums = [s for s in ro.segments if s.kind == "summary"]
    assert [s.kind for s in ro.segments] == ["exec", "summary"] * len(after) + ["exec"]
    assert [len(s) for s in execs[:-1]] == windows
    for w in windows:  # the trigger held at each compaction ...
        assert needs_compaction(w, cfg.budget, cfg.compact_threshold)
    # ... and the rebuilt context is system + resume(S) + the last k turns of the window
    turn_ids = TOK.encode("<assistant>", add_special_tokens=False)[0]
    for w, (ex, nxt, sm, k) in enumerate(zip(execs, execs[1:], sums, ks)):
        head = render([("system", "memory"), ("user", cfg.resume_template.format(task="collect digits", summary=SUMMARY))])
        starts = [i for i, t in enumerate(ex.input_ids) if t == turn_ids]
        kept = ex.input_ids[starts[len(starts) - k]:] if k else []
        assert nxt.input_ids[:len(head) + len(kept)] == head + kept
        assert sm.input_ids[:sm.shared_prefix] == ex.input_ids and sm.shared_prefix == len(ex)
        assert TOK.decode(sm.input_ids[sm.shared_prefix:], skip_special_tokens=True).split() == ["summarize", "seen", "1", "2"]
    if name == "k_lowered":
        assert ks and min(ks) < cfg.keep_recent_turns
    check_fidelity([ro], eng.calls)
    assert all(len(s) <= cfg.budget for s in execs)


def test_rebuild_lowers_k():
    head, turns = [0] * 10, [[1] * 30, [2] * 30, [3] * 30]
    assert rebuild(head, turns, 2, 80, 20) == (head + turns[2], 1)
    assert rebuild(head, turns, 2, 200, 20) == (head + turns[1] + turns[2], 2)
    assert rebuild(head, turns, 2, 30, 25) == (head, 0)
    assert rebuild(head, [], 2, 100, 20) == (head, 0)


def test_compaction_cap_then_truncated_when_full():
    cfg = memory_config(budget=110, compact_threshold=30, max_compactions=1, max_turns=100, truncated_reward=-1.0)
    obs = [obs_text(15)] * 30
    ro = run_rollouts(FixedEngine(TOK), [ListEnv(obs)], TOK, cfg)[0]
    assert ro.compactions == 1 and ro.finish_reason == "context_full" and ro.truncated
    assert ro.reward == -1.0 and all(s.reward == -1.0 for s in ro.segments)
    assert all(len(s) <= cfg.budget for s in ro.segments if s.kind == "exec")
    last = ro.segments[-1]
    assert len(last) > cfg.budget - 20  # it ran until the budget was used up


def test_long_observation_truncated_with_marker():
    cfg = memory_config(budget=128, compact_threshold=40, max_turns=10)
    ro = run_rollouts(FixedEngine(TOK), [ListEnv([obs_text(300), "done", "x"])], TOK, cfg)[0]
    t0 = ro.turns[0]
    assert t0.observation_truncated and not ro.turns[1].observation_truncated
    first = ro.segments[0]
    assert len(first) == cfg.budget
    words = TOK.convert_ids_to_tokens(first.input_ids)
    assert words[-2:] == ["truncated", "<eos>"]
    # the huge turn cannot be kept: the next window starts with system + resume only
    assert ro.compactions >= 1 and ro.finish_reason == "done"
    nxt = ro.segments[2]
    head = render([("system", "memory"), ("user", cfg.resume_template.format(task="collect digits", summary=SUMMARY))])
    assert nxt.input_ids[:len(head)] == head and TOK.convert_ids_to_tokens(nxt.input_ids[len(head):])[:2] == \
        ["<assistant>", "next"]


@pytest.mark.parametrize("truncated_reward", [0.5, None])
def test_max_turns(truncated_reward):
    cfg = memory_config(max_turns=3, truncated_reward=truncated_reward)
    ro = run_rollouts(FixedEngine(TOK), [ListEnv(["la"] * 10)], TOK, cfg)[0]
    assert ro.finish_reason == "max_turns" and ro.truncated and len(ro.turns) == 3
    assert ro.reward == (0.5 if truncated_reward is not None else 0.0)


def test_environment_errors_end_only_their_rollout():
    envs = [ListEnv(["la"] * 3), ListEnv(["la"] * 5, fail_at=2), ListEnv(["la"], fail_reset=True),
            AsyncListEnv(["lo"] * 4), AsyncListEnv(["lo"] * 4, fail_at=0)]
    ros = run_rollouts(FixedEngine(TOK), envs, TOK, memory_config(error_reward=-2.0))
    assert [r.finish_reason for r in ros] == ["done", "error", "error", "done", "error"]
    assert [r.reward for r in ros] == [1.0, -2.0, -2.0, 1.0, -2.0]
    assert "KeyError" in ros[1].error and "RuntimeError" in ros[2].error and ros[0].error is None
    assert len(ros[1].turns) == 3 and ros[2].segments == [] and len(ros[3].turns) == 4
    # the failed step's response is still recorded (trainable) in the last window
    assert ros[1].segments[-1].num_trainable == 3 * 2


def test_chat_template_fidelity_without_compaction():
    """With no compaction, the window is exactly the chat template's rendering of the conversation."""
    obs = ["digit 1 4 la", "lo li", "done"]
    ro = run_rollouts(FixedEngine(TOK), [ListEnv(obs)], TOK, memory_config(budget=1000))[0]
    msgs = [("system", "memory"), ("user", "collect digits")]
    for o in obs:
        msgs += [("assistant", "next"), ("user", o)]
    assert ro.segments[0].input_ids == render(msgs)
    assert ro.segments[0].num_trainable == 2 * len(obs)


def test_chat_format_pieces():
    chat = ChatFormat(TOK)
    assert TOK.convert_ids_to_tokens(chat.gen_prompt) == ["<assistant>"]
    assert TOK.convert_ids_to_tokens(chat.assistant_end) == ["<eos>"]
    assert chat.stop_token_ids == (TOK.eos_token_id,)
    assert chat.close_response(chat.encode("next <eos>")) == []
    assert chat.close_response(chat.encode("next")) == chat.assistant_end
    s = chat.encode("seen 4 2")
    assert chat.resume_head("memory", "collect", s, "{task} resume {summary}") == \
        render([("system", "memory"), ("user", "collect resume seen 4 2")])


def test_config_validation():
    with pytest.raises(ValueError, match="budget"):
        RolloutConfig(budget=0)
    with pytest.raises(ValueError, match="top_p"):
        RolloutConfig(top_p=0.0)
    with pytest.raises(ValueError, match="resume_template"):
        RolloutConfig(resume_template="no placeholder")
    with pytest.raises(ValueError, match="unknown"):
        RolloutConfig().replace(bogus=1)
    with pytest.raises(ValueError, match="seeds"):
        run_rollouts(FixedEngine(TOK), [ListEnv(["la"])], TOK, memory_config(), seeds=[1, 2])


def test_plain_format_without_chat_template():
    """A tokenizer without a chat template gets a plain "role: text" format ending turns with EOS."""
    from compactionrl_fast.envs import word_tokenizer
    from compactionrl_fast.envs.memory import WORDS

    tok = word_tokenizer(list(WORDS) + ["system:", "user:", "assistant:"], chat_template=None)
    chat = ChatFormat(tok)
    assert tok.convert_ids_to_tokens(chat.gen_prompt) == ["assistant:"]
    assert chat.stop_token_ids == (tok.eos_token_id,)
    ro = run_rollouts(FixedEngine(tok), [ListEnv(["la lo", "done"])], tok, memory_config(budget=200), chat=chat)[0]
    words = tok.convert_ids_to_tokens(ro.segments[0].input_ids)
    assert words == ("system: memory user: collect digits assistant: next <eos> user: la lo "
                     "assistant: next <eos> user: done").split()
