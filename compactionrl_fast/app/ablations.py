"""The paper's ablations on the demo's task: which parts of CompactionRL matter here, over several seeds.

Per seed, one SFT warm start (the demo's), then the same RL budget for each variant from it: the full
recipe, the policy loss averaged per segment instead of per token ("w/o token-level loss"), no
cross-segment factor ("w/o cross-trajectory GAE"), the exact stitched GAE (not in the paper), and
summary tokens out of the policy loss. Each model is evaluated on the same held-out tasks. Writes
RUN_DIR/NAME.json, NAME.md (mean, sample standard deviation and 95% t-interval of the success per
variant, and the paired difference to the full recipe) and NAME.png (learning curves, mean over seeds).
"""
from __future__ import annotations

import json
import math
import os
import time

from ..train.config import TrainConfig
from ..train.config_load import to_dict

# name -> (what it tests, config overrides)
VARIANTS = {
    "full": ("the full recipe (token-mean loss, paper cross-segment factor, summaries trained)", {}),
    "segment-mean": ("w/o token-level loss: loss_reduction=segment-mean", {"loss_reduction": "segment-mean"}),
    "no-cross-segment": ("w/o the cross-segment factor: cross_segment=none", {"cross_segment": "none"}),
    "stitched": ("exact GAE across segments: cross_segment=stitched", {"cross_segment": "stitched"}),
    "no-summary-loss": ("summaries out of the policy loss: train_summary_tokens=false",
                        {"train_summary_tokens": False}),
}

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then the normal's 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def interval(xs) -> dict:
    """Mean, sample standard deviation and the 95% t-interval of the mean of `xs` (no interval for one value)."""
    n = len(xs)
    if n == 0:
        raise ValueError("interval needs at least one value")
    mean = sum(xs) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": None, "ci95": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "std": sd, "ci95": [mean - half, mean + half]}


def run(base: TrainConfig, *, seeds=(0, 1, 2), variants=tuple(VARIANTS), name="ablations", argv=(),
        progress=None, workers="auto") -> dict:
    """Every variant on every seed; returns the results dict written to RUN_DIR/NAME.json. The jobs (the SFT
    of every seed, then every variant's RL run) run `workers` at a time as in the demo (`demo.run`)."""
    from . import demo
    from .results import machine, versions
    from .plots import plot_run
    from .runner import device_of
    from ..train.cpu_malloc import keep_freed_memory
    from ..train.threads import make_tuner

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    progress = base.progress if progress is None else progress
    workers = demo._workers(base, workers)
    tuner = make_tuner(base.threads)
    if device_of(base) == "cpu":
        keep_freed_memory()
    t0 = time.time()
    results = {"command": "python -m compactionrl_fast " + " ".join(argv), "config": to_dict(base),
               "machine": {**machine(base.threads), "demo_workers": workers}, "versions": versions(),
               "variants": {v: VARIANTS[v][0] for v in variants}, "runs": {str(s): {} for s in seeds}}
    local = dict(tuner=tuner, engine=None, progress=progress)
    sft_jobs = [(demo._sft_job, (base, seed)) for seed in seeds]
    rl_jobs = [(demo._rl_job, (base, seed, v, base.eval_rollouts, VARIANTS[v][1])) for seed in seeds for v in variants]
    rl_jobs += [(demo._sft_eval_job, (base, seed, base.eval_rollouts)) for seed in seeds]
    for _ in demo._run_jobs(sft_jobs, workers, base, local):
        pass
    for (seed, v), res in demo._run_jobs(rl_jobs, workers, base, local):
        if v == "sft":
            results["runs"][str(seed)]["sft"] = res["sft"]
        else:
            results["runs"][str(seed)][v] = {**res[v], "time_s": res[f"{v}_time_s"]}
            plot_run(os.path.join(base.run_dir, f"seed{seed}", v))
    results["runs"] = {s: {k: run[k] for k in ["sft", *variants]} for s, run in results["runs"].items()}
    results["total_time_s"] = time.time() - t0
    results["summary"] = summarise(results, variants)
    os.makedirs(base.run_dir, exist_ok=True)
    stem = os.path.join(base.run_dir, name)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    table = table_md(results)
    with open(stem + ".md", "w") as f:
        f.write(f"# Ablations ({name})\n\nCommand: `{results['command']}`\n\n"
                f"Machine: {results['machine']}; total {results['total_time_s'] / 60:.1f} min.\n\n{table}\n")
    curves(results, base.run_dir, stem + ".png")
    print(table)
    print(f"results in {stem}.{{json,md,png}}")
    return results


