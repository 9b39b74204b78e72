"""The job slime users launch, rollout side, on CPU (`make test-slime-job`, docs/slime.md "What ran here"):
slime's own train.py (tests/integrations/slime/job/job.py runs it) with --debug-rollout-only, --advantage-estimator
ppo, two external engines serving a tiny Llama (job_serve.py) behind sglang_router (slime launches it), our
generate on the memory task with compactions, over-sampling (one prompt in three is held by the server until
slime aborts it), an environment that fails at reset, 2 rollout steps, eval, --save-debug-rollout-data and our
rollout log functions. Then each step's saved data goes through slime's
real _convert_samples_to_train_data, the DP split at dp = 2 and compute_advantages_and_returns with our
function, against crf.segment_gae on the same rollouts.

Run only by `make test-slime-job` (CRF_SLIME_JOB=1, in build/slime-venv): it starts Ray and three processes."""
import ast
import copy
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request

import pytest
import torch

from ..conftest import skip_without_slime

skip_without_slime()
if os.environ.get("CRF_SLIME_JOB") != "1":
    pytest.skip("slime's train.py job: run by `make test-slime-job` (CRF_SLIME_JOB=1)", allow_module_level=True)

from .. import _harness as H  # noqa: E402
from .job import FAIL_AT_RESET, HOLD_EVERY  # noqa: E402

from compactionrl_fast.envs.memory import memory_config, memory_tokenizer  # noqa: E402
from compactionrl_fast.envs.models import tiny_llama  # noqa: E402
from compactionrl_fast.integrations.slime import eval_metrics, rollout_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
ROLLOUT_BATCH, STEPS = 2, 2
STATUS = {"done": "completed", "max_turns": "truncated", "context_full": "truncated", "error": "failed"}


