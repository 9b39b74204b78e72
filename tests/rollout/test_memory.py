"""The built-in memory task: rules, difficulty knobs, scripted expert (and its systematic error),
tokenizer and chat template."""
import pytest

from compactionrl_fast.envs import (MemoryEnv, ScriptedExpert, expert_rollouts, memory_config, memory_tokenizer,
                                    summary_correct, word_tokenizer)
from compactionrl_fast.envs.memory import WORDS, expert_knowledge
from compactionrl_fast.rollout import run_rollouts


def test_env_rules():
    env = MemoryEnv(n_digits=3, n_fillers=4)
    system, task = env.reset(7)
    assert (system, task) == ("memory", "collect 3 digits answer all in order")
    seen = []
    for i in range(3):
        obs, done, r = env.step("next")
        w = obs.split()
        assert w[:2] == ["digit", str(i + 1)] and len(w) == 3 + 4 and not done and r == 0.0
        seen.append(w[2])
    assert seen == [str(d) for d in env.digits]
    assert env.step("next")[:3] == ("done", False, 0.0)
    assert env.step("whatever")[0] == "done"
    obs, done, r, info = env.step("answer " + " ".join(seen))
    assert done and r == 1.0 and info == {"success": True, "accuracy": 1.0}
    env.reset(7)
    wrong = list(seen)
    wrong[0] = str((int(wrong[0]) + 1) % 10)
    *_, info = env.step("answer " + " ".join(wrong))
    assert info["success"] is False and info["accuracy"] == pytest.approx(2 / 3)


def test_accuracy_reward_is_the_partial_credit():
    env = MemoryEnv(n_digits=4, n_fillers=0, reward="accuracy")
    env.reset(5)
    digits = [str(d) for d in env.digits]
    for guess, want in ((digits, 1.0), (digits[:2] + ["x", "x"], 0.5), (digits[:3], 0.75), ([], 0.0),
                        (["x"] + digits[:3], sum(a == b for a, b in zip(["x"] + digits[:3], digits)) / 4)):
        env.reset(5)
        _, done, r, info = env.step("answer " + " ".join(guess))
        assert done and r == want == info["accuracy"] and info["success"] is (want == 1.0)
    assert MemoryEnv(n_digits=4).reward == "exact"
    with pytest.raises(ValueError, match="reward must be one of \\('exact', 'accuracy'\\), got 'partial'"):
        MemoryEnv(reward="partial")


def test_env_knobs_and_determinism():
    a, b = MemoryEnv(n_digits=5, n_fillers=2, n_blank=3), MemoryEnv(n_digits=5, n_fillers=2, n_blank=3)
    assert a.reset(3) == b.reset(3)
    obs_a = [a.step("next")[0] for _ in range(9)]
    assert obs_a == [b.step("next")[0] for _ in range(9)]
    assert sum(o.startswith("none") for o in obs_a) == 3 and obs_a[-1] == "done"
    with pytest.raises(ValueError, match="n_digits"):
        MemoryEnv(n_digits=10)
    with pytest.raises(TypeError, match="n_digits must be an integer, got str 'abc'"):
        MemoryEnv(n_digits="abc")
    with pytest.raises(ValueError, match="n_fillers must be in 0..inf, got -1"):
        MemoryEnv(n_fillers=-1)
    with pytest.raises(TypeError, match="n_blank must be an integer"):
        MemoryEnv(n_blank=1.5)


def test_expert_solves_it_and_compacts_twice():
    ros = expert_rollouts(16, drop_oldest_p=0.0)
    assert all(r.success and r.compactions == 2 and r.finish_reason == "done" for r in ros)
    assert all(len(r.summaries) == 2 and r.summaries[1].split()[0] == "seen" for r in ros)
    assert all(summary_correct(r) == [True, True] for r in ros)
    lens = [[len(s) for s in r.segments if s.kind == "exec"] for r in ros]
    assert all(90 <= l[0] <= 115 and 90 <= l[1] <= 120 and 60 <= l[2] <= 90 for l in lens)


def test_expert_systematic_error():
    always = expert_rollouts(16, drop_oldest_p=1.0)
    assert not any(r.success for r in always)
    assert all(len(r.summaries[0].split()) == 1 + 4 - 1 for r in always)  # "seen" + 3 of the 4 digits
    assert all(summary_correct(r) == [False, False] for r in always)
    some = expert_rollouts(64, drop_oldest_p=0.55, seed=3)
    rate = sum(r.success for r in some) / 64
    assert 0.05 < rate < 0.45  # about (1 - 0.55)^2 = 0.2


def test_expert_knowledge_dedupes_kept_turns():
    msgs = [("user", "collect 4 digits answer all in order resume seen 5 6 7".split()),
            ("assistant", ["next"]), ("user", "digit 2 6 la".split()), ("user", "digit 3 7 lo".split()),
            ("user", "digit 4 1 li".split())]
    assert expert_knowledge(msgs) == ["5", "6", "7", "1"]


def test_expert_on_harder_settings():
    cfg = memory_config(budget=220)
    ros = run_rollouts(ScriptedExpert(drop_oldest_p=0.0), [MemoryEnv(n_digits=9, n_fillers=20, n_blank=2)
                                                           for _ in range(4)], memory_tokenizer(), cfg)
    assert all(r.success for r in ros) and all(r.compactions >= 2 for r in ros)


def test_tokenizer():
    tok = memory_tokenizer()
    assert len(tok) == 6 + len(WORDS) and (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    ids = tok.encode("digit 3 7 la <eos>", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["digit", "3", "7", "la", "<eos>"]
    assert tok.decode(ids, skip_special_tokens=True) == "digit 3 7 la"
    assert tok.encode("bogus", add_special_tokens=False) == [tok.unk_token_id]
    text = tok.apply_chat_template([{"role": "system", "content": "memory"}, {"role": "user", "content": "next"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.split() == ["<system>", "memory", "<eos>", "<user>", "next", "<eos>", "<assistant>"]
    with pytest.raises(ValueError, match="spaces"):
        word_tokenizer(["two words"])
