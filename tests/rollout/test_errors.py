"""Bad input to pack() and run_rollouts(): clear errors naming the argument; a broken environment ends only
its own rollout; a budget that cannot hold the prompt is refused."""
import pytest

from compactionrl_fast.envs import memory_config, memory_tokenizer
from compactionrl_fast.packing import pack
from compactionrl_fast.rollout import Rollout, Segment, run_rollouts

from .helpers import FixedEngine, ListEnv

TOK = memory_tokenizer()


def test_pack_rejects_what_is_not_a_rollout():
    with pytest.raises(TypeError, match=r"rollouts\[0\] must be a Rollout record .*got dict"):
        pack([{"segments": []}])
    with pytest.raises(TypeError, match="rollouts must be a list of Rollout records, got Rollout"):
        pack(Rollout())
    with pytest.raises(TypeError, match="rollouts must be a list of Rollout records, got dict"):
        pack({"a": 1})


def test_pack_rejects_an_unknown_segment_kind():
    ok = Segment("exec", [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0])
    bad = Segment("thinking", [1, 2], [False, True], [0.0, -1.0])
    with pytest.raises(ValueError, match=r"rollouts\[1\].segments\[1\].kind must be one of "
                                         r"\['exec', 'summary'\], got 'thinking'"):
        pack([Rollout(segments=[ok]), Rollout(segments=[ok, bad])])


def test_run_rollouts_names_a_missing_engine_tokenizer_or_env():
    envs = [ListEnv(["la"])]
    with pytest.raises(TypeError, match="engine must be an Engine .*got NoneType"):
        run_rollouts(None, envs, TOK, memory_config())
    with pytest.raises(TypeError, match="tokenizer must be .*got NoneType"):
        run_rollouts(FixedEngine(TOK), envs, None, memory_config())
    with pytest.raises(TypeError, match=r"envs\[1\] must have reset\(seed\) and step\(action\)"):
        run_rollouts(FixedEngine(TOK), [ListEnv(["la"]), object()], TOK, memory_config())
    with pytest.raises(TypeError, match="config must be a RolloutConfig, got dict"):
        run_rollouts(FixedEngine(TOK), envs, TOK, {"budget": 64})


class BrokenEnv(ListEnv):
    """Step 1 returns `ret` instead of (observation, done, reward)."""

    def __init__(self, ret):
        super().__init__(["la"] * 3)
        self.ret = ret

    def step(self, action):
        out = super().step(action)
        return self.ret if self.i == 2 else out


@pytest.mark.parametrize("ret,why", [("la", "env.step must return"), (None, "env.step must return"),
                                     (("la", False), "env.step must return"),
                                     ((3, False, 0.0), "observation must be a str"),
                                     (("la", False, "high"), "reward must be a number"),
                                     (("la", False, 0.0, ["x"]), "info must be a dict")])
def test_a_broken_step_ends_only_its_rollout(ret, why):
    envs = [ListEnv(["la"] * 3), BrokenEnv(ret), ListEnv(["lo"] * 2)]
    ros = run_rollouts(FixedEngine(TOK), envs, TOK, memory_config(error_reward=-1.0))
    assert [r.finish_reason for r in ros] == ["done", "error", "done"]
    assert ros[1].reward == -1.0 and "TypeError" in ros[1].error and why in ros[1].error
    assert len(ros[1].turns) == 2 and ros[0].reward == ros[2].reward == 1.0


def test_a_broken_reset_ends_only_its_rollout():
    class BadReset(ListEnv):
        def reset(self, seed):
            return "only one string"

    ros = run_rollouts(FixedEngine(TOK), [BadReset(["la"]), ListEnv(["la"])], TOK, memory_config())
    assert ros[0].finish_reason == "error" and "env.reset must return (system, task)" in ros[0].error
    assert ros[1].finish_reason == "done"


def test_a_budget_smaller_than_the_prompt_is_refused():
    text = TOK.apply_chat_template([{"role": "system", "content": "memory"},
                                    {"role": "user", "content": "collect digits"}], tokenize=False)
    prompt = len(TOK.encode(text, add_special_tokens=False))
    for budget in (1, prompt, prompt + 2):  # the prompt + "<assistant>" + one token + "<eos>" does not fit
        with pytest.raises(ValueError, match=f"config.budget={budget} is smaller than rollout 0's prompt"):
            run_rollouts(FixedEngine(TOK), [ListEnv(["la"])], TOK, memory_config(budget=budget, compact_threshold=1))
    cfg = memory_config(budget=prompt + 3, compact_threshold=1, max_compactions=0)
    ro = run_rollouts(FixedEngine(TOK), [ListEnv(["la"])], TOK, cfg)[0]
    assert all(len(s) <= prompt + 3 for s in ro.segments if s.kind == "exec")
    # with compactions, the context rebuilt around a full-length summary has to fit as well
    text = TOK.apply_chat_template([{"role": "system", "content": "memory"}, {"role": "user", "content":
                                    cfg.resume_template.format(task="collect digits", summary=" ".join(["la"] * 4))}],
                                   tokenize=False)
    resumed = len(TOK.encode(text, add_special_tokens=False))  # a 4-token summary
    with pytest.raises(ValueError, match=f"config.budget={resumed + 2} cannot hold rollout 0's context after"):
        run_rollouts(FixedEngine(TOK), [ListEnv(["la"])], TOK,
                     memory_config(budget=resumed + 2, compact_threshold=1, summary_max_tokens=4))
    ro = run_rollouts(FixedEngine(TOK, summary="seen 1"), [ListEnv(["la"] * 6)], TOK,
                      memory_config(budget=resumed + 3, compact_threshold=resumed - prompt, summary_max_tokens=4))[0]
    assert ro.compactions > 0 and all(len(s) <= resumed + 3 for s in ro.segments if s.kind == "exec")


def test_pack_rejects_a_segment_without_a_kind():
    class NoKind:
        input_ids, loss_mask, logprobs = [1], [False], [0.0]

    with pytest.raises(ValueError, match=r"rollouts\[0\].segments\[0\].kind must be one of .*got None"):
        pack([Rollout(segments=[NoKind()])])
