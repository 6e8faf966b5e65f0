"""Gradient noise and cosine to the reference per objective, with bootstrap intervals, from the
tidy table of `gradlab.loop.recipes.variance.measure_variance` (summary rows: batch <NA>)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from .curves import plt

PANELS = (("grad_noise", "gradient noise  tr Cov(g) / ‖E g‖²  (one batch)", True,
           "(a) gradient noise, lower is better"),
          ("cos_ref_mean", "cos(g_k, g_ref)  (mean over batches)", False,
           "(b) agreement with the reference gradient"))
BASELINE = "grpo"  # a dotted line at its value per series, where measured
NEEDED = ("task", "objective", "batch", "metric", "value")


def summary_table(tidy: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, rollout, objective) with a column per summary metric."""
    missing = [c for c in NEEDED if c not in tidy]
    if missing:
        raise ValueError(f"variance table: missing column(s) {missing}; needs {list(NEEDED)}")
    keys = [c for c in ("task", "rollout", "objective") if c in tidy]
    s = tidy[tidy["batch"].isna()]
    return s.pivot_table(index=keys, columns="metric", values="value", sort=False).reset_index()


def _paired_ratios(ax: plt.Axes, d: pd.DataFrame, y: np.ndarray) -> None:
    """Above each objective's interval, its noise ratio to GRPO's with the paired interval: the
    unpaired intervals overlap even where the paired ratio clearly differs from 1."""
    m = f"noise_ratio_vs_{BASELINE}"
    if m not in d:
        return
    for yi, (obj, r) in zip(y, d.iterrows()):
        if obj != BASELINE and np.isfinite(r[m]):
            ax.annotate(f"{r[m]:.2f}× {BASELINE.upper()}'s, paired [{r[m + '_lo']:.2f}, "
                        f"{r[m + '_hi']:.2f}]", xy=(0.99, yi - 0.36), xycoords=("axes fraction", "data"),
                        ha="right", va="center", fontsize=7, color="0.25")


def variance_figure(tidy: pd.DataFrame, title: str | None = None) -> plt.Figure:
    """Two panels, objectives down the y axis, one colour per task (and rollout layout):
    (a) gradient noise with its 95 % bootstrap interval over batches (log axis),
    (b) mean cosine of a batch gradient to the reference gradient, with its interval.
    Dotted lines: GRPO's value in each series' colour, where GRPO was measured."""
    s = summary_table(tidy)
    multi = "rollout" in s and s["rollout"].nunique() > 1  # layouts side by side
    s["series"] = s["task"] + (" · " + s["rollout"] if multi else "")
    order = list(dict.fromkeys(s["objective"]))
    series = list(dict.fromkeys(s["series"]))
    colours = dict(zip(series, sns.color_palette("colorblind", len(series))))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.55 * len(order) + 1.6), sharey=True)
    step = 0.7 / max(len(series), 1)
    for ax, (metric, label, log, panel) in zip(axes, PANELS):
        lo_col, hi_col = (f"{metric}_lo", f"{metric}_hi")
        for j, name in enumerate(series):
            d = s[s["series"] == name].set_index("objective").reindex(order)
            y = np.arange(len(order)) + (j - (len(series) - 1) / 2) * step
            v = d[metric].to_numpy(float)
            with np.errstate(invalid="ignore"):  # an infinite noise has no drawable bar
                err = np.abs(np.vstack([v - d[lo_col].to_numpy(float),
                                        d[hi_col].to_numpy(float) - v]))
            ax.errorbar(v, y, xerr=np.nan_to_num(err, nan=0.0, posinf=0.0), fmt="o", ms=4, capsize=2,
                        color=colours[name], label=name)
            if BASELINE in order and np.isfinite(v[order.index(BASELINE)]):
                ax.axvline(v[order.index(BASELINE)], color=colours[name], lw=0.8, ls=":")
            if metric == "grad_noise" and len(series) == 1:
                _paired_ratios(ax, d, y)
        ax.set_yticks(np.arange(len(order)), order)
        ax.set_xlabel(label, fontsize=9)
        ax.set_title(panel, fontsize=9)
        if log and (s[metric] > 0).any():  # a log axis needs a positive value to draw
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_ylim(len(order) - 0.5, -0.75)  # inverted: the first objective on top (shared y)
    if len(series) > 1:  # one series needs no legend; several get one under the panels
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(series),
                   fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.02))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
