"""gradlab.viz from tidy tables: strips from traces (the group rule, ρ), node residuals against
the cancellation module, the log-axis floor, the Prop. 3.1 scatter's input check."""

import numpy as np
import pandas as pd
import pytest

import gradlab.viz as viz
from gradlab import objectives
from gradlab.core.cancellation import cancellation
from gradlab.loop.runs.traces import row_in_group, token_rows
from gradlab.testing import measure_modulation, random_batch


def traces_of(batch, names=("grpo", "gspo")) -> tuple[pd.DataFrame, dict]:
    frames, Ws = [], {}
    for n in names:
        obj = objectives.get(n)
        Ws[n] = measure_modulation(obj.loss, batch)
        d = pd.DataFrame(token_rows(batch, Ws[n], objective=obj,
                                    row_in_group=row_in_group(batch.group)))
        d["objective"], d["step"], d["opt_step"], d["text"] = n, 0, 0, "x"
        frames.append(d)
    return pd.concat(frames, ignore_index=True), Ws


def test_node_residuals_match_the_cancellation_module():
    b = random_batch(n_groups=3, G=4, T=10, seed=1, off_policy=0.3)
    tr, Ws = traces_of(b)
    nodes = viz.node_residuals(tr, "prefix")
    for n, W in Ws.items():
        c = cancellation(W, b, "prefix")
        mine = nodes[nodes["objective"] == n]
        # Σ_n |Σ_i W| / Σ_n Σ|W| over full-group nodes is ρ at prefix nodes (c* = 0 there)
        assert mine["net"].abs().sum() / mine["mass"].sum() == pytest.approx(c.ratio, rel=1e-4, abs=1e-6)
    with pytest.raises(ValueError, match="kind"):
        viz.node_residuals(tr, "both")


def test_strip_table_and_strips_with_caption():
    b = random_batch(n_groups=3, G=4, T=10, seed=2, off_policy=0.3)
    tr, _ = traces_of(b)
    df = viz.strip_table(tr)
    assert set(df["panel"]) == {"grpo", "gspo"} and df["row"].nunique() == 4
    assert df.attrs["rho"]["grpo"] < 1e-9 < df.attrs["rho"]["gspo"]  # GRPO cancels, GSPO not
    fig = viz.token_strips(df)
    assert viz.CAPTION in [t.get_text() for t in fig.texts]
    with pytest.raises(ValueError, match="step=7"):
        viz.strip_table(tr, step=7)


def test_log_axis_floor_and_prop31_input():
    tidy = pd.DataFrame({"run": "r", "objective": ["a", "a", "b", "b"], "seed": 0,
                         "step": [0, 1, 0, 1], "tokens": [1, 2, 1, 2], "metric": "rho_prefix",
                         "value": [0.0, 1e-12, 0.3, 0.2]})
    fig = viz.training_curves(tidy, [("rho_prefix", "ρ")], x="step", log=("rho_prefix",))
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] == pytest.approx(1e-7)
    ys = np.concatenate([line.get_ydata() for line in ax.lines])
    assert ys.min() == pytest.approx(1e-6)  # exact zeros drawn on the floor
    with pytest.raises(ValueError, match="kl_predicted"):
        viz.prop31_scatter(pd.DataFrame({"objective": ["a"], "kl_measured": [1.0]}))
    ok = pd.DataFrame({"step": [0, 1], "objective": "a", "kl_measured": [1e-3, 2e-3],
                       "kl_predicted": [1.1e-3, 1.9e-3]})
    assert viz.prop31_scatter(ok).axes[0].get_xscale() == "log"


def _run_table(reward_equals_accuracy: bool) -> pd.DataFrame:
    rows = []
    for obj, base in (("grpo", 0.2), ("gspo", 0.3)):
        for step in range(10):
            acc = base + 0.01 * step
            rows += [(obj, step, "accuracy", acc),
                     (obj, step, "reward", acc if reward_equals_accuracy else acc + 0.5),
                     (obj, step, "rho_prefix", 0.0 if obj == "grpo" else 0.2),
                     (obj, step, "tax_share", (1e-12 if obj == "grpo" else 0.01) if step % 5 == 0
                      else float("nan")),
                     (obj, step, "eval_accuracy", base + 0.3 if step == 9 else float("nan"))]
    d = pd.DataFrame(rows, columns=["objective", "step", "metric", "value"])
    d["run"], d["seed"], d["tokens"] = "r", 0, d["step"] * 100
    return d


