"""The demo's verdict and files (compactionrl_fast/app/results.py) on hand-made results dicts shaped like a demo
run's: each target met at its threshold and missed just past it, which runs and which mode (T=1 / greedy) each
target reads, the mean over 3+ seeds, the "met" / "MISSED" line, and what NAME.json / NAME.md / NAME.png hold."""
from __future__ import annotations

import json
import os

import pytest

from compactionrl_fast.app import results as R


def ev(sampled, greedy, accuracy=0.5, recall=0.25):
    """One evaluation as runner.evaluate_success returns it (the keys results.py reads)."""
    return {"sampled": {"success": sampled, "reward": sampled, "accuracy": accuracy, "summary_recall": recall},
            "greedy": {"success": greedy, "reward": greedy, "accuracy": accuracy, "summary_recall": recall}}


def demo(*seeds):
    """A results dict; each seed: (sft greedy, full T=1, ablation T=1 or None). The other mode of each model is
    set to a value that would flip the verdict if a target read it."""
    runs = {}
    for i, (sft_g, full, abl) in enumerate(seeds):
        r = {"sft": ev(0.9, sft_g), "full": ev(full, 0.0)}
        if abl is not None:
            r["ablation"] = ev(abl, 1.0)
        runs[str(i)] = r
    return {"runs": runs}


def targets(*seeds):
    return R.summary(demo(*seeds))["targets"]


SFT, FULL, ABL, MEAN = "sft_greedy_le_0.1", "full_ge_0.95_every_seed", "ablation_ge_0.3_below", "full_mean_ge_0.97"


def test_target_names_and_thresholds_are_the_documented_ones():
    assert (R.SFT_GREEDY_MAX, R.FULL_MIN, R.ABLATION_GAP, R.FULL_MEAN_MIN, R.MEAN_MIN_SEEDS) == (0.1, 0.95, 0.3,
                                                                                                 0.97, 3)
    assert list(targets((0.0, 1.0, 0.0))) == [SFT, FULL, ABL]
    assert list(targets((0.0, 1.0, 0.0), (0.0, 1.0, None), (0.0, 1.0, None))) == [SFT, FULL, ABL, MEAN]


def test_the_lists_it_reports():
    s = R.summary(demo((0.0625, 0.96875, 0.5), (0.09375, 0.953125, None), (0.03125, 1.0, 0.125)))
    assert s["full_success"] == [0.96875, 0.953125, 1.0]  # T=1, every seed
    assert s["sft_greedy_success"] == [0.0625, 0.09375, 0.03125]  # greedy, every seed
    assert s["ablation_gap"] == [0.96875 - 0.5, 1.0 - 0.125]  # full minus ablation, the seeds with an ablation


@pytest.mark.parametrize("sft_g,met", [(0.0, True), (0.1, True), (0.10009765625, False), (0.5, False)])
def test_sft_greedy_at_most_0_1(sft_g, met):
    assert targets((sft_g, 1.0, 0.0))[SFT] is met
    # every seed counts
    assert targets((0.0, 1.0, 0.0), (sft_g, 1.0, None))[SFT] is met
    assert targets((sft_g, 1.0, 0.0), (0.0, 1.0, None))[SFT] is met


@pytest.mark.parametrize("full,met", [(1.0, True), (0.95, True), (0.949951171875, False), (0.5, False)])
def test_full_at_least_0_95_on_every_seed(full, met):
    assert targets((0.0, full, None))[FULL] is met
    assert targets((0.0, 1.0, None), (0.0, full, None))[FULL] is met
    assert targets((0.0, full, None), (0.0, 1.0, None))[FULL] is met


def test_full_target_missed_without_a_full_run():
    res = demo((0.0, 1.0, 0.0))
    del res["runs"]["0"]["full"], res["runs"]["0"]["ablation"]
    s = R.summary(res)
    assert s["full_success"] == [] and s["ablation_gap"] == []
    assert s["targets"] == {SFT: True, FULL: False, ABL: False}


@pytest.mark.parametrize("full,abl,met", [(1.0, 0.0, True), (0.5, 0.2, True), (0.5, 0.20001, False),
                                          (0.96875, 0.96875, False), (0.0, 0.5, False)])
