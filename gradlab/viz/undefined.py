"""Why a stored ratio is NaN: the reason a table prints beside its "—"
(docs/concepts/shared-nodes.md#undefined-is-nan-not-0).

The store holds null for a ratio whose denominator is 0, with the reason derived here (and
nothing for one that was not measured); both read back as NaN, the reason in `load_run`'s
`undefined` column. The sums and counts a ratio is made of stay in the record, so the reason
is recomputed here from them, per step:

    ρ (rho_prefix, rho_trie, rho_full)  no full-group token / no shared token  (node count 0)
                                        no gradient: every group tied          (Σ scale = 0 and
                                                                                every group's
                                                                                rewards equal)
                                        no gradient at shared tokens           (Σ scale = 0)
    tax_share, tax_cos                  no gradient (: every group tied)       (‖g‖ = 0)
    tax_cos                             no tax gradient                        (‖g_tax‖ = 0)
    anything                            non-finite W                           (a NaN sum)
                                        not measured                           (no value stored)

Gradlab's loop stores n_shared_<kind> and scale_<kind>; the TRL integration nodes_<kind> and
mass_<kind> (at full-group nodes the scale is the mass, and at trie nodes it is 0 exactly when
the mass is).
"""

from __future__ import annotations

import math

import pandas as pd

NOT_MEASURED = "not measured"
TIED = "no gradient: every group tied"
NO_GRAD_SHARED = "no gradient at shared tokens"
NO_GRAD = "no gradient"
NON_FINITE = "non-finite W"
NO_TAX = "no tax gradient (g_tax = 0)"
NO_NODE = {"prefix": "no full-group token", "full": "no full-group token",
           "trie": "no shared token"}


def _get(row: pd.Series, *names: str) -> float | None:
    for n in names:
        if n in row and not pd.isna(row[n]):
            return float(row[n])
    return None


def _rho_reason(row: pd.Series, kind: str) -> str:
    nodes = _get(row, f"n_shared_{kind}", f"nodes_{kind}")
    scale = _get(row, f"scale_{kind}", f"mass_{kind}")
    if nodes is None:
        return NOT_MEASURED
    if nodes == 0:
        return NO_NODE.get(kind, "no shared token")
    if scale is None:
        return NON_FINITE  # nodes counted, their sum NaN
    if scale == 0:
        return TIED if _get(row, "zero_std_share") == 1 else NO_GRAD_SHARED
    return NOT_MEASURED


def step_reason(row: pd.Series, metric: str) -> str | None:
    """Why `metric` is NaN at one step: `row` holds that step's metrics (a row of the wide
    table, `load_run(..., wide=True)`, or a pivot of the tidy one). None where it has a value."""
    v = row.get(metric)
    if v is not None and not pd.isna(v):
        return None
    if metric.startswith("rho_"):  # rho_prefix, rho_trie: the residual's nodes
        return _rho_reason(row, metric[len("rho_"):].split("_")[0])
    if metric in ("tax_share", "tax_cos") or metric.startswith("tax_share/"):
        g = _get(row, "total_norm")
        if g == 0:
            return TIED if _get(row, "zero_std_share") == 1 else NO_GRAD
        if metric == "tax_cos" and _get(row, "tax_norm") == 0:
            return NO_TAX
    return NOT_MEASURED


def reason(wide: pd.DataFrame, metric: str) -> str:
    """Why `metric` has no value over all the steps of `wide` (one objective's steps, a column
    per metric): the most frequent step reason, a measured cause before "not measured"."""
    if metric not in wide:
        return NOT_MEASURED
    whys = [step_reason(r, metric) for _, r in wide.iterrows()]
    causes = [w for w in whys if w is not None and w != NOT_MEASURED]
    if not causes:
        return NOT_MEASURED
    return max(dict.fromkeys(causes), key=causes.count)  # ties: the first step's


class Footnotes:
    """Markers for the reasons of the "—" cells of one table: `cell` returns "—¹", "—²", ...
    (one marker per distinct reason, in order of first use); `legend` lists them."""

    MARKS = "¹²³⁴⁵⁶⁷⁸⁹"

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def cell(self, value: float | None, why: str, fmt=lambda x: f"{x:.3g}") -> str:
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            return fmt(value)
        if why not in self.reasons:
            self.reasons.append(why)
        i = self.reasons.index(why)
        return "—" + (self.MARKS[i] if i < len(self.MARKS) else f"({why})")

    def legend(self) -> str:
        """One line per reason: "—¹ undefined: no gradient: every group tied"."""
        return "\n".join(f"—{self.MARKS[i]} {_say(w)}" for i, w in enumerate(self.reasons)
                         if i < len(self.MARKS))


def _say(why: str) -> str:
    return why if why == NOT_MEASURED else f"undefined ({why})"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.3g}"


def text_table(wide: pd.DataFrame, cols: list[str], fmt=_num) -> str:
    """Plain-text table of `cols` of a wide run table (one row per step, e.g.
    `load_run(..., wide=True)`), right-aligned, text columns as they are; a NaN cell is "—"
    with a footnote marker whose reason (`step_reason` of that row) is listed under the table."""
    notes = Footnotes()
    body = [[str(r[c]) if isinstance(r.get(c), str) else
             notes.cell(r[c], step_reason(r, c), fmt) if c in r else "—" for c in cols]
            for _, r in wide.iterrows()]
    width = [max(len(c), *(len(b[i]) for b in body)) if body else len(c)
             for i, c in enumerate(cols)]
    lines = [" ".join(c.rjust(w) for c, w in zip(cols, width))]
    lines += [" ".join(v.rjust(w) for v, w in zip(b, width)) for b in body]
    legend = notes.legend()
    return "\n".join(lines) + ("\n" + legend if legend else "")
