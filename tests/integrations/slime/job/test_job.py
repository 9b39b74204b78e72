"""The job slime users launch, rollout side, on CPU (`make test-slime-job`, docs/slime.md "What ran here"):
slime's own train.py (tests/integrations/slime/job/job.py runs it) with --debug-rollout-only, --advantage-estimator
ppo, two external engines serving the memory task's SFT model (job_serve.py; `sft_checkpoint`, cached in
build/sft-memory, shared with the verl job: it answers about a third of the digits right) behind sglang_router
(slime launches it), our generate on the memory task with partial credit (MemoryEnv(reward="accuracy"): rewards
that vary) and compactions, --rollout-stop-token-ids, over-sampling (one prompt in five is held by the server
until slime aborts it), an environment that fails at reset, one eval prompt that never ends, 2 rollout steps of 4
rollouts, eval, --save-debug-rollout-data and our rollout log functions.

Checked with this test's own code, not the plug-in's: every request the engines got carried slime's stop token;
each rollout, rebuilt from slime's saved rollout data, is whole and in order (each summary generated from the
window before it and resumed in the window after it; as many responses as the environment took steps), its
reward the one the environment recorded itself; then each step's saved data through slime's real
_convert_samples_to_train_data, the DP split at dp = 2 (a rollout on both ranks) and
compute_advantages_and_returns with our function equals the float64 reference (the rewards placed by this test,
`reference.gae.segment_gae`), paper and stitched.

Run only by `make test-slime-job` (CRF_SLIME_JOB=1, in build/slime-venv): it starts Ray and three processes."""
import argparse
import ast
import collections
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request

import pytest
import torch

from ..conftest import skip_without_slime

skip_without_slime()
if os.environ.get("CRF_SLIME_JOB") != "1":
    pytest.skip("slime's train.py job: run by `make test-slime-job` (CRF_SLIME_JOB=1)", allow_module_level=True)

from .. import _harness as H  # noqa: E402
from .job import EVAL_ENDLESS, FAIL_AT_RESET, HOLD_EVERY  # noqa: E402

from compactionrl_fast.app.jobs import ray_folder  # noqa: E402
from compactionrl_fast.envs.memory import memory_config, memory_tokenizer  # noqa: E402
from compactionrl_fast.integrations.slime import eval_metrics, rollout_metrics  # noqa: E402
from compactionrl_fast.reference import gae as ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
SFT_CACHE = os.path.join(REPO, "build", "sft-memory")  # shared with the verl job
ROLLOUT_BATCH, STEPS = 4, 2
N_EVAL = 3  # eval prompts (index < HOLD_EVERY - 1: none of them held): seeds 100, 101, 102 (EVAL_ENDLESS)
STATUS = {"done": "completed", "max_turns": "truncated", "context_full": "truncated", "error": "failed"}
TOK = memory_tokenizer()
EOS = TOK.eos_token_id
STOP = TOK.convert_tokens_to_ids("la")  # --rollout-stop-token-ids: a word no response of the task needs
WORD = {w: TOK.convert_tokens_to_ids(w) for w in ("summarize", "resume", "collect")}
KL_COEF = 0.05
# compaction_rollout.seed: the engines sample each request with its seed, so the job's rollouts are the same on
# every run from the same SFT weights; with this one (on the 2-core Xeon the job was written on) every played
# rollout scores > 0, 1/6 to 2/3, and each step's rewards differ
ROLLOUT_SEED = 2
GAE = dict(gamma=1.0, lam="adaptive", lam_critic=1.0, adaptive_alpha=1.5, adaptive_length="rollout")  # the defaults


