"""Cancellation residuals per shared node, from token traces, and their distribution.

At a node n (a set S_n of rows sharing a token at position t, docs/concepts/shared-nodes.md) the traced W give
the net coefficient Σ_{i∈S_n} W_i and the mass Σ|W_i|; at full-group nodes the exact residual
is the net coefficient (the exchangeable reference c* is 0 there). At a trie node that is not
full, the reference is not 0: this table reports the net coefficient only — use
gradlab.cancellation for d = c − c* (our choice: traces carry W, not the reference).
"""

from __future__ import annotations

import pandas as pd
import seaborn as sns

from .curves import plt

KEYS = ["objective", "step", "opt_step"]


def node_residuals(traces: pd.DataFrame, kind: str = "prefix") -> pd.DataFrame:
    """One row per node of `kind` ("prefix" | "trie") in the traces: objective, step, opt_step,
    node, group, position, size, net (Σ W), mass (Σ|W|), rel = |net| / mass (NaN when mass is
    0: W ≡ 0 at the node, e.g. a tied group, where nothing cancels or fails to)."""
    if kind not in ("prefix", "trie"):
        raise ValueError(f"node_residuals: kind={kind!r}; valid: prefix, trie")
    col = f"{kind}_node"
    t = traces[traces[col] >= 0].assign(absW=lambda d: d["W"].abs())
    out = t.groupby(KEYS + [col], sort=False).agg(
        group=("group", "first"), position=("position", "first"), size=("row", "size"),
        net=("W", "sum"), mass=("absW", "sum")).reset_index().rename(columns={col: "node"})
    out["rel"] = out["net"].abs() / out["mass"].where(out["mass"] > 0)  # mass 0: NaN
    return out


def residual_distribution(traces: pd.DataFrame, kind: str = "prefix",
                          floor: float = 1e-9) -> plt.Figure:
    """Per objective, the distribution of |Σ_i W| / Σ|W| over the traced nodes (log axis; values
    under `floor`, float round-off of an exact cancellation, drawn at the floor, band shaded).
    Nodes where it is undefined (W ≡ 0) are not drawn; the axis label counts them."""
    nodes = node_residuals(traces, kind)
    undefined = int(nodes["rel"].isna().sum())
    nodes = nodes[nodes["rel"].notna()]
    nodes["rel_shown"] = nodes["rel"].clip(lower=floor)
    fig, ax = plt.subplots(figsize=(7, 0.6 * max(2, nodes["objective"].nunique()) + 1.2))
    if len(nodes):
        sns.stripplot(data=nodes, x="rel_shown", y="objective", hue="objective", size=4,
                      jitter=0.25, ax=ax, legend=False, log_scale=True)
    ax.axvspan(floor / 10, floor, color="0.85", zorder=0, label="float round-off")
    ax.set_xlim(left=floor / 10)
    ax.set_xlabel(f"|Σ_i W| / Σ|W| at {'full-group' if kind == 'prefix' else 'trie'} nodes "
                  "(0 = exact cancellation)" + (f"; {undefined} nodes undefined (W ≡ 0, not "
                                                "drawn)" if undefined else ""))
    ax.set_ylabel("")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
