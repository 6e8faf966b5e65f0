"""`gradlab check` and the user-facing pytest helpers: pass on main, fail on broken losses."""

import dataclasses
import json
import textwrap

import pytest
import torch

from gradlab import objectives, testing
from gradlab.check import baseline as cb
from gradlab.check import run as check
from gradlab.core.losses import GRPO, GSPO, GRPOFix
from gradlab.loop import config
from gradlab.loop.config import RunConfig
from gradlab.testing import (
    REGIMES,
    assert_cancels,
    assert_cancels_in_regimes,
    assert_does_not_cancel,
    assert_matches_baseline,
    random_batch,
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
    from gradlab.cli.main import main as cli_main

    assert cli_main(["check"]) == 0  # `gradlab check` delegates to gradlab.check.run.main
    out = capsys.readouterr().out
    assert f"all {len(check.builtin_scenarios())} scenarios pass" in out
    assert "model/gspo/off" in out and "synthetic/dfpo-orth/far" in out


def test_broken_user_loss_fails_and_is_named(loss_file, capsys):
    assert check.main(["--loss", f"{loss_file}:seqnorm_loss"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "synthetic/loss:seqnorm_loss/on " in out
    assert "scenario(s) failed: synthetic/loss:seqnorm_loss/on" in out
    assert "expect: ρ prefix/ρ trie must be 0 = cancel" in out  # the codes of the expect column
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
        v["rho_prefix"] = [x if x is None else x + 5e-7 for x in v["rho_prefix"]]  # None: undefined
    p.write_text(json.dumps(shift))
    assert check.main(["--baseline", str(p), "--only", "synthetic/"]) == 1
    assert "mean-drift tolerance" in capsys.readouterr().out


def test_update_writes_environment_and_refuses_violations(tmp_path, monkeypatch):
    p = tmp_path / "b.json"
    assert check.main(["--update", "--baseline", str(p), "--only", "dfpo-min", "--no-model"]) == 0
    b = json.loads(p.read_text())
    assert {"python", "torch", "transformers", "platform"} <= set(b["environment"])
    assert set(b["scenarios"]) == {f"synthetic/dfpo-min/{r}" for r in check.SYNTHETIC}
    assert check.main(["--baseline", str(p), "--only", "dfpo-min", "--no-model"]) == 0
    monkeypatch.setattr(objectives.GRPOFix, "active", GRPO.active)
    assert check.main(["--update", "--baseline", str(p), "--only", "grpo-fix", "--no-model"]) == 1
    assert "grpo-fix" not in " ".join(json.loads(p.read_text())["scenarios"])


def test_committed_baseline_records_environment():
    b = json.loads(check.BASELINE.read_text())
    assert {"python", "torch", "transformers", "platform"} <= set(b["environment"])
    assert set(b["scenarios"]) == {s.key for s in check.builtin_scenarios()}
    assert {"cpu_model", "cpu_capability", "torch", "threads"} <= set(b["fingerprint"])
    assert b["model_setup"]["training"] == testing.training_defaults()
    for key, v in b["scenarios"].items():  # W per seed: 3 synthetic, 1 model
        assert len(v["W"]) == (len(check.SEEDS) if key.startswith("synthetic") else 1), key


def test_non_finite_w_is_named(tmp_path, capsys):
    f = tmp_path / "nan_loss.py"
    f.write_text("def nan_loss(b):\n    return (b.logps * float('nan')).sum()\n")
    assert check.main(["--loss", f"{f}:nan_loss", "--no-model", "--only", "/on-eq"]) == 1
    assert "FAIL synthetic/loss:nan_loss/on-eq: W is not finite (NaN or inf) on seed(s) [0, 1, 2]" \
        in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys):
    assert check.main(["--loss", "no_colon"]) == 2
    assert check.main(["--loss", "gradlab.core.objectives:nope"]) == 2
    assert check.main(["--only", "no-such-scenario"]) == 2
    assert "error" in capsys.readouterr().err


# --- W against the baseline: scale, sign, mask; the machine fingerprint ---------------------
SCALED = '''
import torch
def drgrpo_loss(b):
    r = torch.exp({logps} - b.old_logps)
    A = {adv}
    m = {mask}
    return {factor} * -(A[:, None] * r * m).sum() / (b.B * b.T)
'''
PLAIN = {"adv": "b.advantages", "mask": "b.mask", "factor": "1.0", "logps": "b.logps"}
# the mask without each row's last response token (a loss that drops EOS)
NO_LAST = "b.mask & (torch.arange(b.T) < b.mask.sum(-1, keepdim=True) - 1)"


def _write(path, **change):
    path.write_text(SCALED.format(**{**PLAIN, **change}))
    return f"{path}:drgrpo_loss"


@pytest.fixture
def my_baseline(tmp_path):
    """A user loss's baseline (synthetic scenarios), written on this machine."""
    loss, base = tmp_path / "scaled.py", tmp_path / "mine.json"
    assert check.main(["--loss", _write(loss), "--update", "--baseline", str(base),
                       "--no-model"]) == 0
    return loss, base


@pytest.mark.parametrize("factor, text", [("2.0", "×2.00"), ("0.5", "×0.50"),
                                          ("-1.0", "×−1.00 against the baseline (sign flipped)")])
def test_rescaled_or_flipped_loss_is_named_with_its_factor(my_baseline, capsys, factor, text):
    loss, base = my_baseline
    capsys.readouterr()
    spec = _write(loss, factor=factor)
    assert check.main(["--loss", spec, "--baseline", str(base), "--no-model"]) == 1
    out = capsys.readouterr().out
    fails = {ln.split(":")[1]: ln for ln in out.splitlines() if ln.startswith("FAIL synthetic")}
    for regime in check.SYNTHETIC:  # every scenario, by name, with the factor
        assert f"W scaled {text}" in fails[f"drgrpo_loss/{regime}"]
    assert "compared exactly" in out


def test_flipped_advantages_and_dropped_token_are_caught(my_baseline, capsys):
    loss, base = my_baseline
    capsys.readouterr()
    assert check.main(["--loss", _write(loss, adv="-b.advantages"), "--baseline", str(base),
                       "--no-model"]) == 1
    assert "W scaled ×−1.00 against the baseline (sign flipped)" in capsys.readouterr().out
    assert check.main(["--loss", _write(loss, mask=NO_LAST), "--baseline", str(base),
                       "--no-model"]) == 1
    out = capsys.readouterr().out
    n_last = {s: int(random_batch(n_groups=4, G=4, T=12, seed=s, **REGIMES["on"]).mask.sum())
              for s in check.SEEDS}  # W ≠ 0 at every response token of the "on" batches
    assert f"tokens with W≠0 [seed 0] {n_last[0]} → {n_last[0] - 16}" in out  # 16 rows
    assert check.main(["--loss", _write(loss), "--baseline", str(base), "--no-model"]) == 0


def _fails(out: str) -> dict[str, str]:
    """{scenario: its FAIL line} of a `gradlab check` report."""
    return {ln.split(": ")[0][5:]: ln for ln in out.splitlines() if ln.startswith("FAIL ")}


def test_a_detached_gradient_is_named(my_baseline, capsys):
    """The first response token's log-prob detached: W is 0 there, on every row."""
    loss, base = my_baseline
    capsys.readouterr()
    detached = "torch.cat([b.logps[:, :1].detach(), b.logps[:, 1:]], 1)"
    assert check.main(["--loss", _write(loss, logps=detached), "--baseline", str(base),
                       "--no-model"]) == 1
    fails = _fails(capsys.readouterr().out)
    first = [random_batch(n_groups=4, G=4, T=12, seed=s, **REGIMES["on"]).mask[:, 0]
             for s in check.SEEDS]
    assert [int(m.sum()) for m in first] == [16] * 3  # 16 rows, each starts with a response token
    line = fails["synthetic/loss:drgrpo_loss/on"]
    assert ("W changed: W is 0 on 16 token(s) at each of 3 seeds where the baseline had a "
            "gradient (a detached or missing gradient, or a clip?): tokens with W≠0 [seed 0]"
            ) in line, line


def test_a_rescale_that_differs_by_seed_is_named_per_seed(my_baseline, capsys):
    """Normalised by the batch's response tokens instead of B·T: W × B·T/Σmask, per batch."""
    loss, base = my_baseline
    capsys.readouterr()
    assert check.main(["--loss", _write(loss, factor="(b.B * b.T) / b.mask.sum()"),
                       "--baseline", str(base), "--no-model"]) == 1
    fails = _fails(capsys.readouterr().out)
    batches = [random_batch(n_groups=4, G=4, T=12, seed=s, **REGIMES["on"]) for s in check.SEEDS]
    factors = [cb.factor_text(b.B * b.T / float(b.mask.sum())) for b in batches]
    assert len(set(factors)) == 3
    assert fails["synthetic/loss:drgrpo_loss/on"].endswith(
        "W scaled per seed: " + ", ".join(f"{f} [seed {s}]" for s, f in enumerate(factors))
        + " against the baseline (a factor that depends on the batch: a normalisation?)")


def test_exact_on_this_machine_tolerances_on_another(my_baseline, capsys):
    loss, base = my_baseline
    spec = _write(loss)
    b = json.loads(base.read_text())
    assert b["fingerprint"]["threads"] == 1
    assert {"cpu_model", "cpu_capability", "torch", "transformers"} <= set(b["fingerprint"])
    assert len(b["code_hash"]) == 16
    # a W statistic moved by 1e-12 of Σ|W|: beyond round-off (exact mode), within the 1e-9
    # tolerance of another machine
    w = b["scenarios"]["synthetic/loss:drgrpo_loss/near"]["W"][1]
    w["dot_r1"] += 1e-12 * w["sum_abs"]
    base.write_text(json.dumps(b))
    capsys.readouterr()
    assert check.main(["--loss", spec, "--baseline", str(base), "--no-model"]) == 1
    out = capsys.readouterr().out
    assert "compared exactly" in out and "FAIL synthetic/loss:drgrpo_loss/near: W changed: ΣW·r₁ [seed 1]" in out
    b["fingerprint"]["cpu_model"] = "another CPU"
    base.write_text(json.dumps(b))
    assert check.main(["--loss", spec, "--baseline", str(base), "--no-model"]) == 0
    out = capsys.readouterr().out
    assert "baseline made on another machine (cpu_model: another CPU →" in out
    assert "compared with tolerances" in out
    # ... where a rescale is still far outside the tolerance
    assert check.main(["--loss", _write(loss, factor="2.0"), "--baseline", str(base),
                       "--no-model"]) == 1
    assert "W scaled ×2.00 against the baseline" in capsys.readouterr().out
    # merging some scenarios of this machine into another machine's baseline is refused
    assert check.main(["--loss", spec, "--baseline", str(base), "--update", "--no-model",
                       "--only", "near"]) == 2
    assert "made on another machine; rerun --update without them" in capsys.readouterr().err


def test_common_factor_needs_every_statistic():
    rec = [{"sum": 0.1, "sum_abs": 1.0, "l2": 0.3, "dot_r1": -0.2, "dot_r2": 0.05, "nnz": 10}]
    two = [{k: 2 * v if k != "nnz" else v for k, v in rec[0].items()}]
    assert cb.compare_w(rec, rec, 1e-12) is None
    assert cb.compare_w(two, rec, 1e-12) == "W scaled ×2.00 against the baseline"
    assert cb.factor_text(1.0001) == "×1.0001" and cb.factor_text(-0.5) == "×−0.50"
    bent = [{**two[0], "dot_r2": 0.2}]  # one projection off the common factor
    msg = cb.compare_w(bent, rec, 1e-12)
    assert msg.startswith("W changed: ") and "ΣW·r₂ 0.05 → 0.2" in msg
    fewer = [{**rec[0], "nnz": 9}]  # a token fewer
    assert cb.compare_w(fewer, rec, 1e-12) == (
        "W changed: W is 0 on 1 token(s) where the baseline had a gradient (a detached or "
        "missing gradient, or a clip?): tokens with W≠0 10 → 9")
    assert cb.compare_w([{**rec[0], "nnz": 12}], rec, 1e-12).startswith(
        "W changed: W is non-zero on 2 token(s) where the baseline had none")
    assert cb.compare_w([{**two[0], "nnz": 9}], rec, 1e-12).startswith("W changed: W is 0 on 1 ")
    assert cb.compare_w(rec, [{"sum": 0.1}], 1e-12).startswith("W: the baseline's W record lacks")
    nan = [{**rec[0], "sum": float("nan")}]
    assert cb.compare_w(nan, rec, 1e-12).startswith("W changed: ΣW 0.1 → nan")


def test_changed_default_lr_is_seen_in_model_off(tmp_path, monkeypatch, capsys):
    """A halved RunConfig learning rate changes W after the model/off step (and only there)."""
    base = tmp_path / "b.json"
    assert check.main(["--update", "--baseline", str(base), "--only", "model/grpo/"]) == 0
    assert json.loads(base.read_text())["model_setup"]["training"]["lr"] == RunConfig().lr

    @dataclasses.dataclass
    class HalfLr(RunConfig):
        lr: float = RunConfig().lr / 2

    monkeypatch.setattr(config, "RunConfig", HalfLr)
    capsys.readouterr()
    assert check.main(["--baseline", str(base), "--only", "model/grpo/"]) == 1
    out = capsys.readouterr().out
    assert "FAIL model/grpo/off: W changed" in out and "FAIL model/grpo/on" not in out
    assert f"lr: {RunConfig().lr} → {RunConfig().lr / 2}" in out
    assert "scenario(s) failed: model/grpo/off" in out


def test_gspo_clip_bound_is_seen_in_close(monkeypatch, capsys):
    """GSPO's upper sequence-clip bound 4e-4 → 5e-4: only the "close" regime (sequence ratios
    straddling the bounds) sees it; the shipped baseline names the scenarios."""
    monkeypatch.setattr(GSPO.__init__, "__defaults__", ((3e-4, 5e-4), 0.0))
    assert check.main(["--only", "synthetic/gspo/", "--no-model"]) == 1
    out = capsys.readouterr().out
    assert "scenario(s) failed: synthetic/gspo/close\n" in out
    assert "FAIL synthetic/gspo/close: |Δρ|" in out and "W changed" in out


def test_rollout_that_differs_fails_here_and_is_noted_elsewhere(tmp_path, capsys):
    b = json.loads(check.BASELINE.read_text())
    b["fingerprint"], b["rollout"] = cb.fingerprint(1), "0123456789abcdef"
    p = tmp_path / "b.json"
    p.write_text(json.dumps(b))
    assert check.main(["--baseline", str(p), "--only", "model/grpo/"]) == 1
    out = capsys.readouterr().out
    assert "FAIL model/grpo/off: rollout differs from the baseline's" in out
    assert "on the same machine: the sampler, task or policy changed" in out
    b["fingerprint"]["cpu_model"] = "another CPU"  # another machine may sample otherwise
    p.write_text(json.dumps(b))
    assert check.main(["--baseline", str(p), "--only", "model/grpo/"]) == 0
    out = capsys.readouterr().out
    assert "samples differ from baseline: not compared" in out
    assert "checked against the invariants only" in out


def test_old_rho_only_baseline_still_reads(tmp_path, capsys):
    old = json.loads(check.BASELINE.read_text())
    old["fingerprint"] = old.pop("rollout")  # the ρ-only format: a rollout hash string
    for v in old["scenarios"].values():
        del v["W"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    assert check.main(["--baseline", str(p), "--only", "synthetic/gspo/"]) == 0
    out = capsys.readouterr().out
    assert "no machine fingerprint in the baseline" in out and "no W record" in out


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


def test_helpers_refuse_an_undefined_ratio():
    """A loss with no gradient at the shared tokens has nothing to cancel: ρ is NaN (undefined,
    not 0), and assert_cancels / assert_cancels_in_regimes say so instead of passing."""
    def no_gradient(b):
        return 0.0 * b.logps.sum()

    with pytest.raises(AssertionError, match="undefined"):
        assert_cancels(no_gradient)
    with pytest.raises(AssertionError, match="ρ undefined"):
        assert_cancels_in_regimes(no_gradient, regimes=("on",), seeds=range(1))
    with pytest.raises(AssertionError, match="expected a residual"):
        assert_does_not_cancel(no_gradient)


def test_assert_matches_baseline(tmp_path):
    p = tmp_path / "ci.json"
    with pytest.raises(AssertionError, match="no baseline at"):
        assert_matches_baseline(drgrpo_loss, p, model=False)
    assert_matches_baseline(drgrpo_loss, p, model=False, update=True)
    assert_matches_baseline(drgrpo_loss, p, model=False)
    with pytest.raises(AssertionError, match="has no scenario synthetic/loss:other/on "):
        assert_matches_baseline(drgrpo_loss, p, model=False, name="other")
    with pytest.raises(AssertionError, match=r"synthetic/loss:drgrpo_loss/far: W scaled ×0\.50"):
        assert_matches_baseline(lambda b: drgrpo_loss(b) / 2, p, model=False, name="drgrpo_loss")
    with pytest.raises(AssertionError, match="expected cancellation"):  # and the invariants
        assert_matches_baseline(seqnorm_loss, p, model=False, name="drgrpo_loss")


def test_regime_report_rows():
    rows = regime_report(seqnorm_loss, regimes=("on", "on-eq"), seeds=(0, 1))
    assert [(r["regime"], r["seed"]) for r in rows] == [("on", 0), ("on", 1), ("on-eq", 0),
                                                        ("on-eq", 1)]
    assert rows[0]["ratio"] > 1e-3 and rows[2]["ratio"] < 1e-12
    with pytest.raises(ValueError, match="unknown regime"):
        regime_report(seqnorm_loss, regimes=("sideways",))


def test_an_undefined_rho_prints_as_a_dash_not_0(capsys):
    """DFPO Min-Replace off-policy: GSPO's clip zeroes a group's min weight, so W ≡ 0 at every
    full-group token — ρ there is undefined and printed —⁰ (with its legend), never 0."""
    from gradlab.check.run import UNDEFINED
    from gradlab.cli.main import main

    assert main(["check", "--only", "dfpo-min/near", "--no-model"]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("synthetic/dfpo-min/near"))
    assert row.split()[1] == UNDEFINED and f"{UNDEFINED} undefined" in out
