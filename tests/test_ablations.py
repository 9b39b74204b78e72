"""The ablations command: its statistics, and a tiny run that writes the table and the figure."""
import json
import math

import pytest

from compactionrl_fast.app import ablations

from .train._tiny import tiny_train_config


def test_interval_matches_the_t_interval():
    s = ablations.interval([0.0, 1.0, 2.0])
    half = 4.303 * 1.0 / math.sqrt(3)  # t(0.975, 2 dof) * sd / sqrt(n)
    assert s["mean"] == 1.0 and s["std"] == 1.0
    assert s["ci95"] == pytest.approx([1.0 - half, 1.0 + half])
    assert ablations.interval([0.5]) == {"n": 1, "mean": 0.5, "std": None, "ci95": None}
    with pytest.raises(ValueError, match="at least one"):
        ablations.interval([])


def test_unknown_variant_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown variants"):
        ablations.run(tiny_train_config(tmp_path), seeds=[0], variants=["full", "nope"])


@pytest.mark.slow
def test_tiny_ablations_write_table_and_figure(tmp_path):
    cfg = tiny_train_config(tmp_path / "abl", eval_rollouts=4)
    res = ablations.run(cfg, seeds=[0, 1], variants=["full", "no-cross-segment"], name="t")
    for ext in ("json", "md", "png"):
        assert (tmp_path / "abl" / f"t.{ext}").is_file()
    summary = json.load(open(tmp_path / "abl" / "t.json"))["summary"]
    full = [res["runs"][s]["full"]["sampled"]["success"] for s in ("0", "1")]
    assert summary["full"]["sampled"]["mean"] == pytest.approx(sum(full) / 2)
    assert "diff_to_full" in summary["no-cross-segment"]["sampled"]
    md = open(tmp_path / "abl" / "t.md").read()
    assert "| no-cross-segment |" in md and "95% t-interval" in md