def summarise(results: dict, variants) -> dict:
    """Per variant and evaluation mode: the interval of the success over seeds, and of the paired
    difference (variant - full) where the full recipe ran."""
    out = {}
    runs = results["runs"].values()
    for v in ["sft", *variants]:
        out[v] = {}
        for mode in ("sampled", "greedy"):
            xs = [r[v][mode]["success"] for r in runs]
            out[v][mode] = interval(xs)
            if v not in ("sft", "full") and "full" in variants:
                out[v][mode]["diff_to_full"] = interval([r[v][mode]["success"] - r["full"][mode]["success"]
                                                         for r in runs])
    return out


def _cell(s: dict) -> str:
    if s["std"] is None:
        return f"{s['mean']:.3f}"
    return f"{s['mean']:.3f} ± {s['std']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"


def table_md(results: dict) -> str:
    """Success (T=1 and greedy) per variant: mean ± sample std [95% t-interval], and the paired difference
    to the full recipe."""
    n = len(results["runs"])
    lines = [f"Held-out success over {n} seed(s) ({results['config']['eval_rollouts']} tasks each): "
             "mean ± sample std [95% t-interval of the mean]; difference: variant - full, paired by seed.", "",
             "| variant | what it tests | success (T=1) | success (greedy) | T=1 difference to full |",
             "|---|---|---|---|---|"]
    for v, s in results["summary"].items():
        what = "SFT start (before RL)" if v == "sft" else results["variants"][v]
        diff = _cell(s["sampled"]["diff_to_full"]) if "diff_to_full" in s["sampled"] else "-"
        lines.append(f"| {v} | {what} | {_cell(s['sampled'])} | {_cell(s['greedy'])} | {diff} |")
    return "\n".join(lines)


def curves(results: dict, run_dir: str, path: str) -> None:
    """Training success and summary recall per variant against actor updates: mean over seeds (line) and
    the range over seeds (band); value pre-training shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .plots import read_metrics, step_axis

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.14, top=0.84, wspace=0.22)
    shade = None
    for v in results["variants"]:
        per_seed = {}
        for seed in results["runs"]:
            p = os.path.join(run_dir, f"seed{seed}", v, "metrics.jsonl")
            if os.path.isfile(p):
                rows = read_metrics(p)
                xs, _, shade = step_axis(rows)
                per_seed[seed] = (xs, rows)
        if not per_seed:
            continue
        for ax, key in zip(axes, ("success", "summary_recall")):
            xs = sorted({x for sx, _ in per_seed.values() for x in sx})
            ys = np.full((len(per_seed), len(xs)), np.nan)
            for i, (sx, rows) in enumerate(per_seed.values()):
                for x, r in zip(sx, rows):
                    if isinstance(r.get(key), (int, float)):
                        ys[i, xs.index(x)] = r[key]
            ok = ~np.all(np.isnan(ys), axis=0)
            if not ok.any():
                continue
            x = np.asarray(xs)[ok]
            line, = ax.plot(x, np.nanmean(ys[:, ok], 0), label=f"{v} ({len(per_seed)} seeds)")
            if len(per_seed) > 1:
                ax.fill_between(x, np.nanmin(ys[:, ok], 0), np.nanmax(ys[:, ok], 0), color=line.get_color(),
                                alpha=0.15, lw=0)
    titles = (("Training success (sampled at T=1)", "fraction of the step's rollouts"),
              ("Summaries holding every digit seen so far", "fraction of the step's summaries"))
    for ax, (title, ylabel) in zip(axes, titles):
        if shade is not None:
            ax.axvspan(*shade, color="0.85", zorder=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("actor update" + (" (shaded: value pre-training)" if shade else ""), fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Ablations: line = mean over seeds, band = range over seeds", fontsize=9)
    fig.savefig(path, dpi=80)
    plt.close(fig)
