"""The demo's results: the summary and its targets, the tables, the figure, and the files written.

`write` puts NAME.json (results, config, machine, versions), NAME.md (where and with what the numbers were
measured, the per-seed table, the targets, the detailed table) and NAME.png (training curves) in a folder:
the run directory, and with `demo --record` benchmarks/results/ of the checkout.
"""
from __future__ import annotations

import json
import os
import platform

import torch

from ..train import atomic
from ._git import git_revision

# the demo's targets (docs/demo.md): SFT greedy at most SFT_GREEDY_MAX, CompactionRL at T=1 at least FULL_MIN
# on every seed, the ablation at least ABLATION_GAP below it
SFT_GREEDY_MAX, FULL_MIN, ABLATION_GAP = 0.1, 0.95, 0.3
# and over 3 or more seeds a mean of at least FULL_MEAN_MIN (the margin: one seed sits within ~0.01 sampling error)
FULL_MEAN_MIN, MEAN_MIN_SEEDS = 0.97, 3
# successes are k / n: a difference or mean that is on a threshold in exact arithmetic may round just past it
# (0.95 - 0.65 = 0.29999999999999993); far below any 1 / n
_SLACK = 1e-9


def versions() -> dict:
    """Python and the version of every installed distribution (name -> version), sorted by name."""
    from importlib import metadata

    pkgs = {}
    for d in metadata.distributions():
        name = d.metadata["Name"]
        if name:
            pkgs[name.lower()] = d.version
    return {"python": platform.python_version(), "torch": torch.__version__,
            "packages": dict(sorted(pkgs.items()))}


KEY_PACKAGES = ("torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "tqdm", "pyyaml",
                "matplotlib")


def version_line(v: dict) -> str:
    """"Python 3.11.7, torch 2.13.0+cpu, ..." for the demo's main dependencies (all are in the JSON)."""
    pk = v.get("packages", {})
    return ", ".join([f"Python {v.get('python')}", f"torch {v.get('torch')}"] +
                     [f"{k} {pk[k]}" for k in KEY_PACKAGES[1:] if k in pk])


def headline(results: dict, name: str) -> str:
    """Where, when and with what the numbers were measured, the per-seed success table, the targets and the
    figure: the head of NAME.md (the README links the recorded one)."""
    m = results["machine"]
    runs = results["runs"]
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    minutes = lambda k: [r[k] / 60 for r in runs.values() if k in r]  # noqa: E731
    rl = minutes("full_time_s") + minutes("ablation_time_s")
    lines = [f"Made by `{results['command']}` at git `{m.get('git')}` on {m.get('cpu')} ({m.get('cores')} cores, "
             f"torch threads {m.get('torch_threads')}, load average {_load(m.get('loadavg_start'))} at start): "
             f"**{results['total_time_s'] / 60:.1f} min** wall (SFT {_span(minutes('sft_time_s'))} min, "
             f"each RL run {_span(rl)} min, evaluations the rest). {version_line(results.get('versions', {}))}. "
             f"Held-out success on {results['config'].get('eval_rollouts')} tasks:", "",
             "| seed | SFT start (T=1 / greedy) | CompactionRL (T=1 / greedy) | "
             "ablation: summaries out of the loss (T=1 / greedy) |", "|---|---|---|---|"]
    for seed, r in runs.items():
        cells = [f"{f(r[k]['sampled']['success'])} / {f(r[k]['greedy']['success'])}" if k in r else "-"
                 for k in ("sft", "full", "ablation")]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    t = results["summary"]["targets"]
    lines += ["", targets_line(t) + ".", "", f"![training success and summary recall]({name}.png)"]
    return "\n".join(lines)


def targets_line(targets: dict) -> str:
    """"Targets: sft_greedy_le_0.1: met, ..." (MISSED in capitals)."""
    return "Targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items())


def _span(xs) -> str:
    return "-" if not xs else f"{min(xs):.1f}" if max(xs) - min(xs) < 0.05 else f"{min(xs):.1f}-{max(xs):.1f}"


def _load(x) -> str:
    return "-" if not x else f"{x[0]:.1f}"


def machine(threads) -> dict:
    """Where the run happens: git revision, CPU, cores, threads, torch, load average, main versions."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"git": git_revision(os.path.dirname(os.path.abspath(__file__))),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": threads or torch.get_num_threads(), "torch": torch.__version__, "loadavg_start": load,
            "versions": version_line(versions())}


def print_eval(label, ev):
    s, g = ev["sampled"], ev["greedy"]
    print(f"[{label}] success sampled {s['success']:.3f} greedy {g['success']:.3f} "
          f"summary recall {s['summary_recall'] if s['summary_recall'] is not None else float('nan'):.3f}", flush=True)


def summary(results) -> dict:
    """Per-seed successes, the ablation gaps, and which of the demo's targets were met."""
    runs = results["runs"].values()
    full = [r["full"]["sampled"]["success"] for r in runs if "full" in r]
    abl = [(r["full"]["sampled"]["success"], r["ablation"]["sampled"]["success"]) for r in runs if "ablation" in r]
    sft_g = [r["sft"]["greedy"]["success"] for r in runs]
    return {"full_success": full, "sft_greedy_success": sft_g,
            "ablation_gap": [a - b for a, b in abl],
            "targets": {f"sft_greedy_le_{SFT_GREEDY_MAX}": all(x <= SFT_GREEDY_MAX + _SLACK for x in sft_g),
                        f"full_ge_{FULL_MIN}_every_seed": bool(full) and all(x >= FULL_MIN - _SLACK for x in full),
                        f"ablation_ge_{ABLATION_GAP}_below": bool(abl) and all(a - b >= ABLATION_GAP - _SLACK
                                                                               for a, b in abl),
                        **({f"full_mean_ge_{FULL_MEAN_MIN}": sum(full) / len(full) >= FULL_MEAN_MIN - _SLACK}
                           if len(full) >= MEAN_MIN_SEEDS else {})}}


