"""The analysis scripts in quick mode (seconds each), and their helpers."""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analyses.figures import ablations, figure2, figure3, noise_floor, prop31, scaffold_tax  # noqa: E402
from analyses.tools import common  # noqa: E402
from gradlab.provenance import code_hash  # noqa: E402
from gradlab.stats import paired_interval  # noqa: E402
from gradlab.viz.seeds import align_tokens  # noqa: E402


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
    # drawn by gradlab.viz, with the caption of docs/concepts/dfpo.md#one-gradient-for-every-transform-at-full-group-nodes under the strips
    from gradlab.viz import CAPTION
    fig = figure2.draw(df)
    assert CAPTION in [t.get_text() for t in fig.texts] and "(Σ_i A_i w̃_i)·∇l = 0" in CAPTION


def test_figure3_quick(tmp_path):
    runs = tmp_path / "runs"
    assert figure3.main(["--quick", "--runs", str(runs), "--out", str(tmp_path)]) == 0
    for f in ("figure3.png", "figure3_diagnostics.png", "figure3_paired.png", "figure3.csv"):
        assert (tmp_path / f).stat().st_size > 0, f
    md = (tmp_path / "figure3.md").read_text()
    assert all(label in md for label in figure3.LABELS.values()) and "paired" in md
    meta = json.loads((tmp_path / "figure3.json").read_text())
    assert len(meta["provenance"]["commit"]) == 40 and meta["provenance"]["threads"] == 1
    assert meta["provenance"]["command"].startswith("python -m analyses.figures.figure3 --quick")
    # held-out: the exact expected accuracy of the final checkpoint over the split's first 32
    from gradlab.loop.recipes.evaluation import expected_accuracy, heldout_split

    row = next(r for r in meta["per_seed"] if r["seed"] == 1 and r["objective"] == "dfpo-orth")
    model, tok, task, _ = common.load_run_policy(runs / "seed1", "dfpo-orth")
    assert row["heldout_source"] == "exact_split" and 0 <= row["heldout_sampled"] <= 1
    assert row["heldout_acc"] == pytest.approx(
        float(expected_accuracy(model, tok, task, heldout_split(task)[:32]).mean()), abs=1e-12)
    # the paired curve is objective − GSPO at equal rollout steps, from the same table
    tidy0 = pd.read_csv(tmp_path / "figure3.csv")
    diff = figure3.paired_curves(tidy0, common.QUICK["minibatches"])
    acc = tidy0[tidy0["metric"] == "accuracy"].set_index(["seed", "step", "objective"])["value"]
    r = diff[(diff["objective"] == "grpo") & (diff["metric"] == "accuracy − gspo")].iloc[-1]
    s, k = r["seed"], r["step"]
    assert r["value"] == pytest.approx(100 * (acc[(s, k, "grpo")] - acc[(s, k, "gspo")]))
    assert r["optimizer steps"] == (k + 1) * common.QUICK["minibatches"]
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
    for label in ablations.TABLE2.values():
        assert label in md
    for G in ablations.GROUP_SIZES:
        assert f"|  {G:>2} |" in md or f"| {G:>3} |" in md
    long = pd.read_csv(tmp_path / "ablations.csv")
    metrics = 7  # held-out, train, ρ prefix, ρ trie, tax share, drift, tokens
    assert len(long[long["table"] == "table2"]) == len(ablations.TABLE2) * 2 * metrics
    assert len(long[long["table"] == "table3"]) == 4 * 2 * 2 * metrics  # G × objectives × seeds
    acc = long[long["metric"].isin(["heldout_acc", "train_acc_last5"])]
    assert acc["value"].between(0, 1).all()
    # GSPO's tax share is > 0, DFPO's is round-off: the rows carry their own measurements
    t2 = long[(long["table"] == "table2") & (long["metric"] == "tax_share")]
    tax = t2.groupby("objective")["value"].mean()
    assert tax["gspo"] > 1e3 * tax["dfpo-min"]
    meta = json.loads((tmp_path / "ablations.json").read_text())
    assert len(meta["provenance"]["commit"]) == 40 and meta["provenance"]["threads"] == 1
    # one provenance row per run used: Figure 3 tandem, second tandem, G ≠ 4 tandems (2 seeds each)
    ledger = meta["run_provenance"]
    assert len(ledger) == 2 * (2 + len(ablations.GROUP_SIZES) - 1)
    # whether a run's code is the shipped code is computed when asked, never stored
    assert all(r["code_hash"] == code_hash() and "current_code" not in r for r in ledger)
    # the seeds file holds every table row; with no figure3 seeds file beside it, comparisons
    # hold every Table 2 variant − GSPO and every G
    seeds = pd.read_csv(tmp_path / "ablations_seeds.csv")
    assert set(seeds["layout"]) == {"independent", *(f"G={g}" for g in ablations.GROUP_SIZES)}
    rows = pd.read_csv(tmp_path / "comparisons.csv")
    assert len(rows) == len(ablations.TABLE2) - 1 + len(ablations.GROUP_SIZES)
    # when figure3 publishes these very runs, their comparisons are figure3's rows only
    fig3_rows = seeds[seeds["objective"].isin(figure3.OBJECTIVES) & (seeds["layout"] == "independent")]
    fig3_rows.assign(experiment="figure3").to_csv(tmp_path / "figure3_seeds.csv", index=False)
    assert ablations.main(["--reanalyse", "--out", str(tmp_path)]) == 0
    rows = pd.read_csv(tmp_path / "comparisons.csv")
    rows = rows[rows["experiment"] == "ablations"]
    assert len(rows) == len(ablations.EXTRA) + len(ablations.GROUP_SIZES) - 1
    assert "published once as experiment `figure3`" in (tmp_path / "ablations.md").read_text()
    assert not rows["primary"].any() and rows["p_holm"].isna().all()
    x = seeds[(seeds["layout"] == "G=16") & (seeds["objective"] == "dfpo-min")]["heldout_acc"]
    y = seeds[(seeds["layout"] == "G=16") & (seeds["objective"] == "gspo")]["heldout_acc"]
    assert rows[rows["layout"] == "G=16"]["mean_diff"].item() == pytest.approx(
        100 * (x.to_numpy() - y.to_numpy()).mean())
    # Table 2 pairs two tandems: a learner does not depend on which objectives run beside it
    common.run_seeds(tmp_path / "solo", [0], objectives=["gspo"], **common.QUICK)
    solo, fig3 = (common.load_seeds(tmp_path / d) for d in ("solo", "figure3"))
    fig3 = fig3[(fig3["seed"] == 0) & (fig3["objective"] == "gspo")]
    key = ["step", "metric"]
    both = solo.merge(fig3, on=key, suffixes=("_solo", "_tandem"))
    assert len(both) == len(solo) > 50
    assert (both["tokens_solo"] == both["tokens_tandem"]).all()
    assert np.allclose(both["value_solo"], both["value_tandem"], rtol=0, atol=0, equal_nan=True)


