"""Instruments: draw the tidy table (store.load_run). Quantities are computed elsewhere."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless by default; notebooks switch back with %matplotlib inline
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

CURVES = [
    ("accuracy", "accuracy"),
    ("reward", "reward"),
    ("rho_prefix", "cancellation ratio ρ (full-group nodes)"),
    ("rho_trie", "cancellation ratio ρ (trie nodes)"),
    ("probe_kl", "cumulative KL at shared probe contexts"),
    ("tax_share", "‖g_tax‖ / ‖g_total‖"),
    ("entropy", "token entropy (nats)"),
    ("logodds", "equal-solution log-odds log π(a)/π(b)"),
]


def training_curves(tidy: pd.DataFrame, metrics=CURVES, x: str = "tokens",
                    smooth: int = 1, log: tuple = (), floor: float = 1e-6,
                    title: str | None = None) -> plt.Figure:
    """One panel per metric, one line per objective (mean and 95 % bootstrap band over seeds).

    smooth: rolling mean over that many points of each seed's curve (1 = raw). log: metrics
    drawn on a log axis; there values below `floor` (float round-off, e.g. ρ of an objective
    that cancels exactly) are raised to it and the band under it is shaded. title: figure title.
    """
    have = [(m, t) for m, t in metrics if m in set(tidy["metric"])]
    ncol = 2
    nrow = max(1, (len(have) + 1) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(11, 3.2 * nrow), squeeze=False)
    for ax, (m, label) in zip(axes.flat, have):
        d = tidy[tidy["metric"] == m].copy()
        if smooth > 1:
            d["value"] = d.groupby(["run", "objective", "seed"])["value"].transform(
                lambda s: s.rolling(smooth, min_periods=1).mean())
        if m in log:
            d["value"] = d["value"].clip(lower=floor)
        sns.lineplot(data=d, x=x, y="value", hue="objective", ax=ax, errorbar=("ci", 95),
                     n_boot=500, seed=0)
        if m in log:
            ax.set_yscale("log")
            ax.axhspan(floor / 10, floor, color="0.85", zorder=0, label="float round-off")
            ax.set_ylim(bottom=floor / 10)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("rollout tokens consumed" if x == "tokens" else x)
        ax.set_ylabel("")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(have):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def save(fig: plt.Figure, path: str | Path) -> Path:
    """Write fig (png/svg/pdf by suffix) at 120 dpi, make parent folders, close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
