"""Small-sample statistics for comparisons over seeds, and a log–log fit (Prop. 3.1's scatter).

A comparison of two objectives trained from the same seeds is *paired*: seed k of both starts
from the same weights and sees the same prompts, so the per-seed difference d_k = a_k − b_k
cancels what the two share. With the few seeds a CPU affords (5–20):

- `paired_interval` gives a Student-t interval of the mean difference, mean ± t_{n−1} · sd/√n,
  and a two-sided p-value: the exact sign-flip permutation test for n ≤ 12 (all 2^n sign
  patterns; valid for any symmetric distribution of d under the null), the t-test beyond. A
  percentile bootstrap under-covers at small n (≈ 83 % for a nominal 95 % at n = 5), so it is
  offered only from n = 20 on (`method="bootstrap"`).
- `holm` adjusts a family of p-values (Holm's step-down: controls the family-wise error rate).
- `mean_interval` is the one-sample t interval (an objective's mean over seeds).
- `seeds_needed` turns a measured sd of the paired difference into the seeds a given interval
  width needs; `detectable` is its inverse (the half-width n seeds give).

The simulation tests in tests/test_stats.py hold the coverage of these intervals at n = 5 and 10.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy.stats import t as student_t


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


def _paired(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"paired: a and b must be 1-D of one length (one value per seed), got "
                         f"{a.shape} and {b.shape}")
    bad = np.flatnonzero(~(np.isfinite(a) & np.isfinite(b)))
    if bad.size:
        raise ValueError(f"paired: non-finite value at seed index {int(bad[0])}")
    return a - b


MIN_BOOTSTRAP_N = 20  # below this a percentile bootstrap under-covers (see the module docstring)
EXACT_SIGN_FLIP_N = 12  # up to 2^12 sign patterns: the exact permutation p-value


def paired_bootstrap(a, b, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """Paired difference a − b over seeds with a percentile bootstrap interval of its mean.

    Low-level: published comparisons use `paired_interval` (a t interval); a percentile
    bootstrap covers a 95 % interval only ≈ 83 % of the time at n = 5. a, b (S,): one value per
    seed in the same seed order. Returns {"n", "mean", "lo", "hi", "sd"} (sd: ddof=1; NaN,
    undefined, with one seed). Fixed `seed`: reproducible.
    """
    d = _paired(a, b)
    if d.size == 0:
        raise ValueError("paired_bootstrap: no seeds")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, (n_boot, d.size))].mean(1)
    q = (1 - level) / 2
    return {"n": int(d.size), "mean": float(d.mean()), "lo": float(np.quantile(means, q)),
            "hi": float(np.quantile(means, 1 - q)),
            "sd": float(d.std(ddof=1)) if d.size > 1 else math.nan}


@lru_cache(maxsize=16)
def _signs(n: int) -> np.ndarray:
    """(2^n, n) every ±1 sign pattern."""
    bits = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1
    return 1.0 - 2.0 * bits


def sign_flip_p(d) -> float:
    """Exact two-sided p-value of mean(d) = 0 against all 2^n sign flips of d (n ≤ 12): the
    share of patterns whose |sum| reaches the observed one (ties counted, relative 1e-12)."""
    d = np.asarray(d, dtype=float)
    if d.ndim != 1 or not 1 <= d.size <= EXACT_SIGN_FLIP_N:
        raise ValueError(f"sign_flip_p: need 1..{EXACT_SIGN_FLIP_N} values, got shape {d.shape}")
    obs = abs(d.sum())
    sums = np.abs(_signs(d.size) @ d)
    return float((sums >= obs - 1e-12 * max(np.abs(d).sum(), 1e-300)).mean())


def _t_p(mean: float, sd: float, n: int) -> float:
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    return float(2 * student_t.sf(abs(mean) / (sd / np.sqrt(n)), n - 1))


def paired_interval(a, b, level: float = 0.95, method: str = "t", n_boot: int = 10_000,
                    seed: int = 0) -> dict:
    """Mean paired difference a − b with a `level` interval and a two-sided p-value.

    a, b (n,): one value per seed, same seed order (e.g. held-out accuracy of IBPO and of GRPO
    trained from the same seeds); n ≥ 2. method "t": mean ± t_{n−1} · sd/√n; "bootstrap":
    percentile interval of n_boot resampled means, n ≥ 20 only. p: the exact sign-flip test for
    n ≤ 12, the t-test beyond (`p_method` says which). Returns {"mean", "lo", "hi", "p", "n",
    "method", "p_method", "sd", "half_width"} in the units of a and b.
    """
    d = _paired(a, b)
    n = int(d.size)
    if n < 2:
        raise ValueError(f"paired_interval: need at least 2 paired values, got {n}")
    if not 0 < level < 1:
        raise ValueError(f"paired_interval: level must be in (0, 1), got {level}")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if method == "t":
        half = float(student_t.ppf(1 - (1 - level) / 2, n - 1)) * sd / np.sqrt(n)
        lo, hi = mean - half, mean + half
    elif method == "bootstrap":
        if n < MIN_BOOTSTRAP_N:
            raise ValueError(f"paired_interval: method='bootstrap' needs n ≥ {MIN_BOOTSTRAP_N} "
                             f"(a percentile bootstrap under-covers below), got n = {n}; use 't'")
        r = paired_bootstrap(a, b, n_boot=n_boot, level=level, seed=seed)
        lo, hi = r["lo"], r["hi"]
        half = (hi - lo) / 2
    else:
        raise ValueError(f"paired_interval: method must be 't' or 'bootstrap', got {method!r}")
    exact = n <= EXACT_SIGN_FLIP_N
    p = sign_flip_p(d) if exact else _t_p(mean, sd, n)
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "p": p, "n": n, "method": method,
            "p_method": "sign-flip (exact)" if exact else "t", "sd": sd, "half_width": float(half)}


def mean_interval(x, level: float = 0.95) -> dict:
    """One-sample t interval of the mean of x (n ≥ 2; NaNs are an error). Returns {"mean",
    "lo", "hi", "n", "sd"}; with n = 1 the interval is the value itself (sd NaN: a spread of
    one value is undefined; said by n)."""
    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise ValueError(f"mean_interval: need a 1-D array of finite values, got {x!r}")
    n, mean = int(x.size), float(x.mean())
    if n == 1:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1, "sd": math.nan}
    sd = float(x.std(ddof=1))
    half = float(student_t.ppf(1 - (1 - level) / 2, n - 1)) * sd / np.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n, "sd": sd}


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values, in input order: the k-th smallest p times (m − k + 1),
    made monotone and capped at 1. Reject at family-wise level α where adjusted ≤ α."""
    p = np.asarray(pvalues, dtype=float)
    if p.ndim != 1 or not np.all((p >= 0) & (p <= 1)):
        raise ValueError(f"holm: need a 1-D array of p-values in [0, 1], got {pvalues!r}")
    m = p.size
    order = np.argsort(p, kind="stable")
    adj_sorted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adj_sorted
    return out


def detectable(sd: float, n: int, level: float = 0.95) -> float:
    """Half-width t_{n−1} · sd/√n of a paired `level` interval with n seeds (same units as sd):
    the smallest mean difference whose interval excludes 0 at that sd."""
    if n < 2 or not sd >= 0:
        raise ValueError(f"detectable: need n ≥ 2 and sd ≥ 0, got n={n}, sd={sd}")
    return float(student_t.ppf(1 - (1 - level) / 2, n - 1)) * sd / np.sqrt(n)


def seeds_needed(sd: float, width: float, level: float = 0.95, max_n: int = 100_000) -> int:
    """Smallest number of paired seeds n ≥ 2 whose `level` interval of the mean difference,
    2·t_{n−1}·sd/√n, is narrower than `width` (same units as sd). sd: the per-seed sd of the
    paired difference (e.g. measured on gradient-identical twins, or DFPO − GSPO)."""
    if not (sd >= 0 and width > 0):
        raise ValueError(f"seeds_needed: need sd ≥ 0 and width > 0, got sd={sd}, width={width}")
    for n in range(2, max_n + 1):
        if 2 * detectable(sd, n, level) < width:
            return n
    raise ValueError(f"seeds_needed: more than {max_n} seeds for sd={sd}, width={width}")