def test_noise_floor_quick(tmp_path):
    """Gradient-identical twins (min vs orth at prefix nodes) have not parted after 2 steps."""
    assert noise_floor.main(["--quick", "--runs", str(tmp_path), "--out", str(tmp_path)]) == 0
    long = pd.read_csv(tmp_path / "noise_floor.csv")
    assert set(long["objective"]) == set(noise_floor.OBJECTIVES) and long["seed"].nunique() == 3
    w = long.pivot_table(index=["seed", "metric"], columns="objective", values="value")
    assert (w["dfpo-min"] == w["dfpo-orth"]).all()  # twins: same samples, same scores
    meta = json.loads((tmp_path / "noise_floor.json").read_text())
    s = meta["summary"]["train_acc_last5"]
    assert s["twin_sd"] == 0 and s["seeds_needed_twin_sd"] == 2
    assert meta["provenance"]["command"].startswith("python -m analyses.figures.noise_floor --quick")
    assert len(meta["run_provenance"]) == 3 and not any(r["reused"] for r in meta["run_provenance"])
    assert "twin sd" in (tmp_path / "noise_floor.md").read_text()
    rows = pd.read_csv(tmp_path / "comparisons.csv")
    assert list(zip(rows["a"], rows["b"])) == noise_floor.PAIRS and not rows["primary"].any()
    twins = rows[rows["b"] == "dfpo-orth"].iloc[0]
    assert (twins["mean_diff"], twins["lo"], twins["hi"]) == (0, 0, 0)  # not parted yet