def test_training_curves_show_what_matters():
    fig = viz.training_curves(_run_table(True), x="step")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert not any(t == "reward" for t in titles)  # one panel: accuracy is the reward here
    acc = next(ax for ax in fig.axes if ax.get_title().startswith("accuracy"))
    assert "= reward" in acc.get_title() and "held-out" in acc.get_title()
    held = [ln for ln in acc.lines if ln.get_marker() == "D"]
    assert sorted(float(ln.get_ydata()[0]) for ln in held) == pytest.approx([0.5, 0.6])
    tax = next(ax for ax in fig.axes if ax.get_title().startswith("‖g_tax‖"))
    assert "every 5 steps" in tax.get_title() and tax.get_yscale() == "log"
    pts = [ln for ln in tax.lines if ln.get_marker() == "o"]
    assert pts and all(ln.get_linestyle() == "None" for ln in pts)  # points, no line between
    assert sorted(x for ln in pts for x in ln.get_xdata()) == [0, 0, 5, 5]
    rho = next(ax for ax in fig.axes if ax.get_title().startswith("cancellation"))
    assert rho.get_yscale() == "log"
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    fig2 = viz.training_curves(_run_table(False), x="step")
    assert "reward" in [ax.get_title() for ax in fig2.axes]  # differs: drawn


def test_end_of_run_tables():
    from gradlab.viz.summary import run_rows, variance_rows, variance_table

    rows = run_rows(_run_table(True)).set_index("objective")
    # grpo: accuracy = reward = 0.2 + 0.01·step; last 5 steps are 5..9
    assert rows.loc["grpo", "reward"] == pytest.approx(0.2 + 0.01 * 7)
    assert rows.loc["gspo", "heldout"] == pytest.approx(0.6) and rows.loc["grpo", "steps"] == 10
    assert rows.loc["gspo", "rho_prefix"] == pytest.approx(0.2)
    assert rows.loc["gspo", "tax_share"] == pytest.approx(0.01)  # NaN steps are not averaged
    assert np.isnan(rows.loc["gspo", "rho_trie"])  # not measured
    var = pd.DataFrame({"objective": ["grpo", "grpo", "ibpo", "ibpo", "ibpo", "ibpo", "ibpo"],
                        "batch": [pd.NA, 0, pd.NA, pd.NA, pd.NA, pd.NA, 0],
                        "metric": ["grad_noise", "grad_norm", "grad_noise", "grad_noise_lo",
                                   "grad_noise_hi", "noise_ratio_vs_grpo", "grad_norm"],
                        "value": [2.0, 9.0, 1.5, 1.0, 2.0, 0.75, 9.0]})
    var["batch"] = var["batch"].astype("Int64")
    v = variance_rows(var).set_index("objective")
    assert v.loc["ibpo", "noise_ratio_vs_grpo"] == 0.75 and np.isnan(v.loc["grpo", "noise_ratio_vs_grpo"])
    assert "| ibpo | 1.5 [1, 2] |" in variance_table(var)


def _undefined_table() -> pd.DataFrame:
    """Three objectives over 4 steps, as the loop stores them: "part" has ρ undefined at steps
    1 and 2 (every group tied: scale 0), "tied" at every step, "nonode" has no full-group
    token at any step; the counts and sums that say why sit beside ρ."""
    rows = []
    for obj in ("part", "tied", "nonode"):
        for step in range(4):
            tied = obj == "tied" or (obj == "part" and step in (1, 2))
            nodes = 0.0 if obj == "nonode" else 12.0
            scale = 0.0 if tied or obj == "nonode" else 2.0
            rho = float("nan") if scale == 0 else 0.1 * (step + 1)
            rows += [(obj, step, "rho_prefix", rho), (obj, step, "n_shared_prefix", nodes),
                     (obj, step, "scale_prefix", scale), (obj, step, "reward", 0.5),
                     (obj, step, "zero_std_share", 1.0 if tied else 0.5),
                     (obj, step, "tax_share", float("nan") if tied else 0.01),
                     (obj, step, "total_norm", 0.0 if tied else 1.0)]
    d = pd.DataFrame(rows, columns=["objective", "step", "metric", "value"])
    d["run"], d["seed"], d["tokens"] = "r", 0, d["step"] * 100
    return d


