"""Prop. 3.1's prediction against the measurement: a scatter of predicted vs measured KL."""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns

from .curves import plt

NEEDED = ("objective", "kl_measured", "kl_predicted")


def prop31_scatter(df: pd.DataFrame, x: str = "kl_predicted", y: str = "kl_measured") -> plt.Figure:
    """df: tidy table, one row per (step, objective) with columns objective, kl_measured,
    kl_predicted (nats; extra columns such as step are ignored). Draws y against x per objective
    with the line y = x (the proposition holds on it) on log–log axes when all values are > 0."""
    missing = [c for c in NEEDED if c not in df]
    if missing:
        raise ValueError(f"prop31_scatter: missing column(s) {missing}; needs {list(NEEDED)}")
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    sns.scatterplot(data=df, x=x, y=y, hue="objective", ax=ax, s=18)
    v = df[[x, y]].to_numpy(float)
    v = v[np.isfinite(v).all(1)]
    if len(v):
        lo, hi = v.min(), v.max()
        ax.plot([lo, hi], [lo, hi], color="0.4", lw=0.8, ls="--", label="y = x")
        if lo > 0:
            ax.set_xscale("log")
            ax.set_yscale("log")
    ax.set_xlabel("predicted KL (Prop. 3.1), nats")
    ax.set_ylabel("measured KL, nats")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
