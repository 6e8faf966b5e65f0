"""Prop. 3.1's prediction against the measurement: a scatter of predicted vs measured KL."""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns

from ..stats import loglog_fit
from .curves import plt

NEEDED = ("objective", "kl_measured", "kl_predicted")


def prop31_scatter(df: pd.DataFrame, x: str = "kl_predicted", y: str = "kl_measured",
                   ax=None, fit: bool = False) -> plt.Figure:
    """df: tidy table, one row per (step, objective) with columns objective, kl_measured,
    kl_predicted (nats; extra columns such as step are ignored). Draws y against x per objective
    with the line y = x (the proposition holds on it) on log–log axes when all values are > 0.
    ax: draw into this axes (default a new figure); fit: add the least-squares line of log y on
    log x over all rows (`gradlab.stats.loglog_fit`), its slope in the legend."""
    missing = [c for c in NEEDED if c not in df]
    if missing:
        raise ValueError(f"prop31_scatter: missing column(s) {missing}; needs {list(NEEDED)}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(4.8, 4.2))
    else:
        fig = ax.figure
    sns.scatterplot(data=df, x=x, y=y, hue="objective", ax=ax, s=14, alpha=0.7, linewidth=0)
    v = df[[x, y]].to_numpy(float)
    v = v[np.isfinite(v).all(1)]
    if len(v):
        lo, hi = v.min(), v.max()
        ax.plot([lo, hi], [lo, hi], color="0.4", lw=0.8, ls="--", label="y = x")
        if lo > 0:
            ax.set_xscale("log")
            ax.set_yscale("log")
    if fit:
        f = loglog_fit(df[x], df[y])
        if np.isfinite(f["slope"]):
            xs = np.geomspace(df[x][df[x] > 0].min(), df[x].max(), 50)
            ax.plot(xs, 10 ** f["intercept"] * xs ** f["slope"], color="k", lw=1.0,
                    label=f"fit: slope {f['slope']:.3f}, R² {f['r2']:.3f}")
    ax.set_xlabel("predicted KL (Prop. 3.1), nats")
    ax.set_ylabel("measured KL, nats")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def prop31_figure(steps: pd.DataFrame) -> plt.Figure:
    """Two panels from a per-step table (columns objective, kl_measured, kl_predicted =
    ½δᵀFδ, kl_res = ½δ_resᵀFδ_res): (a) measured KL against ½δᵀFδ with y = x and the fit;
    (b) the residual's part ½δ_resᵀFδ_res against the measured KL (what the learning tax
    alone would move)."""
    if "kl_res" not in steps:
        raise ValueError("prop31_figure: missing column 'kl_res' (the residual's ½δ_resᵀFδ_res)")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.4))
    prop31_scatter(steps, ax=a, fit=True)
    a.set_title("(a) KL(π_θ‖π_θ+) vs ½ δᵀF δ, δ = step taken", fontsize=9)
    pos = steps[steps["kl_res"] > 0]
    prop31_scatter(pos, x="kl_measured", y="kl_res", ax=b)
    b.set_xlabel("measured KL of the step, nats")
    b.set_ylabel("½ δ_resᵀ F δ_res (residual's part), nats")
    b.set_title("(b) the learning tax's share of the step's KL", fontsize=9)
    fig.tight_layout()
    return fig