def test_undefined_steps_are_skipped_in_means_and_said_in_tables():
    from gradlab.viz.summary import run_rows

    rows = run_rows(_undefined_table()).set_index("objective")
    # the mean over the defined steps 0 and 3 only: (0.1 + 0.4) / 2, exactly pandas' nan-skipping mean
    assert rows.loc["part", "rho_prefix"] == pd.Series([0.1, 0.4]).mean()
    assert pd.isna(rows.loc["part", "why_rho_prefix"])  # defined: no reason
    assert np.isnan(rows.loc["tied", "rho_prefix"]) and np.isnan(rows.loc["tied", "tax_share"])
    assert rows.loc["tied", "why_rho_prefix"] == "no gradient: every group tied"
    assert rows.loc["tied", "why_tax_share"] == "no gradient: every group tied"
    assert np.isnan(rows.loc["nonode", "rho_prefix"])
    assert rows.loc["nonode", "why_rho_prefix"] == "no full-group token"
    assert rows.loc["nonode", "tax_share"] == pytest.approx(0.01)  # g ≠ 0, no residual: defined
    assert rows.loc["part", "why_rho_trie"] == "not measured"


def test_undefined_rho_is_a_gap_with_its_reason():
    fig = viz.training_curves(_undefined_table(), x="step")
    rho = next(ax for ax in fig.axes if ax.get_title().startswith("cancellation ratio ρ (full"))
    assert "gaps: undefined (no gradient: every group tied, no full-group token)" in rho.get_title()
    assert "measured every" not in rho.get_title()  # an undefined step was measured
    part = [line for line in rho.lines if np.isfinite(line.get_ydata()).sum() == 2]
    assert len(part) == 1  # "part": steps 0 and 3 drawn, 1 and 2 a gap (NaN), never a 0
    x, y = np.asarray(part[0].get_xdata(), float), np.asarray(part[0].get_ydata(), float)
    assert list(x) == [0, 1, 2, 3] and np.isnan(y[1:3]).all() and y[0] == pytest.approx(0.1)
    only_tied = _undefined_table().query("objective == 'tied'")
    fig = viz.training_curves(only_tied, x="step")
    empty = next(ax for ax in fig.axes if ax.get_title().startswith("cancellation ratio ρ (full"))
    assert empty.get_title().endswith("— undefined (no gradient: every group tied)")
    assert not empty.lines and "undefined at every step" in empty.texts[0].get_text()


def test_strip_rho_of_a_tied_group_is_undefined():
    b = random_batch(n_groups=2, G=4, T=10, seed=2)
    tr, _ = traces_of(b, ("grpo",))
    tr["W"], tr["A"] = 0.0, 0.0  # a tied group: W ≡ 0
    df = viz.strip_table(tr, group=0)
    assert np.isnan(df.attrs["rho"]["grpo"])
    fig = viz.token_strips(df)
    assert "ρ = — (no gradient at shared tokens)" in fig.axes[0].get_title()


def test_node_residual_of_a_tied_group_is_undefined():
    b = random_batch(n_groups=2, G=4, T=10, seed=2)
    tr, _ = traces_of(b, ("grpo",))
    tr.loc[tr["group"] == 0, "W"] = 0.0  # group 0 tied: W ≡ 0 at its nodes
    nodes = viz.node_residuals(tr, "prefix")
    tied, other = nodes[nodes["group"] == 0], nodes[nodes["group"] == 1]
    assert len(tied) and tied["rel"].isna().all() and (tied["mass"] == 0).all()
    assert other["rel"].notna().all()
    label = viz.residual_distribution(tr).axes[0].get_xlabel()
    assert f"{len(tied)} nodes undefined (W ≡ 0, not drawn)" in label


def test_table_prints_an_undefined_rho_as_a_dash_with_its_reason(capsys):
    """`gradlab table`: IBPO gives full-group tokens no credit (W ≡ 0 there), so its full-group ρ
    is undefined — "—" with the reason, never 0; GRPO's is a number."""
    from gradlab.cli.main import main

    assert main(["table", "--G", "4"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): ln.split("|")[3].strip()
            for ln in out.splitlines() if ln.startswith("| ") and "objective" not in ln}
    assert rows[("ibpo", "on")].startswith("—") and float(rows[("grpo", "on")]) < 1e-12
    assert "undefined (no gradient at shared tokens)" in out