def table(results) -> str:
    """Every evaluation of every seed, and where each RL run spent its time."""
    lines = ["| seed | model | success (T=1) | success (greedy) | answer accuracy | summary recall | minutes |",
             "|---|---|---|---|---|---|---|"]
    for seed, r in results["runs"].items():
        for k in ("sft", "full", "ablation"):
            if k not in r:
                continue
            s, g = r[k]["sampled"], r[k]["greedy"]
            f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            label = {"sft": "SFT start", "full": "CompactionRL", "ablation": "ablation: summaries out of the loss"}[k]
            lines.append(f"| {seed} | {label} | {f(s['success'])} | {f(g['success'])} | {f(s['accuracy'])} | "
                         f"{f(s['summary_recall'])} | {r.get(k + '_time_s', 0) / 60:.1f} |")
    engine = results["config"].get("engine", "transformers")
    for seed, r in results["runs"].items():
        for k in ("full", "ablation"):
            ph = r.get(k + "_phases_s")
            if ph and r.get(k + "_time_s"):
                share = {n: 100 * v / r[k + "_time_s"] for n, v in ph.items()}
                lines.append(f"seed {seed} {k} RL ({engine} engine): rollouts {share['rollout']:.0f}%, training "
                             f"{share['train']:.0f}%, weight sync {share['weight_sync']:.1f}% of "
                             f"{r[k + '_time_s'] / 60:.1f} min")
    return "\n".join(lines)


def markdown(results, name) -> str:
    """NAME.md: the headline (where, when, the per-seed table, the targets, the figure), then the details.
    A function of the results alone, so `python -m compactionrl_fast.app.results NAME.json` re-renders it."""
    md = [f"# CPU demo ({name})", "", headline(results, name), "", "## Details", "",
          f"Command: `{results['command']}`", "",
          f"Machine: {results['machine']}; total {results['total_time_s'] / 60:.1f} min wall, "
          f"{results['cpu_time_s'] / 60:.1f} min CPU (load averages at start and end show how shared the machine was).",
          "",
          "Evaluation: held-out tasks, success = exact answer; summary recall = fraction of summaries that "
          "hold every digit seen before them.", "", table(results), ""]
    return "\n".join(md)


def write(results, out_dir, name):
    """OUT_DIR/NAME.json, OUT_DIR/NAME.md and OUT_DIR/NAME.png."""
    os.makedirs(out_dir, exist_ok=True)
    atomic.remove_stale_temps(out_dir)
    atomic.write_text(os.path.join(out_dir, name + ".json"), json.dumps(results, indent=1, default=str))
    atomic.write_text(os.path.join(out_dir, name + ".md"), markdown(results, name))
    curves(results, os.path.join(out_dir, name + ".png"))


def curves(results, path):
    """Training success and summary recall of the full method and the ablation, per seed, against actor
    updates (value pre-training shaded, at x <= 0: the per-run plots' convention)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import read_metrics, step_axis

    run_dir = results["config"]["run_dir"]
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.88, wspace=0.25)
    shade = None
    for seed in results["runs"]:
        for v, style in (("full", "-"), ("ablation", "--")):
            p = os.path.join(run_dir, f"seed{seed}", v, "metrics.jsonl")
            if os.path.isfile(p):
                rows = read_metrics(p)
                xs, _, shade = step_axis(rows)
                for ax, key in zip(axes, ("success", "summary_recall")):
                    pts = [(x, r[key]) for x, r in zip(xs, rows) if isinstance(r.get(key), (int, float))]
                    ax.plot([a for a, _ in pts], [b for _, b in pts], style, label=f"{v} seed {seed}")
    titles = (("Training success (sampled at T=1)", "fraction of the step's rollouts"),
              ("Summaries holding every digit seen so far", "fraction of the step's summaries"))
    for ax, (title, ylabel) in zip(axes, titles):
        if shade is not None:
            ax.axvspan(*shade, color="0.85", zorder=0)
        ax.set_xlabel("actor update" + (" (shaded: value pre-training)" if shade else ""), fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":  # re-render NAME.md next to each NAME.json given (the numbers are the JSON's)
    import sys

    for path in sys.argv[1:]:
        with open(path) as f:
            res = json.load(f)
        stem = os.path.splitext(path)[0]
        atomic.write_text(stem + ".md", markdown(res, os.path.basename(stem)))
        print(f"wrote {stem}.md")