def _published(tmp_path, files: list[str], sub: str = "") -> Path:
    """A copy of the committed figures/ files a re-analysis reads, in tmp_path/sub."""
    import shutil

    d = tmp_path / sub
    d.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy(ROOT / "figures" / sub / f, d / f)
    return d


def _same_rows(tmp: Path, experiment: str) -> None:
    """The re-analysis' seeds file and comparisons equal the committed ones."""
    fig = ROOT / "figures"
    pd.testing.assert_frame_equal(pd.read_csv(tmp / f"{experiment}_seeds.csv"),
                                  pd.read_csv(fig / f"{experiment}_seeds.csv"))
    new = pd.read_csv(tmp / "comparisons.csv")
    old = pd.read_csv(fig / "comparisons.csv")
    old = old[old["experiment"] == experiment].reset_index(drop=True)
    pd.testing.assert_frame_equal(new, old, rtol=1e-9)
    assert len(new) and set(new["method"]) == {"t"}


def _tables(md: str) -> str:
    """An ablations/noise_floor.md without its provenance footer (the last line)."""
    return md.rstrip("\n").rsplit("\n", 1)[0]


@pytest.mark.parametrize("task,sub,exp", [("arithmetic", "", "ablations"),
                                          ("scaffold", "scaffold", "ablations-scaffold")])
def test_ablations_reanalyse_reproduces_the_published_tables(tmp_path, task, sub, exp):
    """--reanalyse on a copy of the committed ablations.csv/.json/.md re-makes the committed
    tables, seeds file and comparisons rows without training (no run folders), and says which
    commit made the runs (and that ablations.json holds their code hashes, where it does)."""
    d = _published(tmp_path, ["ablations.csv", "ablations.json", "ablations.md"], sub)
    committed = (d / "ablations.md").read_text()
    assert ablations.main(["--reanalyse", "--task", task, "--out", str(d)]) == 0
    md = (d / "ablations.md").read_text()
    assert _tables(md) == _tables(committed) and "bootstrap" not in md
    meta = json.loads((d / "ablations.json").read_text())
    made = meta["runs_made_by"]["commit"][:10]
    when = ("per-run code hashes in ablations.json" if meta.get("run_provenance")
            else "before runs recorded their code")
    assert "runs made by" in md and made in md and when in md
    assert meta["provenance"]["command"].startswith("python -m analyses.figures.ablations --reanalyse")
    _same_rows(d, exp)
    # the Figure 3 tandem's rows are the Figure 3 experiment's per-seed values while both come
    # from the same runs (rollout tokens and training accuracy per seed and objective identify
    # them); once Figure 3 is re-trained, the ablations keep the earlier tandem and
    # figures/README.md says so
    s = pd.read_csv(d / f"{exp}_seeds.csv")
    f3 = pd.read_csv(ROOT / "figures" / f"{exp.replace('ablations', 'figure3')}_seeds.csv")
    both = s[s["table"] == "table2"].merge(f3, on=["objective", "seed"], suffixes=("", "_f3"))
    assert len(both) == len(f3)
    if ((both["tokens"] == both["tokens_f3"])
            & (both["train_acc_last5"] == both["train_acc_last5_f3"])).all():
        assert (both["heldout_acc"] == both["heldout_acc_f3"]).all()
    else:
        readme = " ".join((ROOT / "figures" / "README.md").read_text().split())
        assert "these are not the runs of the Figure 3 section above" in readme


