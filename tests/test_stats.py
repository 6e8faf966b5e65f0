"""gradlab.stats: small-sample intervals (coverage by simulation), p-values, Holm, the seed count."""

import numpy as np
import pytest
from scipy import stats as sps

from gradlab.stats import (
    detectable,
    holm,
    loglog_fit,
    mean_interval,
    paired_bootstrap,
    paired_interval,
    seeds_needed,
    sign_flip_p,
)


def test_two_seeds_exact_distribution():
    # d = (−1, +1): bootstrap means are −1, 0, +1 with probabilities ¼, ½, ¼ → interval [−1, 1]
    r = paired_bootstrap([0.5, 0.7], [1.5, -0.3])
    assert r["n"] == 2 and r["mean"] == 0.0 and (r["lo"], r["hi"]) == (-1.0, 1.0)
    assert r["sd"] == pytest.approx(np.sqrt(2))


def test_constant_difference_and_pairing():
    rng = np.random.default_rng(0)
    b = rng.uniform(0.2, 0.8, 6)  # large seed-to-seed spread, shared by both
    r = paired_bootstrap(b + 0.03, b)
    assert r["lo"] == pytest.approx(0.03) and r["hi"] == pytest.approx(0.03) and r["sd"] < 1e-12
    # unpaired, the same numbers would give a wide interval: pairing is what makes it narrow
    rng2 = np.random.default_rng(1)
    unpaired = (b + 0.03)[rng2.permutation(6)]
    assert paired_bootstrap(unpaired, b)["hi"] - paired_bootstrap(unpaired, b)["lo"] > 0.1


def test_large_sample_matches_normal_interval():
    rng = np.random.default_rng(2)
    d = rng.normal(0.02, 0.05, 400)
    r = paired_bootstrap(d, np.zeros_like(d), n_boot=20_000)
    half = 1.959964 * d.std(ddof=1) / np.sqrt(d.size)
    assert r["mean"] - r["lo"] == pytest.approx(half, rel=0.05)
    assert r["hi"] - r["mean"] == pytest.approx(half, rel=0.05)
    assert paired_bootstrap(d, 0 * d) == paired_bootstrap(d, 0 * d)  # fixed seed


def test_seeds_needed_known_values():
    # t_{0.975, 9} = 2.262: sd 1, n = 10 → width 2·2.262/√10 = 1.4307
    assert seeds_needed(1.0, 1.431) == 10 and seeds_needed(1.0, 1.430) == 11
    # large n: ≈ (2·1.96·sd/width)² — sd 3 points, width 5 points → 5.53 → ~9 with t
    assert seeds_needed(3.0, 5.0) == 9
    assert seeds_needed(0.0, 1.0) == 2


