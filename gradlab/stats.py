"""Small statistics for the analyses: a log–log fit (Prop. 3.1's scatter) and paired bootstrap
intervals over seeds (an objective against a baseline trained from the same seeds). Pure numpy.
"""

from __future__ import annotations

import numpy as np


def loglog_fit(x, y) -> dict:
    """Least-squares line log10 y = a + b log10 x over the pairs with x, y > 0 and finite.

    Returns {"n", "slope" b, "intercept" a, "r2", "ratio_median", "ratio_q05", "ratio_q95"}
    (ratio = y / x). On Prop. 3.1's scatter (x predicted, y measured KL) the proposition holds
    where slope ≈ 1 and the ratios ≈ 1. Fewer than 2 usable pairs → NaNs (n says how many).
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"loglog_fit: x and y differ in shape, {x.shape} vs {y.shape}")
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    lx, ly = np.log10(x[ok]), np.log10(y[ok])
    out = {"n": int(ok.sum()), "slope": np.nan, "intercept": np.nan, "r2": np.nan,
           "ratio_median": np.nan, "ratio_q05": np.nan, "ratio_q95": np.nan}
    if out["n"] >= 1:
        r = y[ok] / x[ok]
        out.update(ratio_median=float(np.median(r)), ratio_q05=float(np.quantile(r, 0.05)),
                   ratio_q95=float(np.quantile(r, 0.95)))
    if out["n"] >= 2 and np.ptp(lx) > 0:
        b, a = np.polyfit(lx, ly, 1)
        resid = ly - (a + b * lx)
        ss = ((ly - ly.mean()) ** 2).sum()
        out.update(slope=float(b), intercept=float(a),
                   r2=float(1 - (resid ** 2).sum() / ss) if ss > 0 else np.nan)
    return out