def test_ablation_at_least_0_3_below_full(full, abl, met):
    assert (0.5 - 0.2) == R.ABLATION_GAP  # the gap sits exactly on the threshold in floats
    assert targets((0.0, full, abl))[ABL] is met
    assert targets((0.0, 1.0, 0.0), (0.0, full, abl))[ABL] is met
    assert targets((0.0, full, abl), (0.0, 1.0, 0.0))[ABL] is met
    assert targets((0.0, full, abl), (0.0, 0.0, None))[ABL] is met  # a seed without an ablation is not counted


def test_thresholds_hold_against_float_rounding():
    # on each threshold in exact arithmetic, past it by rounding: met; past it by 1e-6 (far below any 1 / n): missed
    assert 0.95 - 0.65 < R.ABLATION_GAP and sum((0.95, 0.963, 0.997)) / 3 < R.FULL_MEAN_MIN
    assert targets((0.0, 0.95, 0.65))[ABL] is True
    assert targets((0.0, 0.95, 0.65 + 1e-6))[ABL] is False
    assert targets((0.0, 0.95, None), (0.0, 0.963, None), (0.0, 0.997, None))[MEAN] is True
    assert targets((0.0, 0.95, None), (0.0, 0.963, None), (0.0, 0.997 - 3e-6, None))[MEAN] is False
    for x, met in ((0.95 - 1e-12, True), (0.95 - 1e-6, False)):
        assert targets((0.0, x, None))[FULL] is met
    for x, met in ((0.1 + 1e-12, True), (0.1 + 1e-6, False)):
        assert targets((x, 1.0, None))[SFT] is met


def test_ablation_target_missed_without_an_ablation():
    assert targets((0.0, 1.0, None), (0.0, 1.0, None))[ABL] is False


def test_mean_target_from_3_seeds_only():
    assert MEAN not in targets((0.0, 1.0, 0.0), (0.0, 1.0, None))
    assert MEAN in targets((0.0, 1.0, 0.0), (0.0, 1.0, None), (0.0, 1.0, None))
    assert MEAN in targets(*[(0.0, 1.0, None)] * 5)


@pytest.mark.parametrize("full,met", [
    ((0.97, 0.97, 0.97), True),
    ((0.95, 0.95, 0.98, 1.0), True),  # a mean of exactly 0.97 in floats
    ((0.95, 0.95, 0.98, 0.999), False),
    ((0.96, 0.97, 0.98), True),  # the mean, not every seed (each is >= 0.95)
    ((0.955, 0.97, 0.98), False),  # mean 0.968...
    ((1.0, 1.0, 0.95, 0.95), True),  # mean 0.975 over 4 seeds
    ((0.98, 0.98, 0.95, 0.95), False),  # mean 0.965 (sum 3.86: over 3 seeds it would read 1.29)
])
def test_mean_at_least_0_97(full, met):
    t = targets(*[(0.0, x, None) for x in full])
    assert t[MEAN] is met
    assert t[FULL] is True


def test_mean_case_on_the_threshold_is_on_it():
    assert sum((0.95, 0.95, 0.98, 1.0)) / 4 == R.FULL_MEAN_MIN


def test_mean_counts_only_seeds_with_a_full_run():
    res = demo((0.0, 0.97, None), (0.0, 0.97, None), (0.0, 0.97, None), (0.0, 0.0, None))
    del res["runs"]["3"]["full"]  # a seed whose RL run is missing: not in the mean (and not 3 seeds without it)
    assert R.summary(res)["targets"][MEAN] is True
    del res["runs"]["2"]["full"]
    assert MEAN not in R.summary(res)["targets"]