def _write_inputs(d):
    from compactionrl_fast.app.export import sft_checkpoint

    shutil.copytree(sft_checkpoint(SFT_CACHE), d, dirs_exist_ok=True)
    with open(f"{d}/prompts.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"task {i}", "metadata": {"seed": i}}) + "\n")
    with open(f"{d}/eval.jsonl", "w") as f:
        for i in range(N_EVAL):
            f.write(json.dumps({"prompt": f"eval {i}", "metadata": {"seed": 100 + i}}) + "\n")
    assert EVAL_ENDLESS in range(100, 100 + N_EVAL)
    cfg = {k: v for k, v in dataclasses.asdict(memory_config(seed=ROLLOUT_SEED)).items() if v is not None}
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
            "--rollout-stop-token-ids", str(STOP),
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
    with ray_folder() as ray_dir:  # the job's own Ray: whatever it leaves running is killed by this path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(os.path.dirname(slime.__file__))]),
                   CRF_JOB_SAMPLES=f"{d}/hook.jsonl", CRF_JOB_REWARDS=f"{d}/rewards.jsonl",
                   CRF_JOB_ARGS=f"{d}/args.json", CRF_JOB_RAY_DIR=ray_dir)
        serve = subprocess.Popen([sys.executable, "-m", "tests.integrations.slime.job.job_serve", d,
                                  *map(str, ports)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert serve.stdout.readline().strip() == "ready", "job_serve did not start"
            run = subprocess.run([sys.executable, "-m", "tests.integrations.slime.job.job", *_flags(d, ports)],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            served = [json.load(urllib.request.urlopen(f"http://127.0.0.1:{p}/server_info")) for p in ports]
        finally:
            serve.terminate()
            serve.wait()
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        logs = "".join(open(f, errors="replace").read() for f in glob.glob(f"{ray_dir}/session_*/logs/worker-*"))

    def lines(name):
        with open(f"{d}/{name}") as f:
            return [json.loads(line) for line in f]

    with open(f"{d}/args.json") as f:
        args = argparse.Namespace(**json.load(f))
    steps = [load_debug_rollout_data(f"{d}/rollout_{{rollout_id}}.pt", rollout_id=i) for i in range(STEPS)]
    evals = [load_debug_rollout_data(f"{d}/rollout_{{rollout_id}}.pt", rollout_id=f"eval_{i}") for i in range(STEPS)]
    return dict(dir=d, steps=steps, evals=evals, hooked=lines("hook.jsonl"), env=lines("rewards.jsonl"), args=args,
                served=served, aborted=sum(s["aborted_requests"] for s in served), logs=logs)


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
    evals = [s for samples in job["evals"] for s in samples]
    for s in saved + evals:
        assert s.status.value == STATUS[s.metadata["compaction"]["finish_reason"]]
    assert [s.status.value for s in saved if s.index == FAIL_AT_RESET] == ["failed"]
    # the eval prompt whose environment never ends is cut by the loop (TRUNCATED) in every eval, the others end
    assert sorted((s.metadata["seed"], s.status.value) for s in evals) == sorted(
        (seed, "truncated" if seed == EVAL_ENDLESS else "completed") for seed in range(100, 100 + N_EVAL)
        for _ in range(STEPS))
    aborted = [h for h in job["hooked"] if h["status"] == "aborted"]
    # each step over-samples one held prompt; slime aborts it once the batch is full, and drops it
    assert [h["index"] % HOLD_EVERY for h in aborted] == [HOLD_EVERY - 1] * STEPS
    assert len(aborted) == job["aborted"]
    assert not {h["index"] for h in aborted} & {s.index for s in saved}


def test_the_engines_serve_the_sft_model_and_logprobs_match_its_forward(job):
    from transformers import AutoModelForCausalLM

    for served in job["served"]:  # the demo's architecture, loaded by job_serve from --hf-checkpoint
        assert served["crf_model"] == dict(architecture="LlamaForCausalLM", hidden_size=64, num_attention_heads=2,
                                           num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(job["dir"]).eval()
    with torch.no_grad():
        for s in [s for samples in job["steps"] for s in samples if s.response_length]:
            ids = torch.tensor(s.tokens)
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
            pos = torch.arange(len(s.tokens) - s.response_length, len(s.tokens))
            m = torch.tensor(s.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(s.rollout_log_probs)[m], logp[pos - 1, ids[pos]][m],
                                       rtol=1e-4, atol=1e-4)


def test_slimes_stop_token_reaches_every_request(job):
    """--rollout-stop-token-ids: every /generate request the engines got (train, eval, held ones) asks to stop at
    slime's stop token as well as at the end of turn, and no response of the saved data goes on past it."""
    assert job["args"].rollout_stop_token_ids == [STOP]
    sent = [(set(ids), n) for served in job["served"] for ids, n in served["crf_stop_token_ids"]]
    assert sum(n for _, n in sent) > 0
    assert all({STOP, EOS} <= ids for ids, _ in sent), sent
    for s in [s for samples in job["steps"] for s in samples]:
        for run in _runs(s):
            assert STOP not in run[:-1], run


def _logged(logs, label):
    pattern = re.compile(rf"log\.py:\d+ - {label} (\d+): (\{{.*\}})")
    return {int(m.group(1)): ast.literal_eval(m.group(2)) for m in pattern.finditer(logs)}


def test_the_log_shows_the_recipes_numbers(job):
    """The `compaction` log lines equal rollout_metrics (with slime's own arguments: the cross-segment scale) and
    eval_metrics of the saved data, and the counts read here from the samples themselves."""
    assert "Router launched at" in job["logs"], "slime launches sglang_router itself"
    train, evals = _logged(job["logs"], "compaction"), _logged(job["logs"], "compaction eval")
    assert sorted(train) == sorted(evals) == list(range(STEPS))
    for i in range(STEPS):
        want = rollout_metrics(job["steps"][i], job["args"])
        assert "compaction/cross_segment_scale/mean" in want and train[i] == pytest.approx(want)
        per_rollout = collections.Counter()  # a failed reset's sample is a rollout with no segment
        for s in job["steps"][i]:
            per_rollout[s.rollout_id] += s.metadata["compaction"]["kind"] is not None
        assert train[i]["compaction/segments_per_rollout/mean"] == pytest.approx(
            sum(per_rollout.values()) / len(per_rollout))
        want = eval_metrics({"mem": {"samples": job["evals"][i]}})
        assert want and evals[i] == pytest.approx(want)


# ---- this test's own reading of the saved rollouts (not the plug-in's grouping helpers) ----

def _runs(s):
    """The runs of consecutive trainable tokens of a Sample's response (one per response of the policy)."""
    out, cur = [], []
    for t, m in zip(s.tokens[len(s.tokens) - s.response_length:], s.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


def _contains(seq, part):
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def _prompt(s):
    return s.tokens[:len(s.tokens) - s.response_length]


def _played_order(segs):
    """A rollout's segments (Samples, in any order) in the order the episode played them, found from their tokens
    alone: the execution window that starts from the task (no resume), then alternately the summary generated
    from the window before it (its prompt: that whole window, then the summary request) and the window resumed
    from that summary (its prompt holds "resume" + the summary's words + the end of that message); exactly one
    candidate at each step, no segment left over, and the last one a window."""
    rest = list(segs)
    first = [s for s in rest if WORD["resume"] not in _prompt(s) and WORD["summarize"] not in _prompt(s)]
    assert len(first) == 1 and WORD["collect"] in _prompt(first[0]), "not one window starting from the task"
    order = [first[0]]
    rest.remove(first[0])
    while rest:
        cur = order[-1]
        if len(order) % 2:  # after a window: its summary
            nxt = [s for s in rest if s.tokens[:len(cur.tokens)] == cur.tokens
                   and WORD["summarize"] in _prompt(s)[len(cur.tokens):]]
            what = f"the summary of segment {len(order) - 1}"
        else:  # after a summary: the window resumed from it
            [words] = _runs(cur)
            words = words[:-1] if words[-1] in (EOS, STOP) else words
            nxt = [s for s in rest if WORD["summarize"] not in _prompt(s)
                   and _contains(_prompt(s), [WORD["resume"], *words, EOS])]
            what = f"the window resumed from summary {len(order) - 1}"
        assert len(nxt) == 1, f"{len(nxt)} segments are {what} ({len(order)} of {len(segs)} placed)"
        order.append(nxt[0])
        rest.remove(nxt[0])
    assert len(order) % 2 == 1, f"{len(order)} segments: a rollout ends with an execution window"
    return order


def _rollouts(samples):
    """[(rollout_id, [position of each segment in `samples`, in the order played])] of the samples with a
    response: grouped by Sample.rollout_id, ordered by their tokens (_played_order), not by the plug-in's labels."""
    by = {}
    for p, s in enumerate(samples):
        if s.response_length:
            by.setdefault(s.rollout_id, []).append(p)
    out = []
    for rid, ps in sorted(by.items()):
        order = _played_order([samples[p] for p in ps])
        out.append((rid, [next(p for p in ps if samples[p] is s) for s in order]))
    return out


def _env_records(job):
    """reset seed -> the environment's own record of the episode (each seed ends once in the training steps)."""
    out = {}
    for row in job["env"]:
        if row["seed"] < 100:
            assert row["seed"] not in out, row
            out[row["seed"]] = row
    return out


@pytest.mark.parametrize("step", range(STEPS))
def test_rollouts_are_whole_in_order_and_carry_the_environments_reward(job, step):
    """Each rollout of the step, rebuilt from slime's saved data: whole and in the order played (_played_order,
    which the segment indices follow), as many responses as its environment took steps, its final action the
    environment's last; every segment's reward the one the environment recorded; the step's rewards not all 0
    and not all equal."""
    samples, env = job["steps"][step], _env_records(job)
    rewards = []
    for rid, ps in _rollouts(samples):
        segs = [samples[p] for p in ps]
        # the plug-in's segment indices (what compute_advantages orders by) follow the order played
        assert [s.metadata["round_number"] for s in segs] == list(range(len(segs))), rid
        responses = sum(len(_runs(w)) for w in segs[0::2])  # one run of trainable tokens per response
        seed = segs[0].metadata["seed"]
        assert {s.metadata["seed"] for s in segs} == {seed} and {s.index for s in segs} == {seed}, rid
        assert seed in env, f"rollout {rid} (seed {seed}): its environment never ended the episode"
        rec = env[seed]
        assert rec["index"] == segs[0].index and responses == rec["steps"], (rid, responses, rec)
        last = _runs(segs[-1])[-1]
        action = TOK.decode(last[:-1] if last[-1] in (EOS, STOP) else last, skip_special_tokens=True)
        assert action == rec["action"], (rid, action, rec)
        assert [s.reward for s in segs] == [rec["reward"]] * len(segs), (rid, rec)
        rewards.append(rec["reward"])
    assert len(rewards) >= 2 and max(rewards) > 0 and len(set(rewards)) > 1, rewards
    failed = [s for s in samples if not s.response_length]
    assert [s.index for s in failed] == ([FAIL_AT_RESET] if step == 1 else [])


CASES = [(mode, kl) for mode in ("paper", "stitched") for kl in (0.0, KL_COEF)]


@pytest.fixture(scope="module")
def through_slime(job):
    """Each step's saved data, with random values and log-probs, through slime's data path at dp = 2 and
    compute_advantages_and_returns with our function, for every (cross-segment mode, kl_coef) of CASES: one
    process group of 2 ranks for all. {(step, mode, kl): (inputs, [rank 0's result, rank 1's])}."""
    keys, cases = [], []
    for step, samples in enumerate(job["steps"]):
        inputs = H.token_inputs(samples, seed=step)
        for mode, kl in CASES:
            keys.append((step, mode, kl))
            # first-fit micro-batches of at most 256 tokens (about two segments; the budget is 128) dealt to the
            # ranks in turn: a rollout's segments on both ranks; the sample whose environment failed at reset has
            # no token to train
            cases.append((samples, inputs, dict(kl_coef=kl, use_dynamic_batch_size=True, max_tokens_per_gpu=256,
                                                compaction_cross_segment=mode, compaction_untrainable="allow")))
    return {k: (c[1], res) for k, c, res in zip(keys, cases, H.spawn_cases(2, cases))}


def _reference(samples, inputs, rollouts, reward_of, mode, kl_coef):
    """float64 (advantages, returns) per sample position by the reference: the rollout's reward placed by this
    test once on each segment's last trainable token (paper) or on the rollout's last (stitched), minus
    kl_coef * KL on every token as slime's ppo estimator does, then `reference.gae.segment_gae`."""
    order = [p for _, ps in rollouts for p in ps]
    masks = [torch.tensor(samples[p].loss_mask, dtype=torch.bool) for p in order]
    cu_seq = torch.tensor([0] + [len(m) for m in masks]).cumsum(0)
    cu_seg = torch.tensor([0] + [len(ps) for _, ps in rollouts]).cumsum(0)
    mask = torch.cat(masks)
    rewards = torch.zeros(len(mask), dtype=torch.float64)
    for r, (rid, ps) in enumerate(rollouts):
        lasts = [int(cu_seq[s]) + int(masks[s].nonzero()[-1]) for s in range(int(cu_seg[r]), int(cu_seg[r + 1]))]
        for q in (lasts if mode == "paper" else lasts[-1:]):
            rewards[q] += reward_of(rid)
    rr = torch.tensor([reward_of(rid) for rid, _ in rollouts], dtype=torch.float64)
    assert torch.equal(rewards, ref.place_final_rewards(rr, mask, cu_seq, cu_seg, mode=mode))
    assert int((rewards != 0).sum()) == sum(len(ps) if mode == "paper" else 1 for rid, ps in rollouts
                                            if reward_of(rid) != 0)
    values = torch.cat([inputs[p][0] for p in order]).double()
    kl = torch.cat([inputs[p][1] - inputs[p][2] for p in order]).double()
    adv, ret = ref.segment_gae(rewards - kl_coef * kl, values, mask, cu_seq, cu_seg, cross_segment=mode, **GAE)
    return {p: (adv[a:b], ret[a:b]) for p, a, b in zip(order, cu_seq[:-1].tolist(), cu_seq[1:].tolist())}


@pytest.mark.parametrize("mode,kl_coef", CASES)
@pytest.mark.parametrize("step", range(STEPS))
def test_advantages_through_slime_at_dp2_equal_the_float64_reference(job, through_slime, step, mode, kl_coef):
    """slime's data path and compute_advantages_and_returns with our function at dp = 2 (a rollout's segments on
    both ranks) on the step's saved data: the rewards slime carried are the environment's, and advantages and
    returns equal the float64 reference to 1e-5 (rollouts rebuilt by this test, rewards from the environment's
    record). Without KL, with gamma = lam_critic = 1, the returns are the reward itself on every trainable token:
    it landed exactly once per segment (once per rollout with stitched)."""
    samples = job["steps"][step]
    inputs, res = through_slime[(step, mode, kl_coef)]
    assert all("error" not in r for r in res), res
    assert H.split_rollouts([out["partition"] for out in res], samples), "the DP split must put a rollout on both ranks"
    env = _env_records(job)
    rollouts = _rollouts(samples)
    rid_seed = {rid: samples[ps[0]].metadata["seed"] for rid, ps in rollouts}
    reward_of = lambda rid: env[rid_seed[rid]]["reward"]  # noqa: E731
    want = _reference(samples, inputs, rollouts, reward_of, mode, kl_coef)
    rollout_of = {p: rid for rid, ps in rollouts for p in ps}
    seen = []
    for out in res:
        for i, p in enumerate(out["partition"]):
            seen.append(p)
            adv, ret = out["advantages"][i].double(), out["returns"][i].double()
            if p not in want:  # the sample whose environment failed at reset: nothing to train
                assert samples[p].index == FAIL_AT_RESET and adv.numel() == ret.numel() == 0
                continue
            R = reward_of(rollout_of[p])
            assert float(out["rewards"][i]) == R, (p, out["rewards"][i], R)
            torch.testing.assert_close(adv, want[p][0], rtol=0, atol=1e-5)
            torch.testing.assert_close(ret, want[p][1], rtol=0, atol=1e-5)
            m = torch.tensor(samples[p].loss_mask, dtype=torch.bool)
            assert adv[m].abs().max() > 0 and not adv[~m].any() and not ret[~m].any()
            if kl_coef == 0:
                torch.testing.assert_close(ret[m], torch.full_like(ret[m], R), rtol=0, atol=1e-6)
    assert sorted(seen) == list(range(len(samples)))
