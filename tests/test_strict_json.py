"""Strict JSON everywhere gradlab writes: an undefined value is `null` with its reason, never a
NaN/Infinity token and never 0; read back it is NaN with the reason."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

import gradlab
from gradlab import jsonio, objectives, provenance
from gradlab.check import run as check
from gradlab.check.scenarios import random_batch
from gradlab.loop.config import RunConfig
from gradlab.loop.runs.store import REASON, RunStore, load_run
from gradlab.loop.train import train
from gradlab.viz.undefined import TIED

torch.set_num_threads(1)


def strict_load(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity tokens."""
    def refuse(token):
        raise AssertionError(f"bare {token} token: not strict JSON")

    return json.loads(text, parse_constant=refuse)


def strict_files(folder: Path) -> list[Path]:
    """Parse every .json and .jsonl file under `folder` strictly; returns the files."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl"))
    for p in files:
        text = p.read_text()
        if p.suffix == ".jsonl":
            for line in text.splitlines():
                strict_load(line)
        else:
            strict_load(text)
    return files


# --- the convention --------------------------------------------------------------------------
def test_jsonio_writes_null_with_a_reason_and_reads_nan_back():
    rec = {"rho": math.nan, "share": float("inf"), "n": 0.0, "none": None,
           "per_seed": [0.5, math.nan], "inner": {"cos": torch.tensor(float("nan"))}}
    text = jsonio.dumps(rec, reasons={"rho": "no shared token", "per_seed": "no node (seed 1)"})
    assert "NaN" not in text and "Infinity" not in text
    doc = strict_load(text)
    assert doc["rho"] is None and doc["share"] is None and doc["n"] == 0.0
    assert doc["undefined"] == {"rho": "no shared token", "share": jsonio.INFINITE,
                                "per_seed": "no node (seed 1)"}
    assert doc["inner"] == {"cos": None, "undefined": {"cos": jsonio.NOT_A_NUMBER}}
    back = jsonio.loads(text)
    assert math.isnan(back["rho"]) and math.isnan(back["share"]) and back["none"] is None
    assert back["per_seed"][0] == 0.5 and math.isnan(back["per_seed"][1])
    assert jsonio.undefined_reasons(back) == doc["undefined"]
    with pytest.raises(ValueError, match="bare NaN token"):
        jsonio.loads('{"rho": NaN}')


# --- a real run where every ratio is undefined (every group tied) ----------------------------
def _never_task(path: Path) -> str:
    """A JSONL task whose answer no response gives: every reward 0, every group tied."""
    path.write_text("".join(json.dumps({"prompt": p, "answer": "never"}) + "\n"
                            for p in ("3+4=?", "10+25=?", "12+5=?")))
    return str(path)


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory) -> RunConfig:
    tmp = tmp_path_factory.mktemp("tied")
    cfg = RunConfig(out=str(tmp / "tied"), objectives=["grpo"], steps=2, prompts=2, G=4,
                    minibatches=1, tax_every=1, progress=False, probe_contexts=2,
                    task=_never_task(tmp / "never.jsonl"))
    train(cfg)
    return cfg


def test_every_file_of_a_tied_run_is_strict_json_with_reasons(tied_run):
    run = Path(tied_run.out)
    from gradlab.viz.html import view

    view(run)
    files = {p.relative_to(run).as_posix() for p in strict_files(run)}
    assert {"config.json", "metrics.jsonl", "samples.jsonl", "provenance.json",
            "instruments.json", "checkpoints/grpo/state.json"} <= files, files
    page = (run / "view.html").read_text()
    data = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    strict_load(data.group(1).replace("<\\/", "</"))
    recs = [strict_load(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        # every group tied (rewards all 0): W ≡ 0, so ρ and the tax share have no denominator
        assert r["zero_std_share"] == 1 and r["scale_prefix"] == 0 and r["total_norm"] == 0
        nulls = {k for k, v in r.items() if v is None}
        assert {"rho_prefix", "rho_trie", "tax_share", "attr_clip"} <= nulls
        assert set(r["undefined"]) == nulls  # every null has its reason, nothing else has one
        assert r["undefined"]["rho_prefix"] == r["undefined"]["tax_share"] == TIED
        assert r["undefined"]["attr_clip"].startswith("the residual Σ|d| is 0")
        assert r["residual_prefix"] == 0  # a measured 0 stays a number


def test_load_run_reads_null_as_nan_with_its_reason(tied_run):
    tidy = load_run(tied_run.out)
    assert list(tidy.columns) == ["run", "objective", "seed", "step", "tokens", "metric",
                                  "value", REASON]
    rho = tidy[tidy["metric"] == "rho_prefix"]
    assert len(rho) == 2 and rho["value"].isna().all() and (rho[REASON] == TIED).all()
    # beside a value there is no reason; every undefined value has one
    assert tidy.loc[tidy["value"].notna(), REASON].isna().all()
    recs = [json.loads(x) for x in (Path(tied_run.out) / "metrics.jsonl").read_text().splitlines()]
    stored = {(r["step"], k) for r in recs for k, v in r.items() if v is None}
    got = tidy[tidy[REASON].notna()]
    assert set(zip(got["step"], got["metric"])) == stored
    wide = load_run(tied_run.out, wide=True)  # the wide table: values only, as before
    assert REASON not in wide.columns and wide["rho_prefix"].isna().all()


def test_load_run_derives_reasons_for_a_run_written_without_them(tmp_path):
    """A metrics.jsonl of plain nulls (no "undefined" entries): the reasons come from the
    record's own sums: no node (n_shared = 0), every group tied (scale 0, zero_std_share 1)."""
    base = {"objective": "grpo", "seed": 0, "tokens": 8, "zero_std_share": 1.0,
            "n_shared_trie": 3.0, "scale_trie": 0.0, "rho_trie": None, "form0_share": None}
    lines = [{**base, "step": 0, "n_shared_prefix": 0.0, "scale_prefix": 0.0, "rho_prefix": None},
             {**base, "step": 1, "n_shared_prefix": 2.0, "scale_prefix": 1.0, "rho_prefix": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    tidy = load_run(tmp_path).set_index(["step", "metric"])
    assert tidy.loc[(0, "rho_prefix"), REASON] == "no full-group token"
    assert tidy.loc[(0, "rho_trie"), REASON] == tidy.loc[(1, "rho_trie"), REASON] == TIED
    assert tidy.loc[(0, "form0_share"), REASON] == "no row"  # the ratio rule's reason
    assert tidy.loc[(1, "rho_prefix"), "value"] == 0.25 and tidy.loc[(1, "rho_prefix"), REASON] is None


def test_rewrites_keep_strict_json_and_reasons(tied_run, tmp_path):
    """truncate_after and drop_keys_at (resume) rewrite metrics.jsonl: still strict, reasons kept."""
    run = tmp_path / "copy"
    shutil.copytree(tied_run.out, run)
    store = RunStore(run, resume=True)
    store.truncate_after(0)
    store.drop_keys_at(0, ("tax_share",))
    store.close()
    strict_files(run)
    (rec,) = [strict_load(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rec["rho_prefix"] is None and rec["undefined"]["rho_prefix"] == TIED
    assert "tax_share" not in rec and "tax_share" not in rec["undefined"]


def test_save_reference_of_an_undefined_run_is_strict_json(tied_run, tmp_path):
    """`gradlab reproduce --save-reference` on a run with undefined ratios writes null, no crash."""
    from dataclasses import replace

    from gradlab.loop.recipes.reproduce import save_reference

    cfg = replace(tied_run, out=str(tmp_path / "ref_run"))
    save_reference(cfg, set(), tmp_path / "ref.json", 1, False, say=lambda *_: None)
    text = (tmp_path / "ref.json").read_text()
    strict_load(text)
    assert "null" in text


def test_in_process_provenance_is_strict_json(tmp_path):
    provenance.write_in_process(tmp_path / "audit.json", "cmd", float("nan"))
    doc = strict_load((tmp_path / "audit.json").read_text())
    assert doc["seconds"] is None and doc["undefined"] == {"seconds": jsonio.NOT_A_NUMBER}


# --- attribution ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_attribution_is_nan_without_a_residual(name):
    obj = objectives.get(name)
    # every group tied (equal rewards): every advantage 0, W ≡ 0, no residual
    b = random_batch(n_groups=3, G=4, seed=0, rewards=torch.ones(12, dtype=torch.float64))
    res = gradlab.cancellation(obj.modulation(obj.prepare(b)), b).residual
    assert res == 0  # independent: W ≡ 0 at every node
    att = gradlab.attribution(obj, b)
    assert att["residual"] == 0
    assert all(math.isnan(att[m]) for m in ("coupling", "length", "clip")), att
    live = gradlab.attribution(objectives.get("gspo"), random_batch(n_groups=3, G=4, seed=0))
    assert live["residual"] > 0 and all(math.isfinite(live[m]) for m in ("coupling", "length",
                                                                        "clip"))


def test_shared_fraction_is_nan_without_a_response_token():
    b = random_batch(n_groups=2, G=2, seed=0)
    from dataclasses import replace

    empty = replace(b, mask=torch.zeros_like(b.mask))
    c = gradlab.cancellation(torch.zeros_like(b.logps), empty)
    assert math.isnan(c.shared_fraction) and math.isnan(c.ratio)


# --- gradlab check's baseline ----------------------------------------------------------------
def test_check_baseline_stores_undefined_rho_as_null_and_reports_a_flip(tmp_path, capsys):
    """DFPO Min-Replace off-policy: W ≡ 0 at every full-group token, so ρ prefix is undefined:
    null (with its reason) in the baseline, never 0; a ρ that turns from undefined to defined,
    or back, is a change."""
    p = tmp_path / "b.json"
    only = ["--only", "dfpo-min/near", "--no-model", "--baseline", str(p)]
    assert check.main(["--update", *only]) == 0
    entry = strict_load(p.read_text())["scenarios"]["synthetic/dfpo-min/near"]
    assert entry["rho_prefix"] == [None, None, None]
    assert entry["undefined"] == {"rho_prefix": f"{check.NO_GRADIENT} at seeds 0, 1, 2"}
    assert all(x is not None and x > 0 for x in entry["rho_trie"])  # defined: numbers
    assert check.main(only) == 0  # undefined on both sides: the same
    capsys.readouterr()
    base = json.loads(p.read_text())
    was = dict(base["scenarios"]["synthetic/dfpo-min/near"])
    base["scenarios"]["synthetic/dfpo-min/near"] = {**was, "rho_prefix": [0.0, None, None]}
    p.write_text(json.dumps(base))
    assert check.main(only) == 1  # a baseline 0 (cancelled) is not an undefined ρ
    out = capsys.readouterr().out
    assert "ρ undefined ↔ defined on 1 value(s)" in out and "ρ prefix [seed 0] 0 → undefined" in out
    trie = was["rho_trie"]
    base["scenarios"]["synthetic/dfpo-min/near"] = {**was, "rho_trie": [None, *trie[1:]]}
    p.write_text(json.dumps(base))
    assert check.main(only) == 1
    assert f"ρ trie [seed 0] undefined → {trie[0]:.6g}" in capsys.readouterr().out


def test_shipped_baseline_is_strict_json_with_null_for_undefined():
    base = strict_load(check.BASELINE.read_text())
    for key, v in base["scenarios"].items():
        for m in ("rho_prefix", "rho_trie"):
            has_null = any(x is None for x in v[m])
            assert has_null == (m in v.get("undefined", {})), (key, m)
    assert base["scenarios"]["synthetic/dfpo-min/near"]["rho_prefix"] == [None, None, None]