def test_recorded_demo_runs_verdicts():
    """A recorded 3-seed demo (benchmarks/results/demo_cpu_3seeds.json: full 0.984 / 0.982 / 0.967, ablation
    0.000 / 0.000 / 0.037, SFT greedy 0.076 / 0.029 / 0.023) meets every target; the same run with one seed's
    ablation at 0.70 (gap 0.28) or its SFT greedy at 0.11 misses that target only."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "benchmarks", "results", "demo_cpu_3seeds.json")) as f:
        res = json.load(f)
    assert R.summary(res)["targets"] == {SFT: True, FULL: True, ABL: True, MEAN: True}
    res["runs"]["1"]["ablation"]["sampled"]["success"] = 0.70
    assert R.summary(res)["targets"] == {SFT: True, FULL: True, ABL: False, MEAN: True}
    res["runs"]["1"]["ablation"]["sampled"]["success"] = 0.0
    res["runs"]["2"]["sft"]["greedy"]["success"] = 0.11
    assert R.summary(res)["targets"] == {SFT: False, FULL: True, ABL: True, MEAN: True}


def test_targets_line():
    assert R.targets_line({SFT: True, FULL: False, ABL: True}) == \
        "Targets: sft_greedy_le_0.1: met, full_ge_0.95_every_seed: MISSED, ablation_ge_0.3_below: met"
    assert R.targets_line(targets((0.0, 1.0, 0.0))) == \
        "Targets: sft_greedy_le_0.1: met, full_ge_0.95_every_seed: met, ablation_ge_0.3_below: met"


def full_results(run_dir="unused"):
    """A finished 2-seed demo (the ablation on seed 0 only), with times, phases, machine and versions."""
    res = demo((0.0703125, 0.978515625, 0.0234375), (0.052734375, 0.9375, None))
    res["runs"]["0"]["sft"]["sampled"]["summary_recall"] = None
    res["runs"]["0"].update(sft_time_s=60.0, full_time_s=240.0, ablation_time_s=300.0,
                            full_phases_s={"rollout": 60.0, "train": 168.0, "weight_sync": 12.0},
                            ablation_phases_s={"rollout": 30.0, "train": 270.0, "weight_sync": 0.0})
    res["runs"]["1"].update(sft_time_s=63.0, full_time_s=246.0)  # no phases: no share line
    res.update(command="python -m compactionrl_fast demo --seeds 0 1", total_time_s=900.0, cpu_time_s=1500.0,
               config={"eval_rollouts": 512, "engine": "transformers", "run_dir": run_dir},
               machine={"git": "abc1234", "cpu": "x86_64", "cores": 2, "torch_threads": 1,
                        "loadavg_start": [1.25, 2.0, 3.0]},
               versions={"python": "3.11.7", "torch": "2.13.0+cpu",
                         "packages": {"numpy": "2.4.6", "triton": "3.9.0", "pyyaml": "6.0.4", "other": "1.0"}})
    res["summary"] = R.summary(res)
    return res


def test_table():
    assert R.table(full_results()).split("\n") == [
        "| seed | model | success (T=1) | success (greedy) | answer accuracy | summary recall | minutes |",
        "|---|---|---|---|---|---|---|",
        "| 0 | SFT start | 0.900 | 0.070 | 0.500 | - | 1.0 |",
        "| 0 | CompactionRL | 0.979 | 0.000 | 0.500 | 0.250 | 4.0 |",
        "| 0 | ablation: summaries out of the loss | 0.023 | 1.000 | 0.500 | 0.250 | 5.0 |",
        "| 1 | SFT start | 0.900 | 0.053 | 0.500 | 0.250 | 1.1 |",
        "| 1 | CompactionRL | 0.938 | 0.000 | 0.500 | 0.250 | 4.1 |",
        "seed 0 full RL (transformers engine): rollouts 25%, training 70%, weight sync 5.0% of 4.0 min",
        "seed 0 ablation RL (transformers engine): rollouts 10%, training 90%, weight sync 0.0% of 5.0 min"]


def test_table_of_partial_runs_and_other_engines():
    """A seed without its SFT evaluation still lists its RL runs; a run without a time reads 0.0 minutes; the
    phase lines name the config's engine (the embedded one when the config predates the key)."""
    res = full_results()
    del res["runs"]["0"]["sft"], res["runs"]["0"]["ablation_time_s"]
    lines = R.table(res).split("\n")
    assert [ln.split(" | ")[1] for ln in lines[2:6]] == ["CompactionRL", "ablation: summaries out of the loss",
                                                         "SFT start", "CompactionRL"]
    assert lines[3].endswith(" | 0.0 |")
    assert lines[6].startswith("seed 0 full RL (transformers engine)") and len(lines) == 7
    res["config"]["engine"] = "vllm"
    assert R.table(res).split("\n")[6].startswith("seed 0 full RL (vllm engine): rollouts 25%")
    del res["config"]["engine"]
    assert R.table(res).split("\n")[6].startswith("seed 0 full RL (transformers engine): rollouts 25%")


