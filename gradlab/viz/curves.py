"""Instruments: draw the tidy table (store.load_run). Quantities are computed elsewhere."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless by default; notebooks switch back with %matplotlib inline
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

CURVES = [
    ("accuracy", "training accuracy"),
    ("reward", "reward"),
    ("rho_prefix", "cancellation ratio ρ (full-group nodes)"),
    ("rho_trie", "cancellation ratio ρ (trie nodes)"),
    ("probe_kl", "cumulative KL at shared probe contexts"),
    ("tax_share", "‖g_tax‖ / ‖g_total‖"),
    ("entropy", "token entropy (nats)"),
    ("logodds", "equal-solution log-odds log π(a)/π(b)"),
]
LOG = ("rho_prefix", "rho_trie", "tax_share")  # span float round-off (~1e-9) to ~0.3: log axes
# where these are undefined (NaN with a cause) the title says why; a line breaks there
EXPLAIN = ("rho_prefix", "rho_trie", "tax_share")
HELDOUT = "eval_accuracy"  # drawn as points in the training-accuracy panel


def _same_curve(tidy: pd.DataFrame, a: str, b: str) -> bool:
    """Whether metrics a and b hold the same value at every (run, objective, seed, step)."""
    def series(m: str) -> pd.Series:
        return tidy[tidy["metric"] == m].set_index(["run", "objective", "seed", "step"])["value"]
    x, y = series(a), series(b)
    return len(x) > 0 and len(x) == len(y) and bool(((x - y.reindex(x.index)).abs() < 1e-12).all())


def panels(tidy: pd.DataFrame, metrics=CURVES) -> list[tuple[str, str]]:
    """The (metric, title) panels to draw: those present, and reward only where it differs
    from accuracy (a 0/1 verifier makes them one curve; the accuracy panel then says so)."""
    have = [(m, t) for m, t in metrics if m in set(tidy["metric"])]
    names = [m for m, _ in have]
    if "accuracy" in names and "reward" in names and _same_curve(tidy, "accuracy", "reward"):
        have = [(m, t + " = reward (0/1 rewards)" if m == "accuracy" else t)
                for m, t in have if m != "reward"]
    return have


def _sampled_every(tidy: pd.DataFrame, m: str, also=()) -> int:
    """k when metric m is measured every k > 1 steps (e.g. --tax-every), 0 when at one step
    only while the run has more, else 1 (every step). also: steps where m was measured and is
    undefined (NaN with a cause), counted as measured."""
    steps = sorted(set(tidy.loc[tidy["metric"] == m, "step"].dropna().astype(int)) |
                   {int(s) for s in also})
    if len(steps) >= tidy["step"].nunique():
        return 1
    return int(np.median(np.diff(steps))) if len(steps) > 1 else 0


def training_curves(tidy: pd.DataFrame, metrics=CURVES, *, x: str = "tokens",
                    smooth: int = 1, log: tuple = LOG, floor: float = 1e-6,
                    title: str | None = None, explain: tuple = EXPLAIN) -> plt.Figure:
    """One panel per metric, one line per objective (mean and 95 % Student-t band over seeds).

    Reward is left out where it equals accuracy (`panels`); held-out accuracy (eval_accuracy)
    is drawn as points next to training accuracy; a metric measured every k steps (the tax)
    is drawn as points at its steps. Each objective keeps one colour and dash in every panel
    (identical curves stay visible), and one legend sits above the panels. smooth: rolling
    mean over that many points of each seed's curve (1 = raw; not applied to points). log:
    metrics drawn on a log axis; there values below `floor` (float round-off, e.g. ρ of an
    objective that cancels exactly) are raised to it and the band under it is shaded.
    An undefined ρ (NaN in the store: every group tied, no full-group token) is a gap in its
    line, never a point at 0; the panel title gives the reason (`gradlab.viz.undefined`), and
    a ρ undefined at every step gets an empty panel that says why. explain: the metrics whose
    undefined steps are said so (default: ρ and the tax share); the reason is the table's
    `undefined` column where it holds one (`load_run`), else `gradlab.viz.undefined`'s.
    """
    full = tidy  # NaN kept: where a ρ is undefined, and why
    tidy = tidy[tidy["value"].notna()]  # the store melts unmeasured steps to NaN
    have = panels(tidy, metrics)
    undefined = {m: _undefined_at(full, m, x) for m, _ in metrics if m in explain}
    und_steps = {m: {s for v in (u if x == "step" else _undefined_at(full, m, "step")).values()
                     for s, _ in v} for m, u in undefined.items()}
    have += [(m, t) for m, t in metrics if undefined.get(m) and m not in dict(have)]
    # ↑ undefined at every step: an empty panel says why
    have.sort(key=lambda p: [m for m, _ in metrics].index(p[0]))
    objs = list(dict.fromkeys(tidy["objective"].dropna()))
    palette = dict(zip(objs, sns.color_palette(n_colors=max(len(objs), 1))))
    dashes = dict(zip(objs, [(1, 0), (4, 2), (1, 1.5), (6, 2, 1, 2), (3, 1, 1, 1, 1, 1)] * 10))
    ncol = 2 if len(have) > 1 else 1
    nrow = max(1, -(-len(have) // ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.5 * ncol, 3.0 * nrow), squeeze=False)
    for ax, (m, label) in zip(axes.flat, have):
        k = _sampled_every(tidy, m, und_steps.get(m, ()))
        d = tidy[tidy["metric"] == m].copy()
        if smooth > 1 and k == 1:
            d["value"] = d.groupby(["run", "objective", "seed"])["value"].transform(
                lambda s: s.rolling(smooth, min_periods=1).mean())
        if m in log:
            d["value"] = d["value"].clip(lower=floor)
        gaps = undefined.get(m, {})
        label += _gaps_note(ax, gaps, empty=d.empty)
        if d.empty:
            pass
        elif k == 1:
            sns.lineplot(data=d, x=x, y="value", hue="objective", style="objective", ax=ax,
                         errorbar=_t_band, palette=palette,
                         hue_order=objs, style_order=objs, dashes=dashes, legend=False)
            _break_lines(ax, gaps, palette)
        else:  # measured every k steps: points at those steps, nothing in between
            _points(ax, d, x, objs, palette, "o")
            label += f" (measured every {k} steps)" if k else " (measured at one step)"
        if m == "accuracy" and HELDOUT in set(tidy["metric"]):
            _points(ax, tidy[tidy["metric"] == HELDOUT], x, objs, palette, "D")
            label = label.replace("training accuracy", "accuracy: training (lines)") + ", held-out (◆)"
        if m in log:
            ax.set_yscale("log")
            ax.axhspan(floor / 10, floor, color="0.85", zorder=0)
            ax.set_ylim(bottom=floor / 10)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("rollout tokens consumed" if x == "tokens" else x)
        ax.set_ylabel("")
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    xs = tidy[x].dropna() if x in tidy else pd.Series(dtype=float)
    for ax in list(axes.flat)[: len(have)]:
        if len(xs) and xs.min() < xs.max():  # every panel spans the whole run, points included
            pad = 0.03 * (xs.max() - xs.min())
            ax.set_xlim(xs.min() - pad, xs.max() + pad)
    for ax in list(axes.flat)[len(have):]:
        ax.set_visible(False)
    _legend(fig, objs, palette, dashes=dashes, band=any(m in log for m, _ in have), floor=floor,
            heldout=HELDOUT in set(tidy["metric"]) and any(m == "accuracy" for m, _ in have))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.0 * nrow + 0.5)))
    if title:
        fig.suptitle(title, fontsize=10, y=1.02)
    return fig


def _undefined_at(full: pd.DataFrame, m: str, x: str) -> dict:
    """{objective: [(x value, reason)]} where metric m is undefined for every seed (NaN with a
    cause: the table's `undefined` column where it holds one, else
    `gradlab.viz.undefined.step_reason`; a step where it was not measured is not one)."""
    from .undefined import NOT_MEASURED, step_reason

    out: dict = {}
    for o, d in full.groupby("objective", sort=False):
        if m not in set(d["metric"]):
            continue
        wide = d.pivot_table(index=x, columns="metric", values="value", dropna=False)
        stored = {}
        if "undefined" in d:
            at = d[(d["metric"] == m) & d["undefined"].notna()]
            stored = at.groupby(x, sort=False)["undefined"].first().to_dict()
        for xv, row in wide.iterrows():  # the mean over seeds: NaN when every seed's is
            why = step_reason(row, m)
            if why == NOT_MEASURED and xv in stored:
                why = str(stored[xv])
            if why not in (None, NOT_MEASURED):
                out.setdefault(o, []).append((xv, why))
    return out


def _gaps_note(ax: plt.Axes, gaps: dict, empty: bool) -> str:
    """The title suffix saying why the metric is undefined where it is ("" when never: `gaps`
    from `_undefined_at`); on an empty panel (undefined at every step) the reason in the
    middle too."""
    if not gaps:
        return ""
    why = ", ".join(dict.fromkeys(w for v in gaps.values() for _, w in v))
    if empty:
        ax.text(0.5, 0.5, f"undefined at every step\n({why})", ha="center", va="center",
                transform=ax.transAxes, fontsize=9, color="0.3")
        ax.set_yticks([])
        return f" — undefined ({why})"
    return f" — gaps: undefined ({why})"


def _break_lines(ax: plt.Axes, gaps: dict, palette: dict) -> None:
    """Insert NaN into each objective's line where its ρ is undefined, so the line breaks
    there instead of joining its neighbours (seaborn drops NaN rows before drawing)."""
    from matplotlib.colors import to_rgb

    for o, at in gaps.items():
        xs = [xv for xv, _ in at]
        for line in ax.lines:
            if line.get_linestyle() == "None" or to_rgb(line.get_color()) != to_rgb(palette[o]):
                continue
            lx, ly = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
            ax_ = np.concatenate([lx, np.asarray(xs, float)])
            ay = np.concatenate([ly, np.full(len(xs), np.nan)])
            order = np.argsort(ax_, kind="stable")
            line.set_data(ax_[order], ay[order])


def _t_band(values) -> tuple[float, float]:
    """95 % Student-t interval of the mean over seeds (a small-n band; one seed: the value)."""
    from ..stats import mean_interval

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return (np.nan, np.nan)
    r = mean_interval(v)
    return r["lo"], r["hi"]


def _points(ax: plt.Axes, d: pd.DataFrame, x: str, objs: list, palette: dict, marker: str) -> None:
    """Mean over seeds at each x as a marker (with its 95 % t interval where there are several
    seeds); each objective's marker a size smaller than the last, so equal values stay visible."""
    for i, o in enumerate(objs):
        g = d[d["objective"] == o].groupby(x)["value"]
        if not len(g):
            continue
        mean, band = g.mean(), g.agg(lambda v: np.subtract(*_t_band(v)[::-1]) / 2)
        ax.errorbar(mean.index, mean.values, yerr=band.values, color=palette[o],
                    marker=marker, markersize=max(9 - 1.6 * i, 3), linestyle="",
                    markeredgecolor="white", markeredgewidth=0.6, zorder=3 + i)


def _legend(fig: plt.Figure, objs: list, palette: dict, *, dashes: dict, band: bool, floor: float,
            heldout: bool) -> None:
    """One legend above the panels (never over the data)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Line2D([], [], color=palette[o], dashes=dashes[o], label=o) for o in objs]
    if heldout:
        handles.append(Line2D([], [], color="0.3", marker="D", linestyle="", label="held-out"))
    if band:
        handles.append(Patch(color="0.85", label=f"< {floor:g}: float round-off"))
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 1.0))


def save(fig: plt.Figure, path: str | Path) -> Path:
    """Write fig (png/svg/pdf by suffix) at 120 dpi, make parent folders, close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
