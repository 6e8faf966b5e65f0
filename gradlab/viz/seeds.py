"""Seeds on a common axis: runs of one objective consume different numbers of tokens."""

from __future__ import annotations

import numpy as np
import pandas as pd


def align_tokens(tidy: pd.DataFrame, n: int = 40) -> pd.DataFrame:
    """Put every (run, objective, seed) curve on one token grid per objective by linear
    interpolation, so seeds can be averaged at equal compute (tokens differ with response
    lengths). Grid: n points from the largest first-step count to the smallest final count
    over the objective's runs. Same tidy columns; `tokens` becomes the grid value.
    """
    out = []
    for obj, d in tidy.dropna(subset=["value"]).groupby("objective", sort=False):
        ends = d.groupby(["run", "seed"])["tokens"].agg(["min", "max"])
        lo, hi = float(ends["min"].max()), float(ends["max"].min())
        grid = np.linspace(lo, hi, n) if hi > lo else np.array([hi])
        for (run, seed, metric), c in d.groupby(["run", "seed", "metric"]):
            c = c.sort_values("tokens")
            v = np.interp(grid, c["tokens"].to_numpy(float), c["value"].to_numpy(float))
            out.append(pd.DataFrame({"run": run, "objective": obj, "seed": seed, "step": np.nan,
                                     "tokens": grid, "metric": metric, "value": v}))
    return pd.concat(out, ignore_index=True) if out else tidy.iloc[:0]
