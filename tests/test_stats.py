"""gradlab.stats: paired bootstrap intervals and the seed count, against known cases."""

import numpy as np
import pytest

from gradlab.stats import loglog_fit, paired_bootstrap, seeds_needed


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