def test_bad_input():
    with pytest.raises(ValueError, match="one length"):
        paired_bootstrap([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="seed index 1"):
        paired_bootstrap([1, np.nan], [1, 2])
    with pytest.raises(ValueError, match="width"):
        seeds_needed(1.0, 0.0)


def test_loglog_fit_recovers_a_power_law():
    x = np.geomspace(1e-8, 1e-3, 30)
    f = loglog_fit(x, 2 * x ** 1.5)
    assert f["slope"] == pytest.approx(1.5) and f["intercept"] == pytest.approx(np.log10(2))
    assert f["r2"] == pytest.approx(1.0) and f["n"] == 30
    assert loglog_fit([1.0, -1.0], [1.0, 1.0])["n"] == 1  # non-positive pairs dropped


# --------------------------------------------------------------------------- small-sample intervals
SIMS = 3000  # SE of a 95 % coverage estimate: 0.4 %; the bands below are ≥ 5 SE wide


def _coverage(draw, n: int, truth: float, method: str = "t", seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(SIMS):
        d = draw(rng, n)
        r = paired_interval(d, np.zeros(n), method=method) if method == "t" else \
            paired_bootstrap(d, np.zeros(n), n_boot=400, seed=int(rng.integers(1 << 30)))
        hits += r["lo"] <= truth <= r["hi"]
    return hits / SIMS


@pytest.mark.parametrize("n", [5, 10])
def test_t_interval_covers_95_percent_of_normal_differences(n):
    cov = _coverage(lambda r, n: r.normal(1.5, 4.0, n), n, 1.5, seed=n)
    assert 0.93 <= cov <= 0.97, cov


def test_t_interval_covers_a_skewed_difference():
    # gamma(shape 4): skewness 1; shifted to mean 0.3
    cov = _coverage(lambda r, n: r.gamma(4.0, 1.0, n) - 3.7, 10, 0.3, seed=11)
    assert cov >= 0.92, cov


def test_percentile_bootstrap_undercovers_at_five_seeds():
    # the reason published intervals are t intervals: the same simulation, the bootstrap misses
    cov = _coverage(lambda r, n: r.normal(0.0, 1.0, n), 5, 0.0, method="bootstrap", seed=5)
    assert cov < 0.89, cov


def test_null_rejection_rate_at_ten_seeds():
    rng = np.random.default_rng(3)
    rejected = np.mean([paired_interval(rng.normal(0, 2, 10), np.zeros(10))["p"] <= 0.05
                        for _ in range(SIMS)])
    assert 0.03 <= rejected <= 0.065, rejected


def test_t_interval_against_scipy_and_hand_values():
    a, b = np.array([52.0, 49.5, 55.0, 51.0, 47.5]), np.array([50.0, 50.0, 51.0, 48.0, 46.0])
    r = paired_interval(a, b)
    d = a - b
    half = sps.t.ppf(0.975, 4) * d.std(ddof=1) / np.sqrt(5)
    assert r["mean"] == pytest.approx(d.mean()) and r["half_width"] == pytest.approx(half)
    assert (r["lo"], r["hi"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert r["n"] == 5 and r["method"] == "t" and r["p_method"].startswith("sign-flip")
    # d = (2, −0.5, 4, 3, 1.5): |sum| = 10 is reached by the identity and by flipping only the
    # −0.5 (|sum| 11), and by their two mirror images: 4 of 32 patterns
    assert r["p"] == pytest.approx(4 / 32)
    big = paired_interval(np.arange(30.0) % 7, np.zeros(30))  # n > 12: the t-test
    t_stat = (np.arange(30.0) % 7).mean() / ((np.arange(30.0) % 7).std(ddof=1) / np.sqrt(30))
    assert big["p_method"] == "t" and big["p"] == pytest.approx(2 * sps.t.sf(t_stat, 29))


def test_sign_flip_exact_distribution():
    # all differences positive: only the identity and its mirror reach the observed |sum|
    assert sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)
    assert sign_flip_p([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError, match="1..12"):
        sign_flip_p(np.ones(13))


def test_holm_known_values_and_order():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04 → ×4, ×3, ×2, ×1 = 0.02, 0.03, 0.06, 0.04 → monotone 0.06
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]).size == 0
    with pytest.raises(ValueError, match="p-values"):
        holm([0.1, 1.5])


def test_mean_interval_and_detectable():
    x = np.array([0.50, 0.55, 0.47, 0.52])
    r = mean_interval(x)
    half = sps.t.ppf(0.975, 3) * x.std(ddof=1) / 2
    assert (r["lo"], r["hi"]) == pytest.approx((x.mean() - half, x.mean() + half))
    one = mean_interval([0.4])  # the spread of one value is undefined: NaN, not 0
    assert {k: v for k, v in one.items() if k != "sd"} == {"mean": 0.4, "lo": 0.4, "hi": 0.4,
                                                          "n": 1}
    assert np.isnan(one["sd"]) and np.isnan(paired_bootstrap([0.5], [0.25])["sd"])
    assert detectable(4.0, 10) == pytest.approx(sps.t.ppf(0.975, 9) * 4 / np.sqrt(10))
    assert 2 * detectable(1.0, seeds_needed(1.0, 1.0)) < 1.0


def test_paired_interval_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        paired_interval([1.0], [0.0])
    with pytest.raises(ValueError, match="n ≥ 20"):
        paired_interval(np.ones(5), np.zeros(5), method="bootstrap")
    with pytest.raises(ValueError, match="'t' or 'bootstrap'"):
        paired_interval(np.ones(5), np.zeros(5), method="bca")
    with pytest.raises(ValueError, match="seed index 2"):
        paired_interval([1, 2, np.inf], [0, 0, 0])
    r = paired_interval(np.arange(25.0), np.zeros(25), method="bootstrap")
    assert r["lo"] < 12 < r["hi"] and r["method"] == "bootstrap"