def test_noise_floor_reanalyse_reproduces_the_published_table(tmp_path):
    d = _published(tmp_path, ["noise_floor.csv", "noise_floor.json", "noise_floor.md"])
    committed = (d / "noise_floor.md").read_text()
    assert noise_floor.main(["--reanalyse", "--out", str(d)]) == 0
    md = (d / "noise_floor.md").read_text()
    assert _tables(md) == _tables(committed) and "t interval" in md
    _same_rows(d, "noise_floor")
    # the DFPO − GSPO interval is the t interval of the committed per-seed held-out values
    s = pd.read_csv(d / "noise_floor_seeds.csv")
    w = s.pivot(index="seed", columns="objective", values="heldout_acc")
    r = paired_interval(100 * w["dfpo-min"], 100 * w["gspo"])
    g = json.loads((d / "noise_floor.json").read_text())["summary"]["heldout_acc"]["dfpo_minus_gspo"]
    assert (g["lo"], g["hi"], g["p"]) == pytest.approx((r["lo"], r["hi"], r["p"]))


def test_mean_ci_is_a_t_interval():
    assert common.mean_ci([0.3, 0.3, 0.3]) == (0.3, 0.3, 0.3)
    m, lo, hi = common.mean_ci([0.1, 0.2, 0.6, np.nan])  # NaN dropped: n = 3, t_{0.975, 2}
    half = 4.302653 * np.std([0.1, 0.2, 0.6], ddof=1) / np.sqrt(3)
    assert (m, lo, hi) == pytest.approx((0.3, 0.3 - half, 0.3 + half))
    assert np.isnan(common.mean_ci([])[0])
    assert common.fmt_ci(0.5, 0.25, 0.75) == "50.0 [25.0, 75.0]"
    r = {"mean": 1.0, "lo": -0.5, "hi": 2.5, "p": 0.1234}
    assert common.fmt_diff(r) == "+1.0 [-0.5, +2.5], p 0.12"


def test_align_tokens_interpolates_onto_a_common_grid():
    rows = []
    for seed, toks in ((0, [10, 20, 30]), (1, [12, 24, 36])):
        for step, t in enumerate(toks):
            rows.append({"run": f"seed{seed}", "objective": "gspo", "seed": seed, "step": step,
                         "tokens": t, "metric": "reward", "value": t / 100})
    out = align_tokens(pd.DataFrame(rows), n=5)
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
    small = steps["config"] == "lr 2e-4"  # the default lr: small steps, second order holds
    assert (steps["kl_measured"] > 0).all() and r[small].between(0.5, 2).all()
    # lr 2e-3: Adam's first step moves every weight by ~lr, the KL leaves the quadratic regime
    assert r[~small].max() > 2
    assert (steps["kl_res"] <= steps["kl_predicted"] * 1.01).all()
    meta = json.loads((tmp_path / "prop31.json").read_text())
    assert len(meta["provenance"]["commit"]) == 40 and meta["provenance"]["threads"] == 1
    assert meta["provenance"]["command"].startswith("python -m analyses.figures.prop31 --quick")
    assert (tmp_path / "prop31.png").stat().st_size > 10_000


def test_scaffold_tax_quick(tmp_path):
    """The scaffold/arithmetic comparison end to end on tiny runs: DFPO's tax is float round-off
    on both tasks, GSPO learns the same in either tandem (learners are independent, so the
    `clip` pair's GSPO is the `dfpo` pair's GSPO to the bit), and the outputs carry provenance."""
    assert scaffold_tax.main(["--quick", "--runs", str(tmp_path / "runs"),
                              "--out", str(tmp_path)]) == 0
    tidy = pd.read_csv(tmp_path / "scaffold_tax.csv")
    dfpo = tidy[(tidy["objective"] == "dfpo-min") & (tidy["metric"] == "tax_share")]
    assert len(dfpo) == 2 * 2 and (dfpo["value"] < 1e-6).all()
    g = tidy[tidy["objective"] == "gspo"].pivot_table(
        index=["task", "seed", "step", "metric"], columns="pair", values="value")
    assert np.array_equal(g["dfpo"].to_numpy(), g["clip"].to_numpy())
    meta = json.loads((tmp_path / "scaffold_tax.json").read_text())
    assert meta["provenance"]["threads"] == 1 and set(meta["summary"]) >= {"scaffold", "arithmetic"}


