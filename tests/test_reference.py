"""The main job's reference and `gradlab reproduce --check`: bands from real seed spreads, a run
inside them passes, a broken loss falls outside, bad reference files get one clear error."""

import json

import numpy as np
import pandas as pd
import pytest
from scipy.stats import t as student_t

from analyses import main_job
from gradlab.loop.recipes.reference import CHECKED, check, load_reference, make_reference, report


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Three seeds of a 3-step main job (real runs), their reference and summaries."""
    d = tmp_path_factory.mktemp("mj")
    assert main_job.main(["--quick", "--runs", str(d)]) == 0
    ref = load_reference(d / "reproduce_reference.json")
    long = pd.read_csv(d / "main_job.csv")
    per_seed = {k: g.pivot(index="objective", columns="metric", values="value").reset_index()
                for k, g in long.groupby("seed")}
    return d, ref, per_seed


def test_bands_are_prediction_intervals_of_the_seed_spread(quick):
    _, ref, per_seed = quick
    assert ref["seeds"] == [0, 1, 2] and ref["machine"]["threads"] == 1
    q = student_t.ppf(0.9995, 2) * np.sqrt(1 + 1 / 3)
    for key, r in ref["numbers"].items():
        obj, metric = key.split("/")
        vals = [float(s.set_index("objective").loc[obj, metric]) for s in per_seed.values()]
        assert r["values"] == pytest.approx(vals)
        floor, (low, high) = CHECKED[metric]
        half = max(q * np.std(vals, ddof=1), floor)
        assert (r["lo"], r["hi"]) == pytest.approx(
            (max(np.mean(vals) - half, low), min(np.mean(vals) + half, high)))
    assert {k.split("/")[0] for k in ref["numbers"]} == {"grpo", "gspo", "dfpo-min", "dfpo-orth"}


def test_each_seed_is_inside_and_a_broken_loss_is_outside(quick):
    _, ref, per_seed = quick
    for s in per_seed.values():
        assert check(s, ref)["inside"].all()
    broken = per_seed[0].copy()
    broken.loc[broken["objective"] == "grpo", "rho_prefix"] = 0.2  # GRPO no longer cancels
    rows = check(broken, ref)
    bad = rows[~rows["inside"]]
    assert list(zip(bad["objective"], bad["metric"])) == [("grpo", "rho_prefix")]
    text = report(rows, ref)
    assert "OUTSIDE" in text and "1 of" in text and ref["machine"]["cpu_model"] in text
    missing = check(per_seed[0][per_seed[0]["objective"] != "gspo"], ref)
    assert not missing[missing["objective"] == "gspo"]["inside"].any()


def test_bad_reference_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no reference"):
        load_reference(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a gradlab reference"):
        load_reference(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a gradlab reference"):
        load_reference(tmp_path / "other.json")
    with pytest.raises(ValueError, match="at least 3 seeds"):
        make_reference([pd.DataFrame({"objective": ["grpo"]})] * 2, [0, 1], {})


def test_reproduce_check_end_to_end(quick, tmp_path, capsys):
    """`gradlab reproduce --check REF` at the reference's own configuration and seed: every
    number inside, exit 0 (same machine: bitwise); a band moved off the run's value: exit 1."""
    from gradlab.cli import main

    d, ref, _ = quick
    args = ["reproduce", "--steps", "3", "--prompts", "2", "--G", "4", "--minibatches", "2",
            "--probe-contexts", "2", "--tax-every", "1", "--ckpt-every", "100", "--eval-every", "3",
            "--eval-size", "16", "--threads", "1", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "a"), "--check", str(d / "reproduce_reference.json")]) == 0
    out = capsys.readouterr().out
    assert "all inside" in out and "OUTSIDE" not in out
    moved = json.loads((d / "reproduce_reference.json").read_text())
    band = moved["numbers"]["gspo/rho_trie"]
    band["lo"], band["hi"] = band["hi"] + 1, band["hi"] + 2
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    assert main(args + ["--out", str(tmp_path / "b"), "--check", str(tmp_path / "moved.json")]) == 1
    assert "1 of 28 numbers OUTSIDE" in capsys.readouterr().out
