"""`compactionrl-fast plot RUN_DIR`: the run's metrics.jsonl rendered to PNG files in RUN_DIR/plots/.

One figure per topic; a panel per metric against the step. Metrics missing from a run are skipped.
"""
from __future__ import annotations

import json
import os

PANELS = {
    "reward": ["reward", "success", "summary_recall", "info/accuracy"],
    "compaction": ["compactions_per_rollout", "summary_length", "tokens_exec_per_rollout",
                   "tokens_summary_per_rollout"],
    "losses": ["actor/policy_loss", "critic/value_loss", "actor/grad_norm", "critic_grad_norm"],
    "ppo": ["actor/clip_fraction", "actor/approx_kl", "actor/entropy", "actor/rollout_kl"],
    "advantages": ["adv_exec_mean", "adv_summary1_mean", "adv_summary2_mean", "adv_summary3_mean",
                   "segment_factor_exec_mean", "segment_factor_summary_mean"],
    "value": ["value_explained_variance", "value_mean", "return_mean", "critic/explained_variance"],
    "gap": ["gap_abs_mean", "gap_rel", "gap_corr", "sign_agreement"],
}


def read_metrics(path: str) -> list:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def _series(rows, key):
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r.get("step", len(xs)))
            ys.append(v)
    return xs, ys


def plot_run(run_dir: str, out_dir: str | None = None) -> list:
    """Render the plots of one run; returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir!r} a run directory?")
    rows = read_metrics(path)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, keys in PANELS.items():
        series = [(k, *_series(rows, k)) for k in keys]
        series = [s for s in series if s[1]]
        if not series:
            continue
        # fixed margins instead of tight_layout: text layout dominates matplotlib's time here
        fig, axes = plt.subplots(1, len(series), figsize=(3.2 * len(series), 2.6), squeeze=False)
        fig.subplots_adjust(left=0.06 if len(series) > 2 else 0.12, right=0.98, bottom=0.17, top=0.88, wspace=0.3)
        for ax, (k, xs, ys) in zip(axes[0], series):
            ax.plot(xs, ys, marker="." if len(xs) < 40 else None)
            _style(ax, k)
        p = os.path.join(out_dir, f"{name}.png")
        fig.savefig(p, dpi=72)
        plt.close(fig)
        written.append(p)
    written += _plot_lists(rows, out_dir, plt)
    return written


def _style(ax, title):
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(4, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(4))
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _plot_lists(rows, out_dir, plt) -> list:
    """The segment-factor histogram over steps, and the last value-calibration deciles."""
    written = []
    hist = [(r["step"], r["segment_factor_hist"]) for r in rows if r.get("segment_factor_hist")]
    dec = [r for r in rows if r.get("value_decile_pred")]
    if not hist and not dec:
        return written
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.9, wspace=0.3)
    if hist:
        import numpy as np

        steps = [h[0] for h in hist]
        img = np.array([np.asarray(h[1], float) / max(sum(h[1]), 1) for h in hist]).T
        axes[0].imshow(img, aspect="auto", origin="lower", extent=[min(steps), max(steps) + 1, 0, 1], cmap="viridis")
        axes[0].set_title("segment factor (gamma*lam)^N, share of segments", fontsize=9)
        axes[0].set_xlabel("step", fontsize=8)
    if dec:
        last = dec[-1]
        axes[1].plot(last["value_decile_pred"], last["value_decile_real"], "o-", label=f"step {last.get('step')}")
        lo = min(last["value_decile_pred"] + last["value_decile_real"])
        hi = max(last["value_decile_pred"] + last["value_decile_real"])
        axes[1].plot([lo, hi], [lo, hi], "k--", lw=0.8)
        axes[1].set_xlabel("predicted value (decile mean)", fontsize=8)
        axes[1].set_ylabel("realised return", fontsize=8)
        axes[1].set_title("value calibration", fontsize=9)
        axes[1].legend(fontsize=7)
    p = os.path.join(out_dir, "distributions.png")
    fig.savefig(p, dpi=72)
    plt.close(fig)
    written.append(p)
    return written