def _write_inputs(d):
    tok = memory_tokenizer()
    tok.save_pretrained(d)
    tiny_llama(len(tok), seed=3).save_pretrained(d)
    with open(f"{d}/prompts.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"task {i}", "metadata": {"seed": i}}) + "\n")
    with open(f"{d}/eval.jsonl", "w") as f:
        for i in range(HOLD_EVERY - 1):  # none of them held
            f.write(json.dumps({"prompt": f"eval {i}", "metadata": {"seed": 100 + i}}) + "\n")
    cfg = {k: v for k, v in dataclasses.asdict(memory_config(max_turns=8, seed=5)).items() if v is not None}
    cfg["stop_token_ids"] = list(cfg.get("stop_token_ids", ()))
    with open(f"{d}/compaction.yaml", "w") as f:
        json.dump({"compaction_env": "tests.integrations.slime.job.job.make_env", "compaction_rollout": cfg}, f)


def _flags(d, ports):
    return ["--debug-rollout-only", "--rollout-external-engine-addrs", *[f"127.0.0.1:{p}" for p in ports],
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--hf-checkpoint", d,
            "--prompt-data", f"{d}/prompts.jsonl", "--input-key", "prompt",
            "--rollout-batch-size", str(ROLLOUT_BATCH), "--over-sampling-batch-size", str(HOLD_EVERY),
            "--n-samples-per-prompt", "1", "--global-batch-size", str(ROLLOUT_BATCH), "--num-rollout", str(STEPS),
            "--rollout-max-response-len", "16", "--rollout-temperature", "1.0", "--advantage-estimator", "ppo",
            "--custom-generate-function-path", "compactionrl_fast.integrations.slime.generate",
            "--custom-advantage-function-path", "compactionrl_fast.integrations.slime.compute_advantages",
            "--custom-rollout-log-function-path", "compactionrl_fast.integrations.slime.log_rollout",
            "--custom-eval-rollout-log-function-path", "compactionrl_fast.integrations.slime.log_eval_rollout",
            "--custom-config-path", f"{d}/compaction.yaml",
            "--rollout-sample-hook-path", "tests.integrations.slime.job.job.record",
            "--eval-interval", "1", "--skip-eval-before-train", "--eval-prompt-data", "mem", f"{d}/eval.jsonl",
            "--n-samples-per-eval-prompt", "1", "--save-debug-rollout-data", f"{d}/rollout_{{rollout_id}}.pt"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    import slime
    from slime.observability.rollout_data_utils import load_debug_rollout_data

    d = str(tmp_path_factory.mktemp("slime-job"))
    _write_inputs(d)
    ports = [H.free_port() for _ in range(2)]
    ray_dir = tempfile.mkdtemp(prefix="crfray")  # short: Ray's socket paths live under it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(os.path.dirname(slime.__file__))]),
               CRF_JOB_SAMPLES=f"{d}/hook.jsonl", CRF_JOB_RAY_DIR=ray_dir)
    serve = subprocess.Popen([sys.executable, "-m", "tests.integrations.slime.job.job_serve", d, *map(str, ports)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert serve.stdout.readline().strip() == "ready", "job_serve did not start"
        run = subprocess.run([sys.executable, "-m", "tests.integrations.slime.job.job", *_flags(d, ports)], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=900)
        aborted = sum(json.load(urllib.request.urlopen(f"http://127.0.0.1:{p}/server_info"))["aborted_requests"]
                      for p in ports)
    finally:
        serve.terminate()
        serve.wait()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    logs = "".join(open(f, errors="replace").read() for f in glob.glob(f"{ray_dir}/session_*/logs/worker-*"))
    shutil.rmtree(ray_dir, ignore_errors=True)
    with open(f"{d}/hook.jsonl") as f:
        hooked = [json.loads(line) for line in f]
    steps = [load_debug_rollout_data(f"{d}/rollout_{{rollout_id}}.pt", rollout_id=i) for i in range(STEPS)]
    evals = [load_debug_rollout_data(f"{d}/rollout_{{rollout_id}}.pt", rollout_id=f"eval_{i}") for i in range(STEPS)]
    return dict(dir=d, steps=steps, evals=evals, hooked=hooked, aborted=aborted, logs=logs)


def test_a_step_holds_rollouts_not_samples(job):
    seen = set()
    for i, samples in enumerate(job["steps"]):
        by = {}
        for s in samples:
            by.setdefault(s.rollout_id, []).append(s)
        assert len(by) == ROLLOUT_BATCH < len(samples), "a step holds --rollout-batch-size rollouts, all segments"
        assert not seen & set(by), "a rollout's segments in two steps"
        seen |= set(by)
        for rid, segs in by.items():
            n = max(segs[0].metadata["compaction"]["segments"], 1)  # 0: the environment failed at reset
            assert sorted(s.metadata["round_number"] for s in segs) == list(range(n))
            hooked = [h for h in job["hooked"] if h["rid"] == rid and not h["evaluation"]]
            assert len(hooked) == n and {h["rollout_id"] for h in hooked} == {i}
        assert sum(s.metadata["compaction"]["kind"] == "summary" for s in samples), "no compaction happened"


def test_statuses(job):
    saved = [s for samples in job["steps"] for s in samples]
    for s in saved:
        assert s.status.value == STATUS[s.metadata["compaction"]["finish_reason"]]
    assert "truncated" in {s.status.value for s in saved}
    assert [s.status.value for s in saved if s.index == FAIL_AT_RESET] == ["failed"]
    aborted = [h for h in job["hooked"] if h["status"] == "aborted"]
    # each step over-samples one held prompt; slime aborts it once the batch is full, and drops it
    assert [h["index"] % HOLD_EVERY for h in aborted] == [HOLD_EVERY - 1] * STEPS
    assert len(aborted) == job["aborted"]
    assert not {h["index"] for h in aborted} & {s.index for s in saved}


def test_logprobs_match_the_models_forward(job):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["dir"]).eval()
    with torch.no_grad():
        for s in [s for samples in job["steps"] for s in samples if s.response_length]:
            ids = torch.tensor(s.tokens)
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
            pos = torch.arange(len(s.tokens) - s.response_length, len(s.tokens))
            m = torch.tensor(s.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(s.rollout_log_probs)[m], logp[pos - 1, ids[pos]][m],
                                       rtol=1e-4, atol=1e-4)


def _logged(logs, label):
    pattern = re.compile(rf"log\.py:\d+ - {label} (\d+): (\{{.*\}})")
    return {int(m.group(1)): ast.literal_eval(m.group(2)) for m in pattern.finditer(logs)}


def test_the_log_shows_the_recipes_numbers(job):
    assert "Router launched at" in job["logs"], "slime launches sglang_router itself"
    train, evals = _logged(job["logs"], "compaction"), _logged(job["logs"], "compaction eval")
    assert sorted(train) == sorted(evals) == list(range(STEPS))
    for i in range(STEPS):
        assert train[i] == pytest.approx(rollout_metrics(job["steps"][i]))
        assert train[i]["compaction/rollouts"] == ROLLOUT_BATCH and train[i]["compaction/segments_per_rollout"] > 1
        assert evals[i] == pytest.approx(eval_metrics({"mem": {"samples": job["evals"][i]}}))
        assert evals[i]["eval/mem/compaction/rollouts"] == HOLD_EVERY - 1


def _oracle_rollouts(samples):
    """Rollout records rebuilt from the Samples (each with a response), and copies of the Samples whose
    rollout_id is the record's position (what H.expected reads)."""
    from compactionrl_fast.rollout.records import Rollout, Segment

    rids = sorted({s.rollout_id for s in samples})
    rollouts = []
    for rid in rids:
        segs = sorted((s for s in samples if s.rollout_id == rid), key=lambda s: s.metadata["round_number"])
        rollouts.append(Rollout(segments=[Segment(s.metadata["compaction"]["kind"], s.tokens,
                                                  [False] * (len(s.tokens) - s.response_length) +
                                                  [bool(m) for m in s.loss_mask], [0.0] * len(s.tokens))
                                          for s in segs], reward=segs[0].reward))
    relabeled = []
    for s in samples:
        c = copy.copy(s)
        c.rollout_id = rids.index(s.rollout_id)
        relabeled.append(c)
    return rollouts, relabeled


@pytest.mark.parametrize("step", range(STEPS))
def test_advantages_through_slime_at_dp2(job, step):
    samples = job["steps"][step]
    inputs = H.token_inputs(samples, seed=step)
    # first-fit micro-batches of at most 128 tokens (the rollouts' budget): a rollout's segments on both ranks
    res = H.spawn(2, 1, samples, inputs, dict(kl_coef=0.05, use_dynamic_batch_size=True, max_tokens_per_gpu=128,
                                              compaction_untrainable="allow"))  # the sample failed at reset
    assert all("error" not in r for r in res), res
    assert H.split_rollouts([out["partition"] for out in res], samples), "the DP split must put a rollout on both ranks"
    kept = [p for p, s in enumerate(samples) if s.response_length]
    rollouts, relabeled = _oracle_rollouts([samples[p] for p in kept])
    exp = dict(zip(kept, H.expected(rollouts, relabeled, [inputs[p] for p in kept], kl_coef=0.05, gamma=1.0,
                                    lam="adaptive")))  # crf.segment_gae on the packed Rollout records
    seen = []
    for out in res:
        for i, p in enumerate(out["partition"]):
            seen.append(p)
            want = exp.get(p, (torch.zeros(0, dtype=torch.float64),) * 2)
            torch.testing.assert_close(out["advantages"][i].double(), want[0], rtol=0, atol=1e-6)
            torch.testing.assert_close(out["returns"][i].double(), want[1], rtol=0, atol=1e-6)
    assert sorted(seen) == list(range(len(samples)))
