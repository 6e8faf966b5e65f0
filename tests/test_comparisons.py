"""Published comparisons: every row of figures/comparisons.csv recomputes from its seeds file;
the table builder pairs by seed, adjusts primary families with Holm and skips what it cannot pair."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analyses.tools import comparisons
from gradlab.stats import holm, paired_interval

FIGURES = Path(__file__).resolve().parents[1] / "figures"


def _seeds(n=6):
    rng = np.random.default_rng(0)
    rows = []
    for layout in ("independent", "tree"):
        base = rng.uniform(0.3, 0.6, n)
        for obj, shift in (("grpo", 0.0), ("gspo", 0.01), ("ibpo", 0.04)):
            for k in range(n):
                rows.append({"experiment": "demo", "task": "arithmetic", "layout": layout,
                             "matched": "generated_tokens", "objective": obj, "seed": k,
                             "heldout_acc": base[k] + shift + rng.normal(0, 0.01)})
    return pd.DataFrame(rows)


def test_compare_pairs_by_seed_and_adjusts_the_primary_family():
    s = _seeds()
    key = dict(experiment="demo", task="arithmetic", matched="generated_tokens")
    pairs = [({**key, "layout": lay, "objective": a}, {**key, "layout": lay, "objective": b}, True)
             for lay in ("independent", "tree") for a, b in (("ibpo", "grpo"), ("ibpo", "gspo"))]
    pairs.append(({**key, "layout": "tree", "objective": "ibpo"},
                  {**key, "layout": "independent", "objective": "ibpo"}, False))
    pairs.append(({**key, "layout": "tree", "objective": "absent"},
                  {**key, "layout": "tree", "objective": "gspo"}, True))  # skipped: no seeds
    rows = comparisons.compare(s, pairs)
    assert list(rows.columns) == comparisons.COLUMNS and len(rows) == 5
    first = rows.iloc[0]
    x = s[(s.layout == "independent") & (s.objective == "ibpo")]["heldout_acc"].to_numpy()
    y = s[(s.layout == "independent") & (s.objective == "grpo")]["heldout_acc"].to_numpy()
    r = paired_interval(100 * x, 100 * y)
    assert (first.mean_diff, first.lo, first.hi, first.p_value) == pytest.approx(
        (r["mean"], r["lo"], r["hi"], r["p"]))
    prim = rows[rows.primary]
    assert prim.p_holm.to_numpy() == pytest.approx(holm(prim.p_value.to_numpy()))
    cross = rows[~rows.primary].iloc[0]
    assert np.isnan(cross.p_holm) and (cross.a, cross.b) == ("ibpo@tree", "ibpo@independent")
    # a shift of 3-4 points with 1-point noise: the exact sign-flip p is its floor 2/64
    assert first.p_value == pytest.approx(2 / 64) and first.lo > 0


def test_power_recovers_the_sd_of_the_differences():
    s = _seeds(8)
    key = dict(experiment="demo", task="arithmetic", matched="generated_tokens", layout="tree")
    rows = comparisons.compare(s, [({**key, "objective": "ibpo"}, {**key, "objective": "grpo"}, True)])
    d = 100 * (s[(s.layout == "tree") & (s.objective == "ibpo")]["heldout_acc"].to_numpy()
               - s[(s.layout == "tree") & (s.objective == "grpo")]["heldout_acc"].to_numpy())
    p = comparisons.power(rows, half_width=0.5, afford=20)
    assert p["sd_diff"].iloc[0] == pytest.approx(d.std(ddof=1))
    assert p["seeds_for_half_width"].iloc[0] >= 2 and p["half_width_at_20"].iloc[0] > 0


def _side(label: str, row: pd.Series) -> dict:
    obj, _, layout = label.partition("@")
    return {"experiment": row.experiment, "task": row.task, "matched": row.matched,
            "layout": layout or row.layout, "objective": obj}


def test_published_comparisons_recompute_from_their_seeds_files():
    path = FIGURES / "comparisons.csv"
    table = pd.read_csv(path)
    assert list(table.columns) == comparisons.COLUMNS and len(table)
    assert set(table["method"]) == {"t"} and set(table["matched"]) <= {"generated_tokens",
                                                                       "optimizer_steps"}
    for exp, rows in table.groupby("experiment"):
        seeds = pd.read_csv(FIGURES / f"{exp}_seeds.csv")
        pairs = [(_side(r.a, r), _side(r.b, r), bool(r.primary)) for r in rows.itertuples()]
        again = comparisons.compare(seeds, pairs)
        assert len(again) == len(rows), exp
        for col in ("mean_diff", "lo", "hi", "p_value", "p_holm"):
            assert again[col].to_numpy() == pytest.approx(rows[col].to_numpy(), rel=1e-4,
                                                          abs=1e-6, nan_ok=True), (exp, col)


@pytest.mark.parametrize("md, experiments", [
    ("figure3.md", {"figure3"}), ("scaffold/figure3.md", {"figure3-scaffold"}),
    ("ablations.md", {"ablations", "figure3"}),
    ("scaffold/ablations.md", {"ablations-scaffold", "figure3-scaffold"})])
def test_every_published_held_out_difference_is_a_row(md, experiments):
    """One row per published comparison: each held-out − GSPO interval of Figure 3's and
    Tables 2 and 3's tables prints as a row of comparisons.csv of its experiments."""
    from analyses.tools.quoted import PATTERNS, near

    table = pd.read_csv(FIGURES / "comparisons.csv")
    rows = table[table["experiment"].isin(experiments)]
    cells = []
    for line in (FIGURES / md).read_text().splitlines():
        cols = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and any("held-out" in c and "−" in c for c in cols):
            which = [i for i, c in enumerate(cols) if "held-out" in c and "−" in c]
        elif line.startswith("|") and "---" not in line:
            cells += [cols[i] for i in which if PATTERNS["interval"].search(cols[i])]
    assert len(cells) >= 3, md
    for cell in cells:
        m, lo, hi, p = PATTERNS["interval"].search(cell).groups()
        hit = (near(m, rows["mean_diff"].to_numpy()) & near(lo, rows["lo"].to_numpy())
               & near(hi, rows["hi"].to_numpy()) & near(p, rows["p_value"].to_numpy()))
        assert hit.any(), f"{md}: '{cell}' has no row in comparisons.csv ({sorted(experiments)})"