def test_ablations_quick_scaffold(tmp_path):
    """`--task scaffold` trains Table 2's tandems on the scaffold task (recorded in the sizes)."""
    assert ablations.main(["--quick", "--task", "scaffold", "--only", "table2", "--seeds", "1",
                           "--runs", str(tmp_path), "--out", str(tmp_path)]) == 0
    meta = json.loads((tmp_path / "ablations.json").read_text())
    assert meta["size"]["task"] == "scaffold"
    cfg = json.loads((tmp_path / "table2" / "seed0" / "config.json").read_text())
    assert cfg["task"] == "scaffold"
    for label in ablations.TABLE2.values():
        assert label in (tmp_path / "ablations.md").read_text()


def test_run_seeds_reuses_a_finished_run_whatever_the_path_spelling(tmp_path, monkeypatch):
    """A finished seed trained under an absolute path is reused, not wiped, when the next
    script names the same folder relatively (regression: the scaffold tables wiped Figure 3's
    seed 0 because `out` was compared as a string)."""
    common.run_seeds(tmp_path / "r", [0], objectives=["gspo"], **common.QUICK)
    before = (tmp_path / "r" / "seed0" / "metrics.jsonl").read_bytes()
    monkeypatch.chdir(tmp_path)
    common.run_seeds("r", [0], objectives=["gspo"], **common.QUICK)
    assert (tmp_path / "r" / "seed0" / "metrics.jsonl").read_bytes() == before


def _tidy3(reward_differs: bool) -> pd.DataFrame:
    """A Figure-3-shaped tidy table: 2 seeds × 3 rollout steps × the four objectives."""
    rows = []
    for seed in (0, 1):
        for obj in figure3.OBJECTIVES:
            for step in range(3):
                acc = 0.3 + 0.1 * step + 0.01 * seed
                vals = {"accuracy": acc, "reward": acc + (0.5 if reward_differs else 0.0),
                        "entropy": 0.2 - 0.01 * step}
                vals.update({m: 0.1 for m, _ in figure3.BEYOND if m not in vals})
                rows += [(f"seed{seed}", obj, seed, step, 100 * (step + 1), m, v)
                         for m, v in vals.items()]
    return pd.DataFrame(rows, columns=["run", "objective", "seed", "step", "tokens", "metric", "value"])


def test_figure3_draws_reward_only_where_it_differs_from_accuracy():
    assert [m for m, _ in figure3.main_panels(_tidy3(False))] == ["accuracy", "entropy"]
    assert [m for m, _ in figure3.main_panels(_tidy3(True))] == ["accuracy", "reward"]


def test_figure3_replot_redraws_from_the_csv_without_runs(tmp_path):
    _tidy3(False).to_csv(tmp_path / "figure3.csv", index=False)
    (tmp_path / "figure3.json").write_text(json.dumps({"size": {"minibatches": 2}}))
    assert figure3.main(["--replot", "--out", str(tmp_path)]) == 0
    for f in ("figure3.png", "figure3_diagnostics.png", "figure3_paired.png"):
        assert (tmp_path / f).read_bytes()[:4] == b"\x89PNG", f
    assert not (tmp_path / "runs").exists()


def test_rollout_layouts_quick(tmp_path):
    from analyses.figures import rollout_layouts

    out = tmp_path / "rl"
    assert rollout_layouts.main(["--quick", "--out", str(out)]) == 0
    df = pd.read_csv(f"{out}.csv")
    assert len(df) == 2 * len(rollout_layouts.LAYOUTS) and (df["groups"] == 2).all()
    d = df.set_index(["task", "layout"])
    for task in ("arithmetic", "scaffold"):
        ind = d.loc[(task, "independent")]
        assert ind["informative_vs_independent"] == 1
        assert ind["generated_tokens"] == ind["trained_tokens"]  # every token sampled once
        # a splice repair samples nothing: the independent rows' tokens, more trained tokens
        assert d.loc[(task, "repair splice"), "generated_tokens"] == ind["generated_tokens"]
        tree = d.loc[(task, "tree star alternative")]
        assert tree["generated_tokens"] < tree["trained_tokens"]  # prefixes reused
        assert tree["duplicates_per_group"] == 0  # 7 alternatives at distinct positions
    assert "Min-Replace vs Orth-Proj" in (tmp_path / "rl.md").read_text()


