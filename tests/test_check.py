"""`gradlab check` and the user-facing pytest helpers: pass on main, fail on broken losses."""

import json
import textwrap

import pytest
import torch

from gradlab import check, objectives
from gradlab.core.objectives import GRPO, GRPOFix
from gradlab.testing import (
    assert_cancels,
    assert_cancels_in_regimes,
    assert_does_not_cancel,
    regime_report,
)

torch.set_num_threads(1)  # a 0.1M-parameter model: 2 contended threads are far slower


# --- losses a user might write ---------------------------------------------------------------
def drgrpo_loss(b):
    """Token-level, constant normalisation, no clip: exchangeable (cancels everywhere)."""
    r = torch.exp(b.logps - b.old_logps)
    return -(b.advantages[:, None] * r * b.mask).sum() / (b.B * b.T)


def seqnorm_loss(b):
    """The 1/|o_i| bug: per-sequence length normalisation."""
    r = torch.exp(b.logps - b.old_logps)
    T_i = b.mask.sum(-1, keepdim=True)
    return -(b.advantages[:, None] * r * b.mask / T_i).sum() / b.B


def clip_higher_loss(b, eps=(0.2, 0.28)):
    """PPO clip with DAPO's asymmetric 'clip-higher' bounds, constant normalisation."""
    r = torch.exp(b.logps - b.old_logps)
    A = b.advantages[:, None]
    per = torch.minimum(r * A, r.clamp(1 - eps[0], 1 + eps[1]) * A)
    return -(per * b.mask).sum() / (b.B * b.T)


LOSSES = '''
import torch
def seqnorm_loss(b):
    r = torch.exp(b.logps - b.old_logps)
    return -(b.advantages[:, None] * r * b.mask / b.mask.sum(-1, keepdim=True)).sum() / b.B
def drgrpo_loss(b):
    r = torch.exp(b.logps - b.old_logps)
    return -(b.advantages[:, None] * r * b.mask).sum() / (b.B * b.T)
'''


@pytest.fixture
def loss_file(tmp_path):
    p = tmp_path / "my_losses.py"
    p.write_text(textwrap.dedent(LOSSES))
    return p


# --- gradlab check ---------------------------------------------------------------------------
def test_check_passes_on_main(capsys):
    from gradlab.cli import main as cli_main

    assert cli_main(["check"]) == 0  # `gradlab check` delegates to gradlab.check.main
    out = capsys.readouterr().out
    assert f"all {len(check.builtin_scenarios())} scenarios pass" in out
    assert "model/gspo/off" in out and "synthetic/dfpo-orth/far" in out


