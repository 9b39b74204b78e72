"""A seeded miniature of the demo (SFT -> CompactionRL -> ablation -> evaluation) against golden numbers.

The miniature keeps the demo's model and recipe (`demo_config`) and shrinks the budget: 150 SFT steps
on an expert that does not drop digits, 1 value pre-training step and 3 PPO steps of 32 rollouts, 32
evaluation tasks, on a 1-digit memory task with budget 64 (every episode compacts once, so the digit
reaches the answer only through the summary; 15-22% of the rollouts succeed, so advantages, losses and
gradients are not all zero). Its metrics (every logged
scalar of every step, and the evaluations) are compared with tests/golden/demo_mini.json, so a change
that alters the demo's numbers shows up in review as a change of that file.

After an intended change of the numbers, regenerate the file and commit it with the change:

    python -m tests.test_demo_golden --update

The comparison allows a relative difference of 1e-6 (other CPUs may round a matmul differently);
the same machine must reproduce the numbers bitwise at 1 and at 2 threads (the second test; two
diagnostics that read the sampler's log-probs are compared absolutely there, see SAMPLER_DIAGNOSTICS).
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "demo_mini.json")
MINI_ARGS = ["--progress", "false", "--steps", "3", "--value-pretrain-steps", "1", "--rollouts-per-step", "32",
             "--eval-rollouts", "32", "--gap-every", "2", "--set", "sft.steps=150", "--set", "sft.rollouts_per_step=16",
             "--set", "sft.expert_drop_p=0", "--set", "env.n_digits=1", "--set", "rollout.budget=64"]
# logged keys that are not numbers of the method: wall times and the thread count
SKIP = ("time/", "threads")
REL_TOL = 1e-6


def run_mini(run_dir: str, threads: int = 1) -> dict:
    """Run the miniature through the CLI into `run_dir`; return its metrics (see `collect`)."""
    from compactionrl_fast import cli

    assert cli.main(["demo", "--run-dir", run_dir, "--threads", str(threads), *MINI_ARGS]) == 0
    return collect(run_dir)


def collect(run_dir: str) -> dict:
    """{"eval": the evaluations per seed and model, "<run>": {"<step>": {metric: value}}} of a demo run dir."""
    with open(os.path.join(run_dir, "demo_cpu.json")) as f:
        res = json.load(f)
    out = {"eval": {seed: {k: r[k] for k in ("sft", "full", "ablation") if k in r} for seed, r in res["runs"].items()}}
    for seed in res["runs"]:
        for part in ("sft", "full", "ablation"):
            path = os.path.join(run_dir, f"seed{seed}", part, "metrics.jsonl")
            if not os.path.isfile(path):
                continue
            rows = {}
            for line in open(path):
                row = json.loads(line)
                rows[str(row["step"])] = {k: v for k, v in sorted(row.items())
                                          if k != "step" and not k.startswith(SKIP)}
            out[f"seed{seed}/{part}"] = rows
    return out


def differences(got, want, path="", rel_tol=0.0) -> list:
    """Human-readable differences between two nested structures of numbers, strings, lists and dicts."""
    if isinstance(want, dict) and isinstance(got, dict):
        diffs = [f"{path}/{k}: missing" for k in want if k not in got]
        diffs += [f"{path}/{k}: unexpected" for k in got if k not in want]
        for k in want:
            if k in got:
                diffs += differences(got[k], want[k], f"{path}/{k}", rel_tol)
        return diffs
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]", rel_tol)]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        ok = got == want if rel_tol == 0 else math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-12)
        return [] if ok else [f"{path}: {got!r} != {want!r}"]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


@pytest.fixture(scope="module")
def mini_1thread(tmp_path_factory):
    return run_mini(str(tmp_path_factory.mktemp("mini1")), threads=1)


def test_demo_miniature_matches_golden(mini_1thread):
    with open(GOLDEN) as f:
        golden = json.load(f)
    diffs = differences(mini_1thread, golden["metrics"], rel_tol=REL_TOL)
    assert not diffs, (f"{len(diffs)} metrics of the demo miniature differ from {GOLDEN} (if the change is "
                       "intended: python -m tests.test_demo_golden --update):\n" + "\n".join(diffs[:20]))
    # the miniature is not degenerate: the RL math sees rewards
    rewards = [row["reward"] for row in mini_1thread["seed0/full"].values()]
    assert any(r > 0 for r in rewards)


def _without(metrics: dict, keys) -> dict:
    return {run: {step: {k: v for k, v in row.items() if k not in keys} for step, row in rows.items()}
            if run != "eval" else rows for run, rows in metrics.items()}


# diagnostics that read the sampler's log-probs, with the absolute difference allowed between 1 and 2 threads
SAMPLER_DIAGNOSTICS = {
    "actor/rollout_kl": 1e-9,  # mean of ~1e-5 per token; seen: 3e-11
    "actor/rollout_logp_absdiff_max": 1e-5,  # max |trainer - sampler| log-prob: a few float32 ulps of a log-prob
                                             # of a few nats; seen: 2.4e-7
}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_demo_miniature_bitwise_at_2_threads(mini_1thread, tmp_path):
    # The sampler's forward (with a KV cache) reduces in another order at 2 threads, so its log-probs differ
    # in their last bits, and with them the diagnostics comparing them to the trainer's (SAMPLER_DIAGNOSTICS).
    # Every training number, the sampled tokens and the evaluations are equal. Those diagnostics are
    # differences of two nearly equal log-probs: compared absolutely, at float32 log-prob resolution.
    got = run_mini(str(tmp_path / "mini2"), threads=2)
    diffs = differences(_without(got, SAMPLER_DIAGNOSTICS), _without(mini_1thread, SAMPLER_DIAGNOSTICS))
    for run, rows in got.items():
        for step, row in rows.items() if run != "eval" else ():
            for key, tol in SAMPLER_DIAGNOSTICS.items():
                a, b = row.get(key), mini_1thread[run][step].get(key)
                if (a is None) != (b is None) or (a is not None and not abs(a - b) <= tol):
                    diffs.append(f"/{run}/{step}/{key}: {a!r} != {b!r}")
    assert not diffs, "1 and 2 threads differ:\n" + "\n".join(diffs[:20])


def main(argv) -> int:
    if argv != ["--update"]:
        print(__doc__)
        return 2
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        metrics = run_mini(d, threads=1)
    from compactionrl_fast.demo import versions

    v = versions()
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
        json.dump({"command": "python -m compactionrl_fast demo --threads 1 " + " ".join(MINI_ARGS),
                   "regenerate": "python -m tests.test_demo_golden --update",
                   "versions": {"python": v["python"], "torch": v["torch"],
                                **{k: v["packages"].get(k) for k in ("numpy", "transformers", "tokenizers")}},
                   "metrics": metrics}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
