"""`compactionrl-fast plot RUN_DIR`: the run's metrics.jsonl rendered to PNG files in RUN_DIR/plots/.

One figure per topic, one panel per quantity (several related metrics share a panel). Every panel has a
title in words, a y label with its unit and an x label. The x axis of an RL run counts actor updates:
value pre-training steps come before update 1, at x <= 0, on a shaded band; an SFT run (rows with
`sft/loss`) counts SFT optimiser steps. Metrics missing from a run are skipped.
"""
from __future__ import annotations

import json
import os

# figure -> panels; a panel is (title, y label, [(metric key, legend label), ...])
RL_FIGURES = {
    "reward": [
        ("Training success", "fraction of rollouts", [("success", "exact answer"), ("reward", "mean final reward")]),
        ("Answer accuracy", "fraction of digits right", [("info/accuracy", None)]),
        ("Summary recall", "fraction of summaries", [("summary_recall", "hold every digit seen")]),
    ],
    "compaction": [
        # the rollouts' own means (the diagnostics' compactions_per_rollout / summary_length are token-weighted
        # over micro-batches)
        ("Compactions", "summaries per rollout", [("compactions", None)]),
        ("Summary length", "tokens per summary", [("summary_tokens", None)]),
        ("Trainable tokens", "tokens per rollout", [("tokens_exec_per_rollout", "exec"),
                                                    ("tokens_summary_per_rollout", "summary")]),
    ],
    "losses": [
        ("Policy loss", "loss (token mean)", [("actor/policy_loss", None)]),
        ("Value loss", "loss (token mean)", [("critic/value_loss", None)]),
        ("Gradient norm (before clipping)", "L2 norm", [("actor/grad_norm", "actor"), ("critic_grad_norm", "critic")]),
    ],
    "ppo": [
        ("Clipped tokens", "fraction of tokens", [("actor/clip_fraction", "ratio clip"),
                                                  ("actor/dual_clip_fraction", "dual clip")]),
        # actor/rollout_kl (trainer vs sampler) is taken after the step's earlier mini-batch updates, so it
        # repeats approx_kl up to rounding: one panel, one line
        ("Approximate KL, policy vs behaviour policy", "nats per token", [("actor/approx_kl", None)]),
        ("Policy entropy", "nats per token", [("actor/entropy", None)]),
        ("Actor learning rate", "learning rate (lr_schedule)", [("actor/lr", None)]),
    ],
    "advantages": [
        ("Mean advantage by segment", "advantage", [("adv_exec_mean", "exec"), ("adv_summary1_mean", "summary 1"),
                                                     ("adv_summary2_mean", "summary 2"),
                                                     ("adv_summary3_mean", "summary 3")]),
        ("Cross-segment factor (gamma*lam)^N", "mean factor (0-1)", [("segment_factor_exec_mean", "exec"),
                                                                      ("segment_factor_summary_mean", "summary")]),
    ],
    "value": [
        # value_explained_variance (diagnostics) is the same quantity as critic/explained_variance: one panel
        ("Critic explained variance", "1 - Var(R - V) / Var(R)", [("critic/explained_variance", None)]),
        ("Value vs return", "mean over trainable tokens", [("value_mean", "predicted value"),
                                                            ("return_mean", "return")]),
    ],
    "gap": [
        ("Paper vs stitched advantages: gap", "mean |A_paper - A_stitched|", [("gap_abs_mean", None)]),
        ("Relative gap", "gap / mean |A_stitched|", [("gap_rel", None)]),
        ("Correlation", "Pearson r", [("gap_corr", None)]),
        ("Sign agreement", "fraction of tokens", [("sign_agreement", None)]),
    ],
    "time": [
        ("Step time", "seconds per step", [("time/rollout_s", "rollouts"), ("time/train_s", "training")]),
    ],
}

SFT_FIGURES = {
    "sft": [
        ("SFT loss", "negative log-likelihood (nats per token)", [("sft/loss", None)]),
        ("SFT gradient norm (before clipping)", "L2 norm", [("sft/grad_norm", None)]),
        ("SFT learning rate", "learning rate", [("sft/lr", None)]),
    ],
}

PRETRAIN_LABEL = "value pre-training"


def read_metrics(path: str) -> list:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def is_sft(rows) -> bool:
    return any("sft/loss" in r for r in rows)


def step_axis(rows) -> tuple:
    """(x of each row, x label, shaded (lo, hi) or None).

    RL rows: x = actor updates done after the row's step (`actor_step`), and value pre-training steps
    numbered 1 - P .. 0 before them (P of them). SFT rows: the SFT step + 1."""
    if is_sft(rows):
        return [r.get("step", i) + 1 for i, r in enumerate(rows)], "SFT optimiser step", None
    pre = [r for r in rows if r.get("phase") == "value_pretrain"]
    ppo = [r for r in rows if r.get("phase") == "ppo"]
    if ppo:
        n_pre = ppo[0]["step"] + 1 - ppo[0]["actor_step"]
    else:
        n_pre = max((r["step"] for r in pre), default=-1) + 1
    xs = [r.get("step", i) + 1 - n_pre for i, r in enumerate(rows)]
    shade = (0.5 - n_pre, 0.5) if n_pre > 0 else None
    return xs, "actor update", shade


