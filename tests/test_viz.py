"""gradlab.viz from tidy tables: strips from traces (the group rule, ρ), node residuals against
the cancellation module, the log-axis floor, the Prop. 3.1 scatter's input check."""

import numpy as np
import pandas as pd
import pytest

import gradlab.viz as viz
from gradlab import objectives
from gradlab.core.cancellation import cancellation
from gradlab.loop.traces import row_in_group, token_rows
from gradlab.testing import measure_modulation, random_batch


def traces_of(batch, names=("grpo", "gspo")) -> tuple[pd.DataFrame, dict]:
    frames, Ws = [], {}
    for n in names:
        obj = objectives.get(n)
        Ws[n] = measure_modulation(obj.loss, batch)
        d = pd.DataFrame(token_rows(batch, Ws[n], obj, row_in_group=row_in_group(batch.group)))
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
