"""The TRL integration writes token traces for its windows (gradlab.load_traces reads them)."""

import numpy as np
import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import gradlab
from gradlab.integrations.audit.trl import WORKLOADS, grpo_args, make_trainer, quiet
from gradlab.integrations.trl import GradlabConfig


def test_trl_windows_are_traced(tmp_path):
    gl = GradlabConfig(store=str(tmp_path / "store"), keep_windows=True, trace_groups=2)
    with quiet():
        args = grpo_args("dr_grpo", "token", 2, 4, str(tmp_path / "out"))
        tr = make_trainer(args, WORKLOADS["arithmetic"], gl)
        tr.train()
    df = gradlab.load_traces(tmp_path / "store")
    assert set(df["step"]) == {w.index for w in tr.gradlab_windows} == {0, 1}
    assert df["group"].nunique() == 2 and set(df["opt_step"]) == {0, 1, 2, 3}  # TRL optimizer steps
    last = tr.gradlab_windows[-1]
    d = df[df["step"] == last.index].sort_values(["group", "row", "position"])  # window order
    keep = np.isin(last.batch.group.numpy(), sorted(d["group"].unique()))
    # the traced W is the window's hook-measured W, token for token (rows in window order)
    assert np.allclose(d["W"].to_numpy(), last.W.numpy()[keep][last.batch.mask.numpy()[keep]])
    assert d["W_closed"].isna().all() and not d["clip"].any()


def test_trace_options_are_checked():
    with pytest.raises(ValueError, match="trace_every=-1"):
        GradlabConfig(trace_every=-1)