def test_tree_tandem_quick(tmp_path):
    from analyses.figures import tree_tandem

    out = tmp_path / "tt"
    assert tree_tandem.main(["--quick", "--tasks", "arithmetic", "--objectives", "gspo,ibpo",
                             "--runs", str(tmp_path / "runs"), "--out", str(out)]) == 0
    df = pd.read_csv(out / "tree_tandem.csv")
    assert set(df["layout"]) == {"independent", "tree", "repair"}
    assert set(df["objective"]) == {"gspo", "ibpo", "ibpo[form=repair]"}
    acc = df[df["metric"] == "heldout_acc"]["value"]
    assert len(acc) == 7 and acc.between(0, 1).all()
    assert (out / "tree_tandem.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_trl_real_smoke(tmp_path):
    """gradlab and TRL on a tiny real-vocabulary model, each in a child process: per-rollout
    times, steps/s over the timed rollouts, and per-process memory come back."""
    from analyses.benchmarks import bench_trl_real

    out = tmp_path / "trl_real.json"
    med = bench_trl_real.main(["--hidden", "32", "--layers", "1", "--prompts", "1", "--G", "2",
                               "--tokens", "2", "--minibatches", "1", "--rollouts", "2",
                               "--runners", "gradlab,trl", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert set(med) == set(runs) == {"gradlab", "trl"}
    for name, (r,) in runs.items():
        assert len(r["rollout_s"]) == 2 and all(t > 0 for t in r["rollout_s"])
        assert r["steps_per_s"] == pytest.approx(1 / r["rollout_s"][1])  # 1 step, 2nd rollout
        assert r["peak_rss_mib"] >= r["rss_start_mib"] > 0
        assert med[name]["steps_per_s"] == r["steps_per_s"]


def test_noise_budget_quick(tmp_path):
    """Real runs, every scheme: the whole-split expected accuracy has no evaluation noise, the
    sampled scores do; the tables re-make from the CSV alone."""
    from analyses.studies import noise_budget

    assert noise_budget.main(["--quick", "--tasks", "arithmetic", "--runs", str(tmp_path / "r"),
                              "--out", str(tmp_path)]) == 0
    meta = json.loads((tmp_path / "noise_budget.json").read_text())
    t = pd.DataFrame(meta["table"]).set_index("scheme")
    assert t.loc["expected all", "eval_sd"] == 0 and t.loc["sampled 16×1", "eval_sd"] > 0
    assert len(meta["runs"]) == 3 and all(r["code_hash"] == code_hash() for r in meta["runs"])
    long = pd.read_csv(tmp_path / "noise_budget.csv")
    whole = long[long["scheme"] == "expected all"]
    assert len(whole) == 3 * 3 and whole["value"].between(0, 1).all()
    before = (tmp_path / "noise_budget.md").read_text().split("Seeds by power")[0]
    assert noise_budget.main(["--from-csv", str(tmp_path / "noise_budget.csv"),
                              "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "noise_budget.md").read_text().split("Seeds by power")[0] == before


def test_same_runs_reports_identical_and_differing_runs(tmp_path, capsys):
    """analyses/tools/same_runs.py: two trainings of one configuration are the same numbers (bitwise,
    timings aside); another seed differs and exits 1, naming the first differing values."""
    from analyses.tools import same_runs
    from gradlab.loop.config import RunConfig
    from gradlab.loop.train import train

    kw = dict(objectives=["grpo"], steps=2, prompts=2, G=4, minibatches=1, ckpt_every=1, progress=False,
              probe_contexts=2, trace_every=1)
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train(RunConfig(out=str(tmp_path / name), seed=seed, **kw))
    assert same_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "the same numbers" in out and " 0 checkpoint" not in out
    assert same_runs.main([str(tmp_path / "a"), str(tmp_path / "c"), "--show", "1000"]) == 1
    out = capsys.readouterr().out
    assert "config.json: seed 0 vs 1" in out and "bytes differ" in out
    (tmp_path / "b" / "traces").rename(tmp_path / "b" / "gone")
    assert same_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert f"only in {tmp_path / 'a'}: traces" in capsys.readouterr().out


def test_same_runs_allows_only_the_reasons_an_older_store_lacks(tmp_path, capsys):
    """A store written before nulls carried their reason (no "undefined" entry) is the same
    numbers as a newer one; a null the older run stored as 0 is a difference."""
    import json

    from analyses.tools import same_runs
    from gradlab.loop.config import RunConfig
    from gradlab.loop.train import train

    task = tmp_path / "never.jsonl"  # an answer no response gives: every group tied
    task.write_text("".join(json.dumps({"prompt": p, "answer": "never"}) + "\n"
                            for p in ("3+4=?", "10+25=?")))
    for name in ("a", "b"):
        train(RunConfig(out=str(tmp_path / name), objectives=["grpo"], steps=2, prompts=2, G=4,
                        minibatches=1, progress=False, probe_contexts=2, task=str(task)))
    path = tmp_path / "a" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r.get("undefined") for r in rows)  # the newer store writes reasons
    older = [{k: v for k, v in r.items() if k != "undefined"} for r in rows]
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in older))
    assert same_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "reason of its nulls in 2 rows" in capsys.readouterr().out
    key = next(iter(rows[0]["undefined"]))
    older[0][key] = 0.0  # undefined written as 0 is not the same number
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in older))
    assert same_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def test_same_runs_records_its_check_and_allows_only_new_options_at_default(tmp_path, capsys):
    """`--record` writes the check into a figure JSON, which `analyses.tools.provenance` prints; a
    config key only the newer run has passes when it is RunConfig's default and fails when not;
    `--outputs` compares two files byte for byte."""
    import json
    from dataclasses import fields

    from analyses.tools import provenance, same_runs
    from gradlab.loop.config import RunConfig
    from gradlab.loop.train import train

    kw = dict(objectives=["grpo"], steps=1, prompts=2, G=4, minibatches=1, progress=False)
    for name in ("a", "b"):
        train(RunConfig(out=str(tmp_path / name), seed=0, **kw))
    cfg_a = json.loads((tmp_path / "a" / "config.json").read_text())
    default = {f.name: f.default for f in fields(RunConfig)}
    key = next(k for k, v in cfg_a.items() if k in default and v == default[k] and k != "out")
    (tmp_path / "a" / "config.json").write_text(json.dumps({k: v for k, v in cfg_a.items() if k != key}))
    fig = tmp_path / "figure.json"
    fig.write_text(json.dumps({"runs": [{"run": "x", "code_hash": "old0"}]}))
    assert same_runs.main([str(tmp_path / "b"), str(tmp_path / "b2"), "--retrain"]) == 0  # b again
    assert "the same numbers" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # --retrain never trains into an existing folder
        same_runs.main([str(tmp_path / "b"), str(tmp_path / "b2"), "--retrain"])
    assert same_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--record", str(fig),
                           "--label", "x/seed0"]) == 0
    assert f"adds {key}=" in capsys.readouterr().out
    entry = json.loads(fig.read_text())["same_runs"][0]
    assert entry["identical"] and entry["run"] == "x/seed0" and entry["code_hash"] == entry["against_code_hash"]
    entry = {**entry, "code_hash": "old0"}
    fig.write_text(json.dumps({"runs": [{"run": "x", "code_hash": "old0"}], "same_runs": [entry]}))
    lines = provenance.describe(json.loads(fig.read_text()), "new0")
    assert any("same_runs: identical to code" in ln and "x/seed0" in ln for ln in lines), lines
    cfg_b = json.loads((tmp_path / "b" / "config.json").read_text())  # a non-default new key fails
    (tmp_path / "b" / "config.json").write_text(json.dumps({**cfg_b, key: "not the default"}))
    assert same_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert f"config.json: {key} None vs 'not the default'" in capsys.readouterr().out
    (tmp_path / "o1.csv").write_text("a,b\n1,2\n")
    (tmp_path / "o2.csv").write_text("a,b\n1,3\n")
    assert same_runs.main([str(tmp_path / "o1.csv"), str(tmp_path / "o1.csv"), "--outputs"]) == 0
    assert same_runs.main([str(tmp_path / "o1.csv"), str(tmp_path / "o2.csv"), "--outputs",
                           "--record", str(fig), "--codes", "old0", "new0"]) == 1
    assert json.loads(fig.read_text())["same_runs"][-1]["identical"] is False