def test_headline():
    res = full_results()
    assert R.headline(res, "demo_x").split("\n") == [
        "Made by `python -m compactionrl_fast demo --seeds 0 1` at git `abc1234` on x86_64 (2 cores, torch threads "
        "1, load average 1.2 at start): **15.0 min** wall (SFT 1.0-1.1 min, each RL run 4.0-5.0 min, evaluations "
        "the rest). Python 3.11.7, torch 2.13.0+cpu, triton 3.9.0, numpy 2.4.6, pyyaml 6.0.4. Held-out success on "
        "512 tasks:",
        "",
        "| seed | SFT start (T=1 / greedy) | CompactionRL (T=1 / greedy) | ablation: summaries out of the loss "
        "(T=1 / greedy) |",
        "|---|---|---|---|",
        "| 0 | 0.900 / 0.070 | 0.979 / 0.000 | 0.023 / 1.000 |",
        "| 1 | 0.900 / 0.053 | 0.938 / 0.000 | - |",
        "",
        "Targets: sft_greedy_le_0.1: met, full_ge_0.95_every_seed: MISSED, ablation_ge_0.3_below: met.",
        "",
        "![training success and summary recall](demo_x.png)"]


def test_headline_of_a_results_file_without_versions():
    res = full_results()
    del res["versions"]  # older NAME.json files, re-rendered by `python -m compactionrl_fast.app.results`
    assert "evaluations the rest). Python None, torch None. Held-out" in R.headline(res, "d")


def test_spans_and_load():
    assert R._span([]) == "-" and R._span([4.0]) == "4.0"
    assert R._span([4.0, 4.04]) == "4.0"  # within 0.05: one number
    assert R._span([0.0, 0.05]) == "0.0-0.1"  # 0.05 apart: a range
    assert R._span([4.0, 4.06]) == "4.0-4.1" and R._span([4.1, 3.9, 5.0]) == "3.9-5.0"
    assert R._load(None) == "-" and R._load([]) == "-" and R._load([2.25, 9.0, 9.0]) == "2.2"


def test_version_line_and_versions():
    v = R.versions()
    assert v["python"] == R.platform.python_version() and v["torch"] == R.torch.__version__
    assert v["packages"]["torch"] and v["packages"]["numpy"]
    assert list(v["packages"]) == sorted(v["packages"]) and all(k == k.lower() for k in v["packages"])
    assert "pyyaml" in v["packages"]  # lower-cased (PyYAML)
    assert R.version_line({"python": "3.1", "torch": "9", "packages": {"torch": "9", "tqdm": "1", "zzz": "2"}}) \
        == "Python 3.1, torch 9, tqdm 1"
    assert R.version_line({}) == "Python None, torch None"


def test_machine(monkeypatch):
    m = R.machine(3)
    assert m["torch_threads"] == 3 and m["cores"] == os.cpu_count() and m["torch"] == R.torch.__version__
    assert m["versions"] == R.version_line(R.versions()) and len(m["loadavg_start"]) == 3
    assert m["git"] and m["cpu"]
    assert R.machine(None)["torch_threads"] == R.torch.get_num_threads()

    def no_load():
        raise OSError

    monkeypatch.setattr(R.os, "getloadavg", no_load)
    assert R.machine(1)["loadavg_start"] is None


def test_print_eval(capsys):
    R.print_eval("seed 0 full", ev(0.978515625, 1.0, recall=0.5))
    R.print_eval("seed 0 sft", ev(0.1, 0.0625, recall=None))
    assert capsys.readouterr().out.split("\n") == [
        "[seed 0 full] success sampled 0.979 greedy 1.000 summary recall 0.500",
        "[seed 0 sft] success sampled 0.100 greedy 0.062 summary recall nan", ""]


def _metrics(path, n_pre, n_ppo):
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        for s in range(n_pre + n_ppo):
            ppo = s >= n_pre
            f.write(json.dumps({"step": s, "phase": "ppo" if ppo else "value_pretrain",
                                **({"actor_step": s - n_pre + 1, "success": s / 10, "summary_recall": 1 - s / 10}
                                   if ppo else {"success": None})}) + "\n")