def test_broken_user_loss_fails_and_is_named(loss_file, capsys):
    assert check.main(["--loss", f"{loss_file}:seqnorm_loss"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "synthetic/loss:seqnorm_loss/on " in out
    assert "scenario(s) failed: synthetic/loss:seqnorm_loss/on" in out
    # equal lengths: 1/|o_i| is a common constant, so that scenario passes
    line = next(s for s in out.splitlines() if s.startswith("synthetic/loss:seqnorm_loss/on-eq"))
    assert line.rstrip().endswith("ok (no baseline)")


def test_good_user_loss_passes_and_gets_its_own_baseline(loss_file, tmp_path):
    spec = f"{loss_file}:drgrpo_loss"
    assert check.main(["--loss", spec, "--no-model"]) == 0
    assert check.main(["--loss", f"{loss_file}:seqnorm_loss", "--expect", "residual",
                       "--no-model"]) == 0
    assert check.main(["--loss", spec, "--update", "--no-model"]) == 2  # never the committed one
    mine = tmp_path / "mine.json"
    assert check.main(["--loss", spec, "--update", "--baseline", str(mine), "--no-model"]) == 0
    assert "synthetic/loss:drgrpo_loss/far" in json.loads(mine.read_text())["scenarios"]
    assert check.main(["--loss", spec, "--baseline", str(mine), "--no-model"]) == 0


def test_monkeypatched_objective_fails(monkeypatch, capsys):
    # GRPO-fix with per-token clip decisions: asymmetric clipping is back
    monkeypatch.setattr(GRPOFix, "active", GRPO.active)
    assert check.main(["--only", "grpo-fix", "--no-model"]) == 1
    out = capsys.readouterr().out
    assert "synthetic/grpo-fix/far" in out and "expected cancellation" in out
    assert "vs baseline" in out  # and the baseline sees the change too


def test_baseline_max_and_mean_drift(tmp_path, capsys):
    base = json.loads(check.BASELINE.read_text())
    p = tmp_path / "b.json"
    one = json.loads(json.dumps(base))
    one["scenarios"]["synthetic/gspo/near"]["rho_prefix"][0] += 1e-3
    p.write_text(json.dumps(one))
    assert check.main(["--baseline", str(p), "--only", "synthetic/gspo/"]) == 1
    assert "|Δρ|" in capsys.readouterr().out
    shift = json.loads(json.dumps(base))  # below max_abs everywhere, but all in one direction
    for v in shift["scenarios"].values():
        v["rho_prefix"] = [x + 5e-7 for x in v["rho_prefix"]]
    p.write_text(json.dumps(shift))
    assert check.main(["--baseline", str(p), "--only", "synthetic/"]) == 1
    assert "mean-drift tolerance" in capsys.readouterr().out


def test_update_writes_environment_and_refuses_violations(tmp_path, monkeypatch):
    p = tmp_path / "b.json"
    assert check.main(["--update", "--baseline", str(p), "--only", "dfpo-min", "--no-model"]) == 0
    b = json.loads(p.read_text())
    assert {"python", "torch", "transformers", "platform"} <= set(b["environment"])
    assert set(b["scenarios"]) == {f"synthetic/dfpo-min/{r}" for r in ("on", "near", "far", "on-eq")}
    assert check.main(["--baseline", str(p), "--only", "dfpo-min", "--no-model"]) == 0
    monkeypatch.setattr(objectives.GRPOFix, "active", GRPO.active)
    assert check.main(["--update", "--baseline", str(p), "--only", "grpo-fix", "--no-model"]) == 1
    assert "grpo-fix" not in " ".join(json.loads(p.read_text())["scenarios"])


def test_committed_baseline_records_environment():
    b = json.loads(check.BASELINE.read_text())
    assert {"python", "torch", "transformers", "platform"} <= set(b["environment"])
    assert set(b["scenarios"]) == {s.key for s in check.builtin_scenarios()}


def test_bad_arguments_exit_2(capsys):
    assert check.main(["--loss", "no_colon"]) == 2
    assert check.main(["--loss", "gradlab.core.objectives:nope"]) == 2
    assert check.main(["--only", "no-such-scenario"]) == 2
    assert "error" in capsys.readouterr().err


# --- pytest helpers (what users put in their CI) -------------------------------------------
def test_helpers_catch_seqnorm_and_asymmetric_clipping():
    with pytest.raises(AssertionError, match="regime 'on'"):
        assert_cancels_in_regimes(seqnorm_loss)
    with pytest.raises(AssertionError, match="regime 'far'"):
        assert_cancels_in_regimes(clip_higher_loss)
    with pytest.raises(AssertionError, match="does not cancel"):
        assert_cancels(seqnorm_loss)
    # the plain helper near the policy misses the clip: it only fires far off-policy
    assert_cancels(clip_higher_loss)
    with pytest.raises(AssertionError):
        assert_cancels(clip_higher_loss, off_policy=1.0)
    assert_cancels_in_regimes(drgrpo_loss)
    assert_cancels_in_regimes(objectives.get("grpo-fix").loss)
    assert_does_not_cancel(objectives.get("gspo").loss)


def test_regime_report_rows():
    rows = regime_report(seqnorm_loss, regimes=("on", "on-eq"), seeds=(0, 1))
    assert [(r["regime"], r["seed"]) for r in rows] == [("on", 0), ("on", 1), ("on-eq", 0),
                                                        ("on-eq", 1)]
    assert rows[0]["ratio"] > 1e-3 and rows[2]["ratio"] < 1e-12
    with pytest.raises(ValueError, match="unknown regime"):
        regime_report(seqnorm_loss, regimes=("sideways",))
