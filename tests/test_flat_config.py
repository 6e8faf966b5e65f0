"""A config.json written by gradlab 0.1 chose what a step measures with flat flags (`probes`,
`drift`, `flips`, with `tax_every`) and no `instruments`. Such a file loads to the instrument
spec that measures the same, resumes, and a saved reference made with it is checked at it.

tests/data/config_0.1_no_probes.json and config_0.1_flips.json are the config.json files of
`gradlab run grpo --steps 2 --prompts 2 --G 2 --minibatches 1 --ckpt-every 1 --eval-every 0
--no-progress` with `--no-probes`, and with `--flips --tax-every 1`, as 0.1 wrote them."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from gradlab.cli.main import main
from gradlab.core import objectives
from gradlab.loop.config import RunConfig, current_form, flat_instruments
from gradlab.loop.recipes.reference import load_reference
from gradlab.loop.recipes.reproduce import check_config
from gradlab.loop.train import train
from gradlab.loop.update.view import loop_instruments

DATA = Path(__file__).parent / "data"
FLAT = {"no_probes": "off", "flips": "full"}


def _measured_by_flags(probes: bool, drift: bool, flips: bool, k: int,
                       same_batch: bool) -> list[tuple[str, int]]:
    """(instrument, every) of what 0.1's flags measured: with probes, W's deviation and ρ every
    step (the other objectives' ρ too in same-batch mode), attribution and the tax every k
    steps; with probes and drift, drift every step and at divergent tokens every k steps; with
    flips, the ledger every k steps."""
    out = [("modulation", 1), ("residual", 1)] if probes else []
    out += [("same_batch", 1)] if probes and same_batch else []
    out += [("attribution", k), ("tax", k)] if probes else []
    out += [("drift", 1), ("drift_divergent", k)] if probes and drift else []
    out += [("flips", k)] if flips else []
    return out


@pytest.mark.parametrize("probes,drift,flips,k,same_batch", [
    c for c in itertools.product((True, False), (True, False), (True, False), (0, 1, 3),
                                 (False, True))
    if not (c[2] and c[3] == 0) and not (c[4] and not c[0])])  # both refused by 0.1
def test_flat_flags_measure_what_their_spec_measures(probes, drift, flips, k, same_batch):
    data = {"probes": probes, "drift": drift, "flips": flips, "tax_every": k, "instruments": "",
            "objectives": ["grpo", "gspo"], "mode": "same-batch" if same_batch else "tandem"}
    cfg = RunConfig(**current_form(data))
    others = [("gspo", objectives.get("gspo"))] if same_batch else []
    got = [(i.name, i.schedule.every) for i in loop_instruments(cfg, others)]
    want = _measured_by_flags(probes, drift, flips, k, same_batch)
    assert sorted(got) == sorted(want)  # same_batch: the loop appends it to any spec
    if not same_batch:
        assert got == want
    assert cfg.instruments == flat_instruments(probes, drift, flips, k)


@pytest.mark.parametrize("name", sorted(FLAT))
def test_a_flat_config_json_loads_to_its_spec(name):
    path = DATA / f"config_0.1_{name}.json"
    assert {"probes", "drift", "flips"} <= json.loads(path.read_text()).keys()
    cfg = RunConfig.from_json(path)
    assert cfg.instruments == FLAT[name]
    assert not {"probes", "drift", "flips"} & cfg.to_json().keys()


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


@pytest.mark.parametrize("name", sorted(FLAT))
def test_a_flat_run_resumes_to_the_metrics_of_an_unbroken_run(name, tmp_path):
    """A one-step run whose config.json is the 0.1 file resumes (`--resume`, the options from
    the file) to the metrics, bitwise, of a two-step run of the mapped spec."""
    flat = json.loads((DATA / f"config_0.1_{name}.json").read_text())
    cfg = replace(RunConfig.from_json(DATA / f"config_0.1_{name}.json"), steps=2)
    train(replace(cfg, out=str(tmp_path / "unbroken")))
    old = tmp_path / "old"
    train(replace(cfg, out=str(old), steps=1))
    (old / "config.json").write_text(json.dumps({**flat, "out": str(old), "steps": 1}))
    assert main(["run", "grpo", "--out", str(old), "--resume", "--steps", "2"]) == 0
    assert _rows(old) == _rows(tmp_path / "unbroken") and len(_rows(old)) == 2
    stored = json.loads((old / "config.json").read_text())
    assert stored["instruments"] == FLAT[name] and "probes" not in stored


def test_a_flat_saved_reference_is_checked_at_its_spec(tmp_path):
    """A 0.1 reference saved with --no-probes typed: checked with instruments off, typed."""
    flat = json.loads((DATA / "config_0.1_no_probes.json").read_text())
    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"gradlab_reference": 2, "config": flat, "typed": ["probes"],
                                "seeds": [0, 1], "runs": [], "numbers": {}}))
    ref = load_reference(path)
    assert ref["typed"] == ["instruments"] and ref["config"]["instruments"] == "off"
    cfg, changed = check_config(RunConfig(), set(), ref)
    assert cfg.instruments == "off" and not any("instruments" in c for c in changed)


def test_same_runs_compares_a_flat_config_as_its_spec(tmp_path):
    """analyses/tools/same_runs.py: a 0.1 run and its retraining by the current code hold the
    same options (the flags as their spec); another spec is a difference."""
    from analyses.tools.same_runs import compare

    flat = json.loads((DATA / "config_0.1_no_probes.json").read_text())
    for name, data in (("old", flat), ("new", RunConfig.from_json(DATA / "config_0.1_no_probes.json")
                                       .to_json()), ("other", {**flat, "probes": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(data))
        (tmp_path / name / "metrics.jsonl").write_text("")
    assert not [d for d in compare(tmp_path / "old", tmp_path / "new")[1] if "config" in d]
    assert [d for d in compare(tmp_path / "old", tmp_path / "other")[1]
            if "instruments 'off' vs 'default'" in d]