def test_write_puts_the_three_files(tmp_path, monkeypatch):
    run = tmp_path / "runs"
    _metrics(str(run / "seed0" / "full" / "metrics.jsonl"), 2, 3)
    _metrics(str(run / "seed0" / "ablation" / "metrics.jsonl"), 2, 2)
    res = full_results(str(run))  # seed 1's full run has no metrics file: nothing plotted for it
    out = tmp_path / "out"
    out.mkdir()
    (out / ".d.md.tmp-99999999").write_text("stale")  # a writer's temporary file left by a killed run
    import matplotlib.figure

    figs, save = [], matplotlib.figure.Figure.savefig

    def keep(fig, *a, **k):  # the figure curves() saves, to read its lines back
        figs.append(fig)
        return save(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    R.write(res, str(out), "d")
    text = (out / "d.json").read_text()
    assert json.loads(text) == res and text.startswith('{\n "runs": {\n  "0": {\n   "sft"')  # indent 1
    assert (out / "d.md").read_text() == R.markdown(res, "d")
    assert (out / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out)) == ["d.json", "d.md", "d.png"]
    # the figure: success and summary recall against actor updates, value pre-training shaded at x <= 0
    (ax0, ax1), = [f.axes for f in figs]
    for ax, key in ((ax0, "success"), (ax1, "summary_recall")):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert sorted(lines) == ["ablation seed 0", "full seed 0"]
        assert list(lines["full seed 0"].get_xdata()) == [1, 2, 3]
        assert list(lines["ablation seed 0"].get_xdata()) == [1, 2]
        want = [0.2, 0.3, 0.4] if key == "success" else [0.8, 0.7, 0.6]
        assert list(lines["full seed 0"].get_ydata()) == pytest.approx(want)
        assert lines["full seed 0"].get_linestyle() == "-" and lines["ablation seed 0"].get_linestyle() == "--"
        assert ax.get_ylim() == (0, 1)
        (span,) = ax.patches
        assert span.get_x() == pytest.approx(-1.5) and span.get_width() == pytest.approx(2.0)
        assert ax.get_xlabel() == "actor update (shaded: value pre-training)"
    assert ax0.get_legend() is not None and ax1.get_legend() is None


@pytest.mark.filterwarnings("ignore:No artists with labels")  # no run plotted: an empty legend
def test_json_holds_what_json_cannot_as_text(tmp_path):
    import pathlib

    res = full_results(str(tmp_path / "runs"))
    res["config"]["out"] = pathlib.Path("a") / "b"
    R.write(res, str(tmp_path), "d")
    assert json.loads((tmp_path / "d.json").read_text())["config"]["out"] == os.path.join("a", "b")


@pytest.mark.filterwarnings("ignore:No artists with labels")  # no run plotted: an empty legend
def test_curves_without_value_pretraining_or_metrics(tmp_path, monkeypatch):
    import matplotlib.figure

    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figs.append(fig))
    R.curves(full_results(str(tmp_path / "nothing here")), str(tmp_path / "a.png"))  # no run found: empty axes
    _metrics(str(tmp_path / "runs" / "seed0" / "full" / "metrics.jsonl"), 0, 2)
    R.curves(full_results(str(tmp_path / "runs")), str(tmp_path / "b.png"))
    for fig, n in zip(figs, (0, 1)):
        for ax in fig.axes:
            assert ax.get_xlabel() == "actor update" and not ax.patches and len(ax.get_lines()) == n
    assert [ln.get_xdata().tolist() for ln in figs[1].axes[0].get_lines()] == [[1, 2]]


def test_markdown():
    res = full_results()
    md = R.markdown(res, "demo_x")
    assert md.split("\n") == [
        "# CPU demo (demo_x)", "", *R.headline(res, "demo_x").split("\n"), "", "## Details", "",
        "Command: `python -m compactionrl_fast demo --seeds 0 1`", "",
        f"Machine: {res['machine']}; total 15.0 min wall, 25.0 min CPU (load averages at start and end show how "
        "shared the machine was).", "",
        "Evaluation: held-out tasks, success = exact answer; summary recall = fraction of summaries that hold every "
        "digit seen before them.", "", *R.table(res).split("\n"), ""]
