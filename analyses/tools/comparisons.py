"""Paired comparisons of objectives over seeds: one table for every published experiment.

Every experiment writes two files under figures/:

  <experiment>_seeds.csv  one row per (task, layout, matched, objective, seed): heldout_acc (0..1)
                          and whatever else the experiment measured per run
  comparisons.csv         one row per comparison a − b (in points):
                          experiment, task, layout, a, b, n_seeds, mean_diff, lo, hi, method,
                          p_value, p_holm, primary, matched

so that every row's mean, interval and Holm-adjusted p can be recomputed from the seeds file
(tests/test_comparisons.py does). Intervals are paired Student-t intervals over seeds and p the
exact sign-flip test up to 12 seeds (gradlab.stats.paired_interval). `primary` rows are the
comparisons an experiment declares before it runs (its PRIMARY list); Holm's adjustment runs
over the primary rows of one (experiment, matched) family. Exploratory rows carry no p_holm.
`matched` says which compute the two runs share: `generated_tokens` (what sampling costs) or
`optimizer_steps` (updates).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from gradlab.stats import holm, paired_interval

COLUMNS = ["experiment", "task", "layout", "a", "b", "n_seeds", "mean_diff", "lo", "hi",
           "method", "p_value", "p_holm", "primary", "matched"]
SEED_KEYS = ["experiment", "task", "layout", "matched", "objective", "seed"]


def compare(seeds: pd.DataFrame, pairs: list[tuple[dict, dict, bool]], value: str = "heldout_acc",
            scale: float = 100.0) -> pd.DataFrame:
    """One row per (a-selector, b-selector, primary) pair found in `seeds`.

    A selector is a dict of SEED_KEYS columns (e.g. {"task": "arithmetic", "layout": "tree",
    "matched": "generated_tokens", "objective": "ibpo"}); the two sides are paired on `seed`.
    The row's task/layout/matched are a's; a/b name the objectives, or "objective@layout" when
    the layouts differ. Pairs with fewer than 2 common seeds are skipped.
    """
    rows = []
    for sa, sb, primary in pairs:
        x = _select(seeds, sa).set_index("seed")[value]
        y = _select(seeds, sb).set_index("seed")[value]
        common = x.index.intersection(y.index).sort_values()
        if len(common) < 2:
            continue
        r = paired_interval(scale * x.loc[common].to_numpy(), scale * y.loc[common].to_numpy())
        cross = sa.get("layout") != sb.get("layout")
        rows.append({"experiment": sa["experiment"], "task": sa["task"], "layout": sa["layout"],
                     "a": _label(sa, cross), "b": _label(sb, cross), "n_seeds": r["n"],
                     "mean_diff": r["mean"], "lo": r["lo"], "hi": r["hi"], "method": r["method"],
                     "p_value": r["p"], "p_holm": np.nan, "primary": bool(primary),
                     "matched": sa["matched"]})
    return with_holm(pd.DataFrame(rows, columns=COLUMNS))


def _select(seeds: pd.DataFrame, sel: dict) -> pd.DataFrame:
    m = np.ones(len(seeds), dtype=bool)
    for k, v in sel.items():
        m &= (seeds[k] == v).to_numpy()
    return seeds[m]


def _label(sel: dict, cross: bool) -> str:
    return f"{sel['objective']}@{sel['layout']}" if cross else sel["objective"]


def with_holm(df: pd.DataFrame) -> pd.DataFrame:
    """p_holm over the primary rows of each (experiment, matched) family; NaN elsewhere."""
    df = df.copy()
    df["p_holm"] = np.nan
    df["primary"] = df["primary"].astype(bool)
    for _, idx in df[df["primary"]].groupby(["experiment", "matched"]).groups.items():
        df.loc[idx, "p_holm"] = holm(df.loc[idx, "p_value"].to_numpy(dtype=float))
    return df


def write(rows: pd.DataFrame, experiment: str, path: Path) -> pd.DataFrame:
    """Replace `experiment`'s rows of the CSV at `path` (other experiments' rows kept)."""
    old = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=COLUMNS)
    old = old[old["experiment"] != experiment]
    new = pd.concat([old, rows[COLUMNS]], ignore_index=True) if len(old) else rows[COLUMNS]
    new.to_csv(path, index=False, float_format="%.10g")
    return new


def publish(seeds: pd.DataFrame, rows: pd.DataFrame, experiment: str, out: Path,
            figures: Path) -> Path:
    """Write `<experiment>_seeds.csv` and the experiment's rows of comparisons.csv into
    `figures` when `out` lies under it (a sub-folder's experiment still feeds the one table),
    else into `out`; returns that folder."""
    dest = figures if out.resolve().is_relative_to(figures.resolve()) else out
    dest.mkdir(parents=True, exist_ok=True)
    seeds.to_csv(dest / f"{experiment}_seeds.csv", index=False)
    write(rows, experiment, dest / "comparisons.csv")
    return dest


def fmt(row: pd.Series) -> str:
    """'+4.1 [+2.2, +5.9], p 0.002 (Holm 0.03)' for a comparisons row."""
    holm_p = "" if pd.isna(row["p_holm"]) else f" (Holm {row['p_holm']:.2g})"
    return (f"{row['mean_diff']:+.1f} [{row['lo']:+.1f}, {row['hi']:+.1f}], "
            f"p {row['p_value']:.2g}{holm_p}")


def markdown(rows: pd.DataFrame) -> str:
    """The comparisons as a markdown table (primary first)."""
    if rows.empty:
        return "(no comparisons: fewer than 2 seeds)"
    t = rows.sort_values(["primary", "matched", "task", "layout"], ascending=[False, True, True, True])
    t = t.assign(**{"a − b (points) [95 % t], p": t.apply(fmt, axis=1),
                    "primary": t["primary"].map({True: "primary", False: "exploratory"})})
    return t[["task", "layout", "matched", "a", "b", "n_seeds", "a − b (points) [95 % t], p",
              "primary"]].to_markdown(index=False)


def power(rows: pd.DataFrame, half_width: float = 2.5, afford: int | None = None) -> pd.DataFrame:
    """Per comparison: the sd of its paired differences (from its own interval), the seeds a
    95 % half-width of `half_width` points needs, and the half-width at `afford` seeds."""
    from scipy.stats import t as student_t

    from gradlab.stats import detectable, seeds_needed

    out = rows[["task", "layout", "matched", "a", "b", "n_seeds"]].copy()
    q = student_t.ppf(0.975, rows["n_seeds"] - 1)
    sd = (rows["hi"] - rows["lo"]) / 2 * np.sqrt(rows["n_seeds"]) / q
    out["sd_diff"] = sd
    out["seeds_for_half_width"] = [seeds_needed(s, 2 * half_width) for s in sd]
    if afford:
        out[f"half_width_at_{afford}"] = [detectable(s, afford) for s in sd]
    return out
