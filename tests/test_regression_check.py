"""`gradlab reproduce --save-reference` and `--check FILE` on real tiny runs: unchanged code is
"identical"; a changed loss or default is caught with the series and the first step where it
parted; a run made by other code is never reused; another machine falls back to the
statistical comparison and says so; options that cannot go with a saved reference are refused."""

import json
import shutil

import pytest

from gradlab.cli import main
from gradlab.core.losses import GRPO
from gradlab.loop.recipes.baseline import RTOL

TINY = ["--steps", "2", "--prompts", "2", "--G", "4", "--minibatches", "2", "--probe-contexts",
        "2", "--tax-every", "1", "--ckpt-every", "100", "--eval-every", "2", "--eval-size", "8",
        "--objectives", "grpo,gspo", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A reference saved from two seeds of a 2-step run (folders a, a-seed1)."""
    d = tmp_path_factory.mktemp("regress")
    assert main(["reproduce", *TINY, "--out", str(d / "a"), "--seeds", "2",
                 "--save-reference", str(d / "ref.json")]) == 0
    ref = json.loads((d / "ref.json").read_text())
    assert ref["seeds"] == [0, 1] and ref["config"]["steps"] == 2
    assert {"cpu_model", "torch", "threads"} <= set(ref["fingerprint"])
    assert set(ref["runs"][0]["series"]["grpo"]["loss"]) == {"steps", "values"}
    assert not any(m.startswith("time_") for m in ref["runs"][0]["series"]["grpo"])
    return d


def _check(d, capsys, *extra) -> tuple[int, str]:
    code = main(["reproduce", "--check", str(d / "ref.json"), *extra])
    return code, capsys.readouterr().out


def test_a_run_of_the_same_code_is_reused_and_said(saved, capsys):
    code, out = _check(saved, capsys)  # the reference's own folders, both seeds
    assert code == 0, out
    assert f"reused {saved / 'a'}: a finished run of this code" in out
    assert f"reused {saved / 'a-seed1'}" in out and "identical" in out


def test_a_changed_loss_is_caught_with_the_first_step(saved, capsys, monkeypatch):
    """GRPO's loss ×2 (Adam nearly undoes the scale): the same code hash, so --fresh."""
    loss = GRPO.policy_loss
    monkeypatch.setattr(GRPO, "policy_loss", lambda self, b: 2 * loss(self, b))
    shutil.copytree(saved / "a", saved / "c")
    code, out = _check(saved, capsys, "--seeds", "1", "--out", str(saved / "c"), "--fresh")
    assert code == 1, out
    assert f"{saved / 'c'} held a run (--fresh): moved to {saved / 'c.prev'}" in out
    assert "| 0 | grpo | loss | 0 |" in out  # the loss series parted at step 0
    assert "CHANGED:" in out and "| gspo |" not in out  # GSPO's policy trains apart


def test_a_run_of_other_code_is_never_reused_and_the_rerun_is_identical(saved, capsys):
    """The reference's seed-0 run with a faked code hash: moved aside, re-trained, identical."""
    shutil.copytree(saved / "a", saved / "e")
    prov = json.loads((saved / "e" / "provenance.json").read_text())
    for seg in prov["segments"]:
        seg["code_hash"] = "0123456789abcdef"
    (saved / "e" / "provenance.json").write_text(json.dumps(prov))
    code, out = _check(saved, capsys, "--seeds", "1", "--out", str(saved / "e"))
    assert code == 0, out
    assert "made by other code (0123456789abcdef;" in out and "trained afresh" in out
    assert "identical" in out and (saved / "e.prev").is_dir()
    assert f"|Δ| ≤ {RTOL:g}" in out and "code: the reference's" in out


def test_another_machine_falls_back_to_statistics(saved, capsys):
    ref = json.loads((saved / "ref.json").read_text())
    for fp in [ref["fingerprint"]] + [r["fingerprint"] for r in ref["runs"]]:
        fp["cpu_model"] = "Another CPU"
    (saved / "other.json").write_text(json.dumps(ref))
    code = main(["reproduce", "--check", str(saved / "other.json")])
    out = capsys.readouterr().out
    assert "fallback: another machine than the reference's: cpu_model 'Another CPU'" in out
    assert "two-sample t" in out and "Exact check" not in out
    assert code == 0, out  # the same runs: every t is 0


def test_a_changed_default_is_a_change(saved, capsys):
    ref = json.loads((saved / "ref.json").read_text())
    ref["config"]["temperature"] = 0.5  # as if the default had been 0.5 when it was saved
    (saved / "t.json").write_text(json.dumps(ref))
    code = main(["reproduce", "--check", str(saved / "t.json"), "--seeds", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "default changed since the reference: --temperature: 0.5 → 1.0" in out


def test_options_that_do_not_go_with_a_saved_reference(saved, capsys):
    assert main(["reproduce", "--check", str(saved / "ref.json"), "--lr", "0.001"]) == 2
    assert "--lr 0.001 (the reference: 0.0002)" in capsys.readouterr().err
    assert main(["reproduce", "--check", str(saved / "ref.json"), "--seeds", "3"]) == 2
    assert "the reference holds 2 seed(s)" in capsys.readouterr().err
    assert main(["reproduce", "--seeds", "2", *TINY]) == 2
    assert "--seeds: only with --check or --save-reference" in capsys.readouterr().err
    assert main(["reproduce", "--check", str(saved / "ref.json"), "--save-reference",
                 str(saved / "x.json")]) == 2
    assert main(["reproduce", "--check", str(saved / "nope.json")]) == 2
    assert "--check: no reference at" in capsys.readouterr().err
    assert main(["reproduce", "--check", "--steps", "10"]) == 2  # the shipped main job's size
    assert "--steps 10 (the reference: 150)" in capsys.readouterr().err