def _series(rows, xs, key):
    px, py = [], []
    for x, r in zip(xs, rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            px.append(x)
            py.append(v)
    return px, py


def plot_run(run_dir: str, out_dir: str | None = None) -> list:
    """Render the plots of one run (RL or SFT); returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir!r} a run directory?")
    rows = read_metrics(path)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    xs, xlabel, shade = step_axis(rows)
    written = []
    for name, panels in (SFT_FIGURES if is_sft(rows) else RL_FIGURES).items():
        drawn = []
        for title, ylabel, keys in panels:
            lines = []
            for k, label in keys:
                px, py = _series(rows, xs, k)
                same = [i for i, (_, qx, qy) in enumerate(lines) if (qx, qy) == (px, py)]
                if same:  # e.g. reward = success on a 0/1 task: one line, both names
                    i = same[0]
                    lines[i] = (f"{lines[i][0]} = {label}", *lines[i][1:])
                elif px:
                    lines.append((label, px, py))
            if lines:
                drawn.append((title, ylabel, lines))
        if not drawn:
            continue
        # fixed margins instead of tight_layout: text layout dominates matplotlib's time here
        fig, axes = plt.subplots(1, len(drawn), figsize=(3.6 * len(drawn), 3.0), squeeze=False)
        fig.subplots_adjust(left=0.08 if len(drawn) > 2 else 0.14, right=0.98, bottom=0.17, top=0.88, wspace=0.38)
        for ax, (title, ylabel, lines) in zip(axes[0], drawn):
            for label, px, py in lines:
                ax.plot(px, py, marker="." if len(px) < 40 else None, label=label)
            _style(ax, title, xlabel, ylabel, shade)
            if any(label for label, *_ in lines):
                ax.legend(fontsize=6)
        p = os.path.join(out_dir, f"{name}.png")
        fig.savefig(p, dpi=72)
        plt.close(fig)
        written.append(p)
    if not is_sft(rows):
        written += _plot_distributions(rows, xs, xlabel, shade, out_dir, plt)
    return written


def _style(ax, title, xlabel, ylabel, shade):
    from matplotlib.ticker import MaxNLocator

    if shade is not None:
        ax.axvspan(*shade, color="0.85", zorder=0, label=None)
    ax.set_title(title, fontsize=8)
    ax.set_xlabel(xlabel + (" (shaded: " + PRETRAIN_LABEL + ")" if shade else ""), fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(5))
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _plot_distributions(rows, xs, xlabel, shade, out_dir, plt) -> list:
    """The cross-segment factor histogram over steps (with its colour bar), and the last value calibration."""
    hist = [(x, r["segment_factor_hist"]) for x, r in zip(xs, rows) if r.get("segment_factor_hist")]
    dec = [(x, r) for x, r in zip(xs, rows) if r.get("value_decile_pred")]
    if not hist and not dec:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    fig.subplots_adjust(left=0.07, right=0.97, bottom=0.16, top=0.88, wspace=0.35)
    if hist:
        import numpy as np

        steps = [h[0] for h in hist]
        img = np.array([np.asarray(h[1], float) / max(sum(h[1]), 1) for h in hist]).T
        im = axes[0].imshow(img, aspect="auto", origin="lower", extent=[min(steps) - 0.5, max(steps) + 0.5, 0, 1],
                            cmap="viridis", vmin=0)
        cb = fig.colorbar(im, ax=axes[0], pad=0.02)
        cb.set_label("share of the step's segments", fontsize=7)
        cb.ax.tick_params(labelsize=7)
        axes[0].set_title("Cross-segment factor (gamma*lam)^N per segment", fontsize=8)
        axes[0].set_xlabel(xlabel + (" (<= 0: " + PRETRAIN_LABEL + ")" if shade else ""), fontsize=7)
        axes[0].set_ylabel("factor (10 bins over [0, 1])", fontsize=7)
        axes[0].tick_params(labelsize=7)
    else:
        axes[0].set_axis_off()
    if dec:
        x, last = dec[-1]
        pred, real = last["value_decile_pred"], last["value_decile_real"]
        axes[1].plot(pred, real, "o-", label=f"{xlabel} {x}")
        lo, hi = min(pred + real), max(pred + real)
        axes[1].plot([lo, hi], [lo, hi], "k--", lw=0.8, label="perfect calibration")
        axes[1].set_xlabel("predicted value (mean of a decile of predictions)", fontsize=7)
        axes[1].set_ylabel("realised return (mean in that decile)", fontsize=7)
        axes[1].set_title("Critic calibration at the last logged step", fontsize=8)
        axes[1].tick_params(labelsize=7)
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize=6)
    else:
        axes[1].set_axis_off()
    p = os.path.join(out_dir, "distributions.png")
    fig.savefig(p, dpi=72)
    plt.close(fig)
    return [p]
