"""The whole loop for a few steps through the command line: train (SFT -> value pre-training -> PPO),
plot, and the demo's protocol on a tiny budget (results files, table, targets)."""
import json
import os

import pytest

from compactionrl_fast.app import cli, demo, runner
from compactionrl_fast.train.config_load import update

from ._tiny import tiny_train_config

TINY = ["--set", "model.hidden_size=16", "--set", "model.num_layers=1", "--set", "model.num_heads=2",
        "--set", "model.intermediate_size=32", "--set", "sft.steps=2", "--set", "sft.rollouts_per_step=2",
        "--set", "env.n_digits=3", "--set", "env.n_fillers=4", "--set", "rollout.budget=64",
        "--set", "rollout.compact_threshold=20", "--set", "rollout.max_response_tokens=6",
        "--set", "rollout.summary_max_tokens=6", "--set", "rollout.truncated_reward=-1",
        "--rollouts-per-step", "4", "--value-pretrain-steps", "1",
        "--steps", "2", "--gap-every", "2", "--threads", "0", "--progress", "false"]


def test_train_and_plot_commands(tmp_path):
    run = str(tmp_path / "run")
    assert cli.main(["train", "--run-dir", run, *TINY]) == 0
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["phase"] for r in rows] == ["value_pretrain", "ppo", "ppo"]
    for key in ("reward", "success", "compactions", "summary_tokens", "critic/value_loss", "value_explained_variance",
                "segment_factor_hist", "adv_summary1_mean", "tokens_summary_per_rollout", "time/rollout_s"):
        assert key in rows[-1], key
    for key in ("actor/policy_loss", "actor/clip_fraction", "actor/approx_kl", "actor/entropy"):
        assert key in rows[1], key
    assert "gap_abs_mean" in rows[0] and "gap_abs_mean" not in rows[1]  # every gap_every steps
    assert os.path.isfile(os.path.join(run, "checkpoint.pt"))
    _assert_training_moved_the_state(run)
    assert os.path.isfile(os.path.join(run, "actor", "config.json"))
    assert os.path.isfile(os.path.join(run, "sft", "metrics.jsonl"))
    assert cli.main(["plot", run]) == 0
    assert {"reward.png", "losses.png", "distributions.png"} <= set(os.listdir(os.path.join(run, "plots")))
    # a finished run resumes to a no-op
    assert cli.main(["train", "--run-dir", run, *TINY]) == 0
    assert len(open(os.path.join(run, "metrics.jsonl")).readlines()) == 3


def _assert_training_moved_the_state(run):
    """SFT moved the initial weights; RL moved the SFT weights; the critic's value head (zero at start) and
    both optimisers' moments are nonzero."""
    import torch

    from compactionrl_fast.train import checkpoint
    from compactionrl_fast.train.config_load import from_dict

    cfg = from_dict(json.load(open(os.path.join(run, "config.json"))))
    tok, _, _ = runner.task(cfg)
    init = runner.build(cfg, tok).state_dict()
    sft = checkpoint.load_state_dict(os.path.join(run, "sft_actor.pt"))
    final = checkpoint.read(os.path.join(run, "checkpoint.pt"))
    actor = final["models"]["actor"]
    assert init.keys() == sft.keys() == actor.keys()
    for k in init:  # every tensor gets a gradient in SFT and in PPO (tied embeddings included)
        assert not torch.equal(init[k], sft[k]), f"SFT left {k} unchanged"
        assert not torch.equal(sft[k], actor[k]), f"RL left {k} unchanged"
    critic = final["models"]["critic"]
    assert float(critic["weight"].abs().max()) > 0 and float(critic["bias"].abs().max()) > 0
    for name in ("actor", "critic"):
        state = final["optimizers"][name]["state"]
        assert state and all(float(s["exp_avg"].abs().max()) > 0 and int(s["step"]) > 0 for s in state.values())


def test_demo_protocol_writes_results(tmp_path):
    cfg = tiny_train_config(tmp_path / "runs")
    # the jobs in this process (starting worker processes is most of the time on a tiny budget): the golden
    # miniature (tests/test_demo_golden.py) runs them in worker processes, and the test below compares both ways
    res = demo.run(cfg, seeds=[0], ablation_seeds=[0], eval_rollouts=8, out_dir=str(tmp_path / "res"), name="d",
                   argv=["demo", "--tiny"], workers=1)
    for ext in ("json", "md", "png"):
        assert os.path.isfile(tmp_path / "res" / f"d.{ext}")
    r = res["runs"]["0"]
    for k in ("sft", "full", "ablation"):
        assert set(r[k]) == {"sampled", "greedy"} and 0.0 <= r[k]["sampled"]["success"] <= 1.0
    assert set(res["summary"]["targets"]) == {"sft_greedy_le_0.1", "full_ge_0.95_every_seed", "ablation_ge_0.3_below"}
    assert "| 0 | CompactionRL |" in open(tmp_path / "res" / "d.md").read()


def _numbers(run_dir):
    """Every logged metric of every run of a demo run dir, wall times and thread counts left out."""
    out = {}
    for root, _, files in sorted(os.walk(run_dir)):
        if "metrics.jsonl" in files:
            rows = [json.loads(line) for line in open(os.path.join(root, "metrics.jsonl"))]
            out[os.path.relpath(root, run_dir)] = [{k: v for k, v in r.items()
                                                    if not k.startswith(("time/", "threads"))} for r in rows]
    return out


@pytest.mark.slow
def test_demo_jobs_in_worker_processes_give_the_same_numbers(tmp_path):
    """2 seeds x (SFT, full, ablation) in this process and in 2 worker processes, 1 thread each: every
    evaluation and every logged metric bitwise equal (a job depends only on its seed and variant)."""
    got = {}
    for w in (1, 2):
        cfg = update(tiny_train_config(tmp_path / f"runs{w}"), {"threads": 1})
        res = demo.run(cfg, seeds=[0, 1], ablation_seeds=[1], eval_rollouts=8, out_dir=str(tmp_path / f"r{w}"),
                       argv=["demo"], workers=w)
        assert res["machine"]["demo_workers"] == w
        got[w] = ({s: {k: r[k] for k in ("sft", "full", "ablation") if k in r} for s, r in res["runs"].items()},
                  _numbers(cfg.run_dir))
    assert list(got[1][0]) == ["0", "1"] and "ablation" in got[1][0]["1"] and "ablation" not in got[1][0]["0"]
    assert got[1] == got[2]


def test_demo_workers_argument():
    cfg = tiny_train_config("unused")
    with pytest.raises(ValueError, match="workers"):
        demo.run(cfg, workers=0)
    with pytest.raises(ValueError, match="embedded engine"):
        demo._workers(update(cfg, {"engine": "vllm"}), 2)
    assert demo._workers(update(cfg, {"engine": "vllm"}), "auto") == 1


def test_cli_lists_the_commands(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert all(c in out for c in ("demo", "train", "plot", "bench"))
