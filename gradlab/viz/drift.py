"""Drift over training (docs/concepts/drift.md): cumulative KL at the fixed probe contexts (`probe_kl`) and
the one-step KL at each step's own shared nodes (`drift_node_kl_mean`), from the tidy table."""

from __future__ import annotations

import pandas as pd
import seaborn as sns

from .curves import plt

DRIFT = [("probe_kl", "cumulative KL at shared probe contexts"),
         ("drift_node_kl_mean", "one-step KL at the step's shared nodes")]


def drift_curves(tidy: pd.DataFrame, metrics=DRIFT, step: int | None = None,
                 x: str = "step") -> plt.Figure:
    """One panel per drift metric, a line per objective (band over seeds); `step` marks one
    rollout step (the one inspected) with a vertical line and its values as dots."""
    have = [(m, t) for m, t in metrics if m in set(tidy["metric"])]
    fig, axes = plt.subplots(1, max(1, len(have)), figsize=(5.5 * max(1, len(have)), 3.2),
                             squeeze=False)
    for ax, (m, title) in zip(axes.flat, have):
        d = tidy[tidy["metric"] == m]
        sns.lineplot(data=d, x=x, y="value", hue="objective", ax=ax, errorbar=("ci", 95),
                     n_boot=200, seed=0)
        if step is not None:
            ax.axvline(step, color="0.4", lw=0.8, ls="--")
            at = d[d["step"] == step]
            ax.scatter(at[x], at["value"], color="k", s=12, zorder=3)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("nats")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
