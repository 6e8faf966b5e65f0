"""`gradlab reproduce --save-reference` and `--check FILE` on real tiny runs: unchanged code is
"identical"; a changed loss or default is caught with the series and the first step where it
parted; a run made by other code (gradlab's or the user's loss file) is never reused, and is
set aside, never deleted; another machine falls back to the statistical comparison and says
so; a one-seed reference is strict JSON, checks exactly here and says in one line what a check
elsewhere needs; options that cannot go with a saved reference are refused; a run is never
resumed to fewer steps than it holds."""

import hashlib
import json
import math
import shutil

import pytest

from gradlab import provenance
from gradlab.cli.main import main
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
    assert f"{saved / 'c'} held a run (--fresh): moved to {saved / 'c.prev-1'}" in out
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
    assert "identical" in out and (saved / "e.prev-1").is_dir()
    assert f"|Δ| ≤ {RTOL:g}" in out and "code: the reference's" in out


def _on_another_machine(folder) -> None:
    """folder/ref.json as saved on "Another CPU", written to folder/other.json."""
    ref = json.loads((folder / "ref.json").read_text())
    for fp in [ref["fingerprint"]] + [r["fingerprint"] for r in ref["runs"]]:
        fp["cpu_model"] = "Another CPU"
    (folder / "other.json").write_text(json.dumps(ref))


def test_another_machine_falls_back_to_statistics(saved, capsys):
    _on_another_machine(saved)
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


def _strict(text: str) -> dict:
    """A strict JSON parse: a bare NaN or Infinity token is an error."""
    def refuse(token):
        raise ValueError(f"bare {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def one_seed(tmp_path_factory):
    """A one-seed reference saved without --out (its runs beside it, in ref.runs)."""
    d = tmp_path_factory.mktemp("one")
    assert main(["reproduce", *TINY, "--save-reference", str(d / "ref.json")]) == 0
    return d


def test_a_one_seed_reference_is_strict_json_and_checks_exactly(one_seed, capsys):
    ref = _strict((one_seed / "ref.json").read_text())
    assert ref["seeds"] == [0] and ref["config"]["out"] == str(one_seed / "ref.runs")
    assert (one_seed / "ref.runs" / "metrics.jsonl").is_file()
    entry = ref["numbers"]["grpo/entropy"]  # one seed: no spread, null with its reason
    assert entry["sd"] is None and entry["undefined"]["sd"] == "one seed: no seed spread"
    assert len(entry["values"]) == 1 and math.isfinite(entry["mean"])
    evals = ref["runs"][0]["series"]["grpo"]["eval_accuracy"]  # evaluated at step 1 only
    assert evals["steps"] == [0, 1] and evals["values"][0] is None
    code, out = _check(one_seed, capsys)
    assert code == 0, out
    assert f"reused {one_seed / 'ref.runs'}" in out and "identical" in out


def test_a_one_seed_reference_on_another_machine_says_what_to_run(one_seed, capsys):
    _on_another_machine(one_seed)
    assert main(["reproduce", "--check", str(one_seed / "other.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, before any work
    assert "cpu_model 'Another CPU'" in err and "needs a reference of ≥ 2 seeds" in err
    assert "--seeds 3 --save-reference FILE" in err and "--steps 2" in err


LOSS = """import torch

SIGN = {sign}


def fn(batch):
    m = batch.mask.float()
    ratio = torch.exp(batch.logps - batch.old_logps)
    s = ratio * batch.advantages.unsqueeze(-1) * m
    return -SIGN * s.sum() / (batch.norm_seqs * batch.norm_width)
"""


def test_a_changed_user_loss_file_is_re_run_and_named(tmp_path, capsys):
    """The reference trains the user's loss file; after the file changes, --check re-runs it
    (gradlab's code is unchanged), names the file and finds the change; the reference's own
    runs are set aside, not deleted."""
    loss = tmp_path / "my_obj.py"
    loss.write_text(LOSS.format(sign=1.0))
    ref = tmp_path / "ref.json"
    assert main(["reproduce", *TINY, "--objectives", f"{loss}:fn,grpo", "--seeds", "2",
                 "--save-reference", str(ref)]) == 0
    before = hashlib.sha256(loss.read_bytes()).hexdigest()[:16]
    runs = tmp_path / "ref.runs"
    kept = (runs / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    loss.write_text(LOSS.format(sign=-1.0))  # the advantage's sign flipped
    code = main(["reproduce", "--check", str(ref), "--seeds", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    after = hashlib.sha256(loss.read_bytes()).hexdigest()[:16]
    assert f"made with other user files ({loss} ({before} → {after}))" in out
    assert f"user files changed since the reference: {loss} ({before} → {after})" in out
    assert "| 0 | fn | loss | 0 |" in out and "CHANGED:" in out
    assert (tmp_path / "ref.runs.prev-1" / "metrics.jsonl").read_bytes() == kept
    assert _strict(ref.read_text())["user_files"] == {str(loss): before}


def test_a_second_check_keeps_the_first_checks_runs(saved, capsys):
    shutil.copytree(saved / "a", saved / "k")
    kept = (saved / "k" / "metrics.jsonl").read_bytes()
    for n in (1, 2):
        code, out = _check(saved, capsys, "--seeds", "1", "--out", str(saved / "k"), "--fresh")
        assert code == 0 and f"moved to {saved / f'k.prev-{n}'}" in out, out
    assert (saved / "k.prev-1" / "metrics.jsonl").read_bytes() == kept
    assert (saved / "k.prev-2" / "metrics.jsonl").is_file() and (saved / "k").is_dir()


def test_user_files_are_hashed_by_content(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mod_loss.py").write_text("def f(b):\n    return b\n")
    (tmp_path / "inst.py").write_text("X = 1\n")
    (tmp_path / "task.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    sha = {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()[:16]
           for n in ("mod_loss.py", "inst.py", "task.jsonl")}
    cfg = {"objectives": ["mod_loss:f[name=a]", "grpo", "gone.py:g"], "task": "task.jsonl",
           "instruments": "cheap,inst.py:Mine@4"}
    assert provenance.user_files(cfg) == {"mod_loss": sha["mod_loss.py"], "gone.py": "missing",
                                          "inst.py": sha["inst.py"],
                                          "task.jsonl": sha["task.jsonl"]}
    assert provenance.user_files({"objectives": ["grpo"], "task": "arithmetic"}) == {}


def test_a_run_is_never_resumed_to_fewer_steps(saved, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(saved / "a", run)
    assert main(["reproduce", *TINY, "--out", str(run), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "finished run of 2 steps, longer than --steps 1" in err and "--resume" not in err
    assert main(["reproduce", "--out", str(run), "--steps", "1", "--resume",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be shortened" in err, err
    assert json.loads((run / "config.json").read_text())["steps"] == 2
