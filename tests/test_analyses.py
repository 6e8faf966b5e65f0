"""The analysis scripts in quick mode (seconds each), and their helpers."""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analyses import ablations, common, figure2, figure3, prop31  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.1M-parameter model: 2 contended threads are far slower
    yield
    torch.set_num_threads(n)


def test_figure2_measured_sums(tmp_path):
    out = tmp_path / "f2.png"
    assert figure2.main(["--quick", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    df = pd.read_csv(out.with_suffix(".csv"))
    assert list(dict.fromkeys(df["panel"])) == [t for t, _, _ in figure2.PANELS]
    assert {"full", "none"} <= set(df["shared"])  # a shared prefix and divergent tokens
    assert df.groupby("panel")["reward"].nunique().min() == 2  # mixed rewards
    sums = figure2.group_sums(df).groupby("panel")[["sum", "mass"]].agg(
        lambda s: s.abs().max())
    grpo, gspo, dmin, dorth = (sums.loc[t] for t, _, _ in figure2.PANELS)
    assert grpo["mass"] > 0 and grpo["sum"] <= 1e-6 * grpo["mass"]  # cancels
    assert gspo["sum"] >= 1e-2 * gspo["mass"]  # does not
    assert dmin["sum"] <= 1e-6 * max(dmin["mass"], 1e-12)
    assert dorth["mass"] > 0 and dorth["sum"] <= 1e-6 * dorth["mass"]
    # "no clip active" for the GRPO panel: W ≠ 0 on every token of the shown group
    g = df[df["panel"] == figure2.PANELS[0][0]]
    assert (g["W"] != 0).all()
    # drawn by gradlab.viz, with MATH.md §5's caption under the strips
    from gradlab.viz import CAPTION
    fig = figure2.draw(df)
    assert CAPTION in [t.get_text() for t in fig.texts] and "(Σ_i A_i w̃_i)·∇l = 0" in CAPTION


def test_figure3_quick(tmp_path):
    runs = tmp_path / "runs"
    assert figure3.main(["--quick", "--runs", str(runs), "--out", str(tmp_path)]) == 0
    for f in ("figure3.png", "figure3_diagnostics.png", "figure3.csv"):
        assert (tmp_path / f).stat().st_size > 0, f
    tidy = pd.read_csv(tmp_path / "figure3.csv")
    assert list(tidy.columns) == ["run", "objective", "seed", "step", "tokens", "metric", "value"]
    assert set(tidy["objective"]) == set(figure3.OBJECTIVES)
    assert set(tidy["seed"]) == {0, 1}
    assert {m for m, _ in figure3.MAIN + figure3.BEYOND} <= set(tidy["metric"])
    # finished seeds are reused, not retrained
    before = (runs / "seed0" / "metrics.jsonl").stat().st_mtime_ns
    common.run_seeds(runs, [0], objectives=figure3.OBJECTIVES, **common.QUICK)
    assert (runs / "seed0" / "metrics.jsonl").stat().st_mtime_ns == before


def test_ablations_quick(tmp_path):
    assert ablations.main(["--quick", "--runs", str(tmp_path), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "ablations.md").read_text()
    for label, _ in ablations.TABLE2.values():
        assert label in md
    for G in ablations.GROUP_SIZES:
        assert f"|  {G:>2} |" in md or f"| {G:>3} |" in md
    long = pd.read_csv(tmp_path / "ablations.csv")
    assert len(long[long["table"] == "table2"]) == 4 * 2 * 2  # variants × seeds × metrics
    assert len(long[long["table"] == "table3"]) == 4 * 2 * 2 * 2  # G × objectives × seeds × m
    assert long["value"].between(0, 1).all()


def test_bootstrap_ci():
    assert common.bootstrap_ci([0.3, 0.3, 0.3]) == (0.3, 0.3, 0.3)
    m, lo, hi = common.bootstrap_ci([0.1, 0.2, 0.6])
    assert lo <= m <= hi and lo >= 0.1 and hi <= 0.6
    assert np.isnan(common.bootstrap_ci([])[0])
    assert common.fmt_ci(0.5, 0.25, 0.75) == "50.0 [25.0, 75.0]"


def test_align_tokens_interpolates_onto_a_common_grid():
    rows = []
    for seed, toks in ((0, [10, 20, 30]), (1, [12, 24, 36])):
        for step, t in enumerate(toks):
            rows.append({"run": f"seed{seed}", "objective": "gspo", "seed": seed, "step": step,
                         "tokens": t, "metric": "reward", "value": t / 100})
    out = common.align_tokens(pd.DataFrame(rows), n=5)
    grid = sorted(out["tokens"].unique())
    assert grid[0] == 12 and grid[-1] == 30 and len(grid) == 5
    assert np.allclose(out["value"], out["tokens"] / 100)  # linear data stays linear
    assert out.groupby("tokens")["seed"].nunique().eq(2).all()  # every grid point has both


def test_prop31_quick(tmp_path):
    """Real steps: measured KL ≈ ½δᵀFδ per step; the files record commit, threads, command."""
    import json

    assert prop31.main(["--quick", "--out", str(tmp_path)]) == 0
    steps = pd.read_csv(tmp_path / "prop31.csv")
    assert {"kl_measured", "kl_predicted", "kl_res", "tax_share", "clip"} <= set(steps.columns)
    assert set(steps["config"]) == {c for c, *_ in prop31.QUICK}
    r = steps["kl_measured"] / steps["kl_predicted"]
    assert (steps["kl_measured"] > 0).all() and r.between(0.5, 2).all()
    assert (steps["kl_res"] <= steps["kl_predicted"] * 1.01).all()
    meta = json.loads((tmp_path / "prop31.json").read_text())
    assert len(meta["provenance"]["commit"]) == 40 and meta["provenance"]["threads"] == 1
    assert meta["provenance"]["command"].startswith("python analyses/prop31.py --quick")
    assert (tmp_path / "prop31.png").stat().st_size > 10_000