def test_provenance_is_computed_not_stored(tmp_path, capsys):
    """No figure JSON stores whether its runs are the shipped code; `python -m
    analyses.tools.provenance` computes it: runs of code_hash() count as shipped, others are listed
    by hash with their same_runs record, figures without runs say so."""
    from analyses.tools import provenance

    for f in common.FIGURES.rglob("*.json"):
        assert '"current_code"' not in f.read_text(), f
    assert provenance.main([]) == 0
    text = capsys.readouterr().out
    assert f"shipped code: {code_hash()}" in text
    for name in ("ablations.json", "figure3.json", "variance_tree.json", "scaffold/figure3.json"):
        assert f"{name}:\n" in text
    assert "runs not recorded" not in text  # every published figure lists its runs
    row = {"run": "r0", "code_hash": code_hash(), "commit": "a" * 40}
    other = {"run": "r1", "code_hash": "0123456789abcdef", "commit": "b" * 40}
    (tmp_path / "f.json").write_text(json.dumps({"runs": [row, other, dict(other, run="r2")],
        "same_runs": [{"code_hash": "0123456789abcdef", "against_code_hash": code_hash(),
                       "run": "r1", "identical": True}]}))
    (tmp_path / "g.json").write_text(json.dumps({"run_provenance": [dict(other, run="r3")]}))
    lines = provenance.report(tmp_path)
    assert f"  3 runs listed; by the shipped code ({code_hash()}): 1" in lines
    assert "  by other code 0123456789abcdef: 2 runs (commit bbbbbbb)" in lines
    assert f"    same_runs: identical to code {code_hash()} on r1" in lines
    assert lines[-1] == "    same_runs: not recorded"
    # runs as a mapping run → record with its provenance (regression_power_shipped.json's form)
    (tmp_path / "g.json").write_text(json.dumps({"runs": {
        "r4": {"what": "unmodified", "provenance": dict(other, start_step=0)},
        "r5": {"what": "lr", "provenance": row}}}))
    lines = provenance.report(tmp_path)
    assert "g.json:" in lines and f"  2 runs listed; by the shipped code ({code_hash()}): 1" in lines
    (tmp_path / "h.json").write_text(json.dumps({"provenance": {"commit": "c" * 40, "command": "x"}}))
    assert "  runs not recorded; made at commit ccccccc by `x`" in provenance.report(tmp_path)
    # every proof of a hash is printed; a regression study's injected copies are named as such
    proof = {"code_hash": "0123456789abcdef", "against_code_hash": code_hash(), "identical": True}
    (tmp_path / "i.json").write_text(json.dumps({
        "runs": [dict(other, run="r6"), dict(other, run="r7", code_hash="fedcba9876543210",
                                              injected="lr_half")],
        "same_runs": [dict(proof, run="p1"), dict(proof, run="p2")]}))
    lines = provenance.describe(json.loads((tmp_path / "i.json").read_text()), code_hash())
    assert sum("same_runs: identical" in ln for ln in lines) == 2
    assert "    injected change lr_half: other code by design" in lines
    assert provenance.main(["--figures", str(tmp_path / "absent")]) == 2
