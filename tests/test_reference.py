"""The statistical half of `gradlab reproduce --check` (gradlab.loop.recipes.reference): each
number's two-sample t against the reference's seeds, computed independently here; the shift it
detects at 80 % power, checked by simulation; a policy that does not learn is caught; round-off
numbers are held to their bound; NaN prints "—"; bad reference files get one clear error."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import t as student_t
from scipy.stats import ttest_ind

from gradlab.loop.recipes.reference import (
    CHECKED,
    LEVEL,
    REFERENCE,
    detectable_shift,
    fmt,
    load_reference,
    make_reference,
    numbers_of,
    stat_check,
    stat_report,
)
from gradlab.loop.recipes.reproduce import markdown_table

# held-out expected accuracy of the shipped initial policy (what a run with lr 1e-9 ends at):
# `gradlab eval gradlab/data/default_policy --problems 64` prints accuracy_expected 42.4 %
UNTRAINED = 0.424
ACCURACY = ("acc_last5", "eval_accuracy_expected_final")


@pytest.fixture(scope="module")
def shipped():
    return load_reference(REFERENCE)


def _like(ref: dict, k: int, shift: dict | None = None) -> dict[str, list[float]]:
    """Synthetic check values: per number the reference's first k seeds (k = 1: its mean), with
    the numbers in `shift` (metric → value) moved to that value plus the same seed deviations."""
    out = {}
    for key, r in ref["numbers"].items():
        v = np.array(r["values"])
        dev = (v - v.mean())[:k] if k > 1 else np.zeros(1)
        metric = key.split("/")[1]
        base = (shift or {}).get(metric, None)
        out[key] = list(v[:k]) if base is None and k > 1 else list((r["mean"] if base is None
                                                                     else base) + dev)
    return out


def test_t_is_the_two_sample_t_of_the_means(shipped):
    vals = _like(shipped, 3, {"acc_last5": 0.5})
    rows = stat_check(vals, shipped).set_index(["objective", "metric"])
    for key, r in shipped["numbers"].items():
        obj, metric = key.split("/")
        row = rows.loc[(obj, metric)]
        if row["test"] == "bound":
            assert max(abs(x) for x in r["values"]) <= 1e-6
            continue
        want = ttest_ind(vals[key], r["values"], equal_var=True).statistic  # pooled, df n+K−2
        assert row["t"] == pytest.approx(want, rel=1e-9), key
        assert row["crit"] == pytest.approx(student_t.ppf(1 - (1 - LEVEL) / 2, 5 + 3 - 2))
        assert row["flagged"] == (abs(want) > row["crit"])
    one = stat_check({k: [v[0]] for k, v in vals.items()}, shipped).set_index(
        ["objective", "metric"])
    r = shipped["numbers"]["gspo/entropy"]
    sd = np.std(r["values"], ddof=1)  # K = 1: the reference's own sd, df n − 1
    want = (vals["gspo/entropy"][0] - np.mean(r["values"])) / (sd * math.sqrt(1 / 5 + 1))
    assert one.loc[("gspo", "entropy"), "t"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("n,k", [(5, 1), (5, 3), (3, 2)])
def test_detectable_shift_has_the_stated_power(n, k):
    """Simulated: a shift of `detectable_shift` sd is flagged in 80 % of draws (± 1 %)."""
    rng = np.random.default_rng(0)
    shift, draws = detectable_shift(n, k), 40_000
    ref, chk = rng.normal(size=(draws, n)), rng.normal(size=(draws, k)) + shift
    df = n - 1 if k == 1 else n + k - 2
    ss = ((ref - ref.mean(1, keepdims=True)) ** 2).sum(1)
    if k > 1:
        ss += ((chk - chk.mean(1, keepdims=True)) ** 2).sum(1)
    t = (chk.mean(1) - ref.mean(1)) / (np.sqrt(ss / df) * math.sqrt(1 / n + 1 / k))
    power = np.mean(np.abs(t) > student_t.ppf(1 - (1 - LEVEL) / 2, df))
    assert power == pytest.approx(0.8, abs=0.01)
    assert detectable_shift(n, k + 2) < detectable_shift(n, k)  # more seeds, smaller shifts


def test_a_policy_that_does_not_learn_is_caught(shipped):
    """Accuracy at the untrained policy's level: flagged at K = 1 (GSPO's held-out accuracy,
    whose seed spread is smallest) and, at K = 3, in every objective; the same synthetic seeds
    without the shift flag nothing."""
    k1 = stat_check(_like(shipped, 1, dict.fromkeys(ACCURACY, UNTRAINED)), shipped)
    assert set(k1.loc[k1["flagged"], "metric"]) <= set(ACCURACY) and k1["flagged"].any()
    k3 = stat_check(_like(shipped, 3, dict.fromkeys(ACCURACY, UNTRAINED)), shipped)
    bad = k3[k3["flagged"]]
    assert set(bad["metric"]) <= set(ACCURACY)
    assert set(bad["objective"]) == {"grpo", "gspo", "dfpo-min", "dfpo-orth"}
    for k in (1, 3):
        assert not stat_check(_like(shipped, k), shipped)["flagged"].any()


def test_round_off_numbers_are_held_to_their_bound(shipped):
    vals = _like(shipped, 1)
    vals["grpo/tax_share"] = [4.2e-4]  # seed 8 here: one step's PPO clip (ρ 0.027 at step 0)
    vals["grpo/rho_prefix"] = [0.2]  # GRPO no longer cancels
    rows = stat_check(vals, shipped)
    bad = rows[rows["flagged"]]
    assert list(zip(bad["objective"], bad["metric"], bad["test"])) == [
        ("grpo", "rho_prefix", "bound")]
    text = stat_report(rows, shipped)
    assert "1 of 28 numbers FLAGGED" in text and shipped["machine"]["cpu_model"] in text


def test_nan_prints_a_dash_with_its_reason(shipped):
    vals = _like(shipped, 1)
    vals["gspo/entropy"] = [float("nan")]
    rows = stat_check(vals, shipped)
    row = rows.set_index(["objective", "metric"]).loc[("gspo", "entropy")]
    assert row["flagged"] and "not finite" in row["reason"]
    text = stat_report(rows, shipped)
    assert "nan" not in text.lower().replace("finite", "")
    assert "| — (1) |" in text
    assert fmt(float("nan")) == "—" and fmt(None) == "—" and fmt(0.0) == "0"
    md = markdown_table(pd.DataFrame({"objective": ["grpo"], "rho": [float("nan")],
                                      "tokens": [12]}))
    assert "—" in md and "nan" not in md and "12" in md


def test_one_reference_seed_is_untested_not_passed():
    ref = {"numbers": {"grpo/entropy": {"values": [0.15]}}}
    rows = stat_check({"grpo/entropy": [0.9]}, ref)
    assert not rows["flagged"].any() and math.isnan(rows["t"].iloc[0])
    assert "no seed spread" in rows["reason"].iloc[0]
    assert "untested" in stat_report(rows, {"numbers": {}, "machine": {}})


def test_make_reference_keeps_the_per_seed_values():
    frames = [pd.DataFrame({"objective": ["grpo"], **{m: [0.1 * (s + 1)] for m in CHECKED}})
              for s in range(3)]
    ref = make_reference(frames, [0, 1, 2], {"cpu_model": "x"})
    r = ref["numbers"]["grpo/entropy"]
    assert r["values"] == pytest.approx([0.1, 0.2, 0.3]) and r["sd"] == pytest.approx(0.1)


def test_bad_reference_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no reference"):
        load_reference(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a gradlab reference"):
        load_reference(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a gradlab reference"):
        load_reference(tmp_path / "other.json")
    (tmp_path / "v2.json").write_text(json.dumps({"gradlab_reference": 2, "numbers": {}}))
    with pytest.raises(ValueError, match="lacks"):
        load_reference(tmp_path / "v2.json")
    with pytest.raises(ValueError, match="at least 3 seeds"):
        make_reference([pd.DataFrame({"objective": ["grpo"]})] * 2, [0, 1], {})


def test_a_one_seed_reference_round_trips_through_strict_json(tmp_path):
    """One seed: sd and the band are undefined, written as null with their reason (no NaN
    token), read back as NaN; the statistical check leaves them untested and does not crash."""
    from gradlab import jsonio

    frame = pd.DataFrame({"objective": ["grpo"], **{m: [0.25] for m in CHECKED}})
    ref = {"gradlab_reference": 1, "seeds": [0], "machine": {}, "numbers": numbers_of([frame])}
    text = jsonio.dumps(ref)
    entry = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}"))["numbers"][
        "grpo/entropy"]
    assert entry["sd"] is None and entry["undefined"] == dict.fromkeys(
        ("hi", "lo", "sd"), "one seed: no seed spread")
    (tmp_path / "one.json").write_text(text)
    back = load_reference(tmp_path / "one.json")["numbers"]["grpo/entropy"]
    assert math.isnan(back["sd"]) and back["values"] == [0.25] and back["mean"] == 0.25
    rows = stat_check({k: [0.25] for k in ref["numbers"]}, load_reference(tmp_path / "one.json"))
    assert not rows["flagged"].any() and "untested" in stat_report(rows, ref)


def test_an_undefined_number_is_compared_as_undefined():
    """A summary number undefined in the reference (null with its reason) equals an undefined
    one in the check and differs from a defined one; its reason entry is not a number."""
    from gradlab import jsonio
    from gradlab.loop.recipes.baseline import compare_numbers, summary_numbers

    summ = pd.DataFrame({"objective": ["grpo"], "rho_prefix": [float("nan")],
                         "entropy": [0.5], "time_step_s": [1.0]})
    saved = summary_numbers(summ)
    assert saved["grpo"]["undefined"] == {"rho_prefix": "no finite value at any step of the run"}
    ref = jsonio.loads(jsonio.dumps({"runs": [{"summary": saved}]}))
    assert math.isnan(ref["runs"][0]["summary"]["grpo"]["rho_prefix"])
    assert compare_numbers(ref, 0, summary_numbers(summ)) == []
    defined = summary_numbers(summ.assign(rho_prefix=[0.1]))
    rows = compare_numbers(ref, 0, defined)
    assert [(r["what"], r["new"]) for r in rows] == [("rho_prefix", 0.1)] and \
        math.isnan(rows[0]["ref"])
