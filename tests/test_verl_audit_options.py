"""`gradlab audit verl --options`: verl's rollout correction (IS weights, rejection sampling)
through verl's own helper and loss, against an emulated rollout engine; the on-policy W checked
against verl's documented rule, and that check shown to catch a correction of the wrong sign."""

from __future__ import annotations

import json
import math

import pytest
from verl_child import run_in_verl_env

try:
    from verl.trainer.ppo import rollout_corr_helper

    HAVE_VERL = True
except ImportError:
    HAVE_VERL = False

needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl not importable here; these cases run "
                                "in the child of test_verl_option_cases_in_verl_env")


def test_verl_option_cases_in_verl_env():
    """Runs this file's verl cases in a python that sees .verl-site (CI installs it)."""
    run_in_verl_env(__file__, HAVE_VERL)


def _batches(seeds: int = 2):
    from gradlab.integrations.audit.verl import synthetic_batches

    return {pol: synthetic_batches(seeds, pol == "off") for pol in ("on", "off")}


@needs_verl
def test_every_option_row_is_produced_and_finite():
    import gradlab.integrations.verl  # noqa: F401  (registers verl's losses)
    from gradlab.integrations.audit import verl_options as vo

    b = _batches()
    rows = {o.name: vo.option_row(b, o) for o in vo.OPTIONS}
    for name, r in rows.items():
        for k in ("rho_on_whole", "rho_off_whole", "rho_on_split", "dropped_on_whole",
                  "check_dev"):
            assert math.isfinite(r[k]), (name, k)
        assert r["check_dev"] < 1e-6, name  # W = A·r_IS·keep/N on-policy
    # a batch-invariant engine error at shared tokens: token-level weights keep cancellation
    for name in ("none (base)", "rollout_is=token, threshold 2 (TIS)",
                 "rollout_is=token, threshold 0.5_2 (IcePop)", "rollout_rs=token_k1, 0.5_2"):
        assert rows[name]["rho_on_whole"] < 1e-9 and rows[name]["rho_on_split"] < 1e-9, name
    # one weight or mask per sequence differs within a group: cancellation breaks
    for name in ("rollout_is=sequence, threshold 2", "rollout_rs=seq_mean_k3, 0.2",
                 "rollout_is=token, threshold 2, per-row engine error"):
        assert rows[name]["rho_on_whole"] > 1e-3, name
    assert rows["rollout_rs=token_k1, 0.5_2"]["dropped_on_whole"] > 0


@needs_verl
def test_check_catches_a_correction_of_the_wrong_sign():
    from gradlab.integrations.audit import verl_options as vo

    def flipped(**kw):  # injected bug: log(π_rollout/π_train) instead of log(π_train/π_rollout)
        kw["old_log_prob"], kw["rollout_log_prob"] = kw["rollout_log_prob"], kw["old_log_prob"]
        return rollout_corr_helper.compute_rollout_correction_and_rejection_mask(**kw)

    b = _batches(1)
    opt = vo.OPTIONS[1]  # token-level TIS
    assert vo.option_row(b, opt)["check_dev"] < 1e-6
    with pytest.raises(AssertionError, match="deviates from A·r_IS·keep/N"):
        vo.option_row(b, opt, helper=flipped)


@needs_verl
def test_documented_weights_by_hand():
    import torch

    from gradlab.core.batch import TokenBatch
    from gradlab.integrations.audit import verl_options as vo

    m = torch.tensor([[True, True, False]])
    z = torch.zeros(1, 3, dtype=torch.float64)
    b = TokenBatch(tokens=torch.tensor([[1, 2, 0]]), mask=m, logps=z, old_logps=z,
                   advantages=torch.ones(1, dtype=torch.float64), group=torch.zeros(1, dtype=torch.long),
                   validate=False)
    e = vo.engine_logps(b, "row", 0)  # r = exp(−e)
    tis = vo.documented_weights(b, vo.OPTIONS[1], 0)
    assert torch.allclose(tis, torch.exp(-e).clamp(max=2.0) * m)
    w, keep = vo.correction(b, vo.Option("t", "token", noise="row"), 0)
    assert torch.allclose(w, tis) and torch.equal(keep.bool(), m)


@needs_verl
def test_cli_options_table_and_provenance(tmp_path):
    from gradlab.cli.main import main

    assert main(["audit", "verl", "--quick", "--options", "--seeds", "1", "--out",
                 str(tmp_path)]) == 0
    md = (tmp_path / "verl_audit.md").read_text()
    assert "| rollout_is=sequence, threshold 2 |" in md and "yes: ρ" in md
    assert "| vanilla | token-mean |" in md  # the loss rows stay
    doc = json.loads((tmp_path / "verl_audit.json").read_text())
    assert doc["command"].startswith("gradlab audit verl --quick --options")
    run = doc["runs"][0]
    assert run["run"] == "<in-process>" and run["reused"] is False
    assert {"code_hash", "commit", "dirty", "cpu_model", "torch", "threads"} <= set(run)
