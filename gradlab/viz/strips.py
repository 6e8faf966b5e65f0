"""Token strips (Figure 2's drawing): one group's responses token by token, W under each token.

Input: a *strip table*, one row per (panel, row, position) with columns panel, row, position,
char, shared ("full" | "subset" | "none"), W, advantage, reward, and optionally clip_frac;
`strip_table(traces, ...)` makes one from token traces (gradlab.load_traces), so a strip shows W
as the step measured it. frame.attrs may carry "rho" {panel: ρ}, "prompt" and "caption".
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .curves import plt

COLORS = {"full": "#4C72B0", "subset": "#A6C8E8", "none": "#F28E2B"}

# docs/concepts/dfpo.md#one-gradient-for-every-transform-at-full-group-nodes: the consequence drawn under every strip figure.
CAPTION = ("At full-group nodes every DFPO transform (Min-Replace, Orth-Proj, any clip reading) "
           "gives the same parameter gradient: the node adds (Σ_i A_i w̃_i)·∇l = 0. "
           "The W strips differ; the step does not.")


def strip_table(traces: pd.DataFrame, step: int | None = None, group: int | None = None,
                objectives: list[str] | None = None, opt_step: int | None = None) -> pd.DataFrame:
    """The strip table of one traced group: panels = objectives (same step and group label).

    Defaults: the first traced step; the group (a rule, not a pick) with mixed rewards whose
    largest relative residual |Σ_i W| / Σ|W| at a full-group node, over the objectives, is
    largest — where the objectives differ — then the most full-group tokens; every objective. Under a tandem the groups of step 0 are the same
    samples for every objective, so the panels compare objectives on identical tokens.
    """
    t = traces
    step = int(t["step"].min()) if step is None else step
    t = t[t["step"] == step]
    if objectives is not None:
        t = t[t["objective"].isin(objectives)]
    if t.empty:
        raise ValueError(f"strip_table: no traced tokens at step={step}")
    if group is None:
        group = _telling_group(t)
    t = t[t["group"] == group]
    if opt_step is not None:
        t = t[t["opt_step"] == opt_step]
    if t.empty:
        raise ValueError(f"strip_table: no traced tokens at step={step}, group={group}")
    shared = np.where(t["prefix_node"] >= 0, "full", np.where(t["trie_node"] >= 0, "subset",
                                                               "none"))
    df = pd.DataFrame({
        "panel": t["objective"].to_numpy(), "objective": t["objective"].to_numpy(),
        "row": t["row"].to_numpy(), "position": t["position"].to_numpy(),
        "char": [("␣" if c == " " else c) for c in t["text"]], "shared": shared,
        "W": t["W"].to_numpy(), "advantage": t["A"].to_numpy(), "reward": np.nan,
        "clip_frac": t.groupby("objective")["clip"].transform("mean").to_numpy(),
    })
    df.attrs.update(step=step, group=group, rho=node_rho(df))
    return df


def _telling_group(t: pd.DataFrame) -> int:
    """The default group of `strip_table` (see there)."""
    full = t[t["prefix_node"] >= 0].assign(absW=lambda d: d["W"].abs())
    mixed = t.groupby("group")["A"].apply(lambda a: bool((a != 0).any()))
    n_full = (t["prefix_node"] >= 0).groupby(t["group"]).sum()
    nodes = full.groupby(["objective", "group", "opt_step", "prefix_node"])[["W", "absW"]].sum()
    rel = (nodes["W"].abs() / nodes["absW"].where(nodes["absW"] > 0)).fillna(0)
    worst = rel.groupby(level="group").max().reindex(n_full.index, fill_value=0)
    score = pd.DataFrame({"mixed": mixed, "worst": worst, "n": n_full}).fillna(0)
    return int(score.sort_values(["mixed", "worst", "n"], ascending=False).index[0])


def node_rho(df: pd.DataFrame) -> dict:
    """ρ of the shown group per panel: Σ_n |Σ_i W| / Σ_n Σ|W| over full-group positions; NaN
    (undefined) where W ≡ 0 there (a tied group) or the panel has no full-group position."""
    s = group_sums(df)
    out = {p: float(d["sum"].abs().sum() / d["mass"].sum()) if d["mass"].sum() > 0 else np.nan
           for p, d in s.groupby("panel", sort=False)}
    return {p: out.get(p, np.nan) for p in dict.fromkeys(df["panel"])}


def _rho_text(rho: float, has_nodes: bool) -> str:
    """"ρ = 0.12", or "ρ = — (…)" with the reason where it is undefined."""
    if not np.isnan(rho):
        return f"ρ = {rho:.2g}"
    return "ρ = — (" + ("no gradient at shared tokens" if has_nodes else "no full-group token") + ")"


def group_sums(df: pd.DataFrame) -> pd.DataFrame:
    """Σ_i W_{i,t} over the group at each full-group shared position: panel, position, char,
    sum, mass (Σ|W|). From the W in `df` only."""
    d = df[df["shared"] == "full"].copy()
    d["absW"] = d["W"].abs()
    return d.groupby(["panel", "position"], sort=False).agg(
        char=("char", "first"), sum=("W", "sum"), mass=("absW", "sum")).reset_index()


def token_strips(df: pd.DataFrame, title: str | None = None, caption: str | None = CAPTION,
                 ncols: int = 2) -> plt.Figure:
    """Panels of token strips: colour = shared kind, W (scaled) under each token, Σ_i W row.

    df: a strip table (module docstring). caption: text under the strips (default: the consequence in docs/concepts/dfpo.md,
    consequence for DFPO transforms at full-group nodes; None = none).
    """
    scale = 10.0 ** -np.floor(np.log10(df["W"].abs().max() or 1.0))
    sums = group_sums(df)
    panels = list(dict.fromkeys(df["panel"]))
    G, T = int(df["row"].max()) + 1, int(df["position"].max()) + 1
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(0.62 * T * ncols + 2, 0.7 * (G + 2) * nrows + 0.6),
                             squeeze=False)
    rho = df.attrs.get("rho", {})
    for ax, p in zip(axes.flat, panels):
        s = sums[sums["panel"] == p]
        _panel(ax, df[df["panel"] == p], s, scale, G, T)
        top = s["sum"].abs().max() if len(s) else 0.0
        clip = df[df["panel"] == p]["clip_frac"].iloc[0] if "clip_frac" in df else np.nan
        ax.set_title(f"{p}\nmax |Σ_i W| at shared tokens = {top:.1e}  "
                     f"({_rho_text(rho.get(p, np.nan), len(s) > 0)}, clip frac {clip:.3f})",
                     fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title or f"Measured W (×{scale:.0e}): blue = shared by the whole group, light blue "
                 "= by a subset, orange = divergent", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 if caption else 0, 1, 1))
    if caption:
        fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=9, wrap=True, style="italic")
    return fig


def _panel(ax, d: pd.DataFrame, s: pd.DataFrame, scale: float, G: int, T: int) -> None:
    for r in d.itertuples():
        y = -r.row * 1.1
        ax.add_patch(plt.Rectangle((r.position, y), 0.92, 0.55, color=COLORS[r.shared]))
        ax.text(r.position + 0.46, y + 0.27, r.char, ha="center", va="center",
                fontsize=6 if r.char == "EOS" else 9, color="white" if r.shared == "full" else "k")
        w = "0" if r.W == 0 else f"{r.W * scale:+.2f}"  # exactly 0: clipped / min-replaced
        ax.text(r.position + 0.46, y - 0.2, w, ha="center", va="center", fontsize=6)
    for i, a in d.groupby("row")[["advantage", "reward"]].first().iterrows():
        label = f"A={a.advantage:+.2f}" + ("" if np.isnan(a.reward) else f" R={a.reward:.0f}")
        ax.text(-0.3, -i * 1.1 + 0.27, label, ha="right", va="center", fontsize=7)
    y = -G * 1.1 - 0.1
    ax.text(-0.3, y, "Σ_i W", ha="right", va="center", fontsize=8, weight="bold")
    for r in s.itertuples():
        v = "0" if r.sum == 0 else f"{r.sum * scale:+.2f}"
        ax.text(r.position + 0.46, y, v, ha="center", va="center",
                fontsize=7, weight="bold", color=COLORS["full"])
    ax.set_xlim(-3.2, T + 0.2)
    ax.set_ylim(y - 0.5, 0.8)
    ax.axis("off")
