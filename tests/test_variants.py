"""Objective variants `name[key=value, ...]`: parsing, building, errors, and one tandem of them."""

import json

import pytest
import torch

from gradlab import objectives
from gradlab.cli.main import main
from gradlab.core.variants import parse, split_top
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.testing import random_batch


def test_parse_reads_literals_and_bare_words():
    assert parse("gspo") == ("gspo", {})
    assert parse(" dfpo-orth[nodes=trie] ") == ("dfpo-orth", {"nodes": "trie"})
    assert parse("gspo[eps=1e9]") == ("gspo", {"eps": 1e9})
    name, p = parse("dfpo[transform='orth', eps=(0.1, 0.2), stop_grad=False, factor=0.25]")
    assert name == "dfpo"
    assert p == {"transform": "orth", "eps": (0.1, 0.2), "stop_grad": False, "factor": 0.25}
    assert type(p["eps"]) is tuple and type(p["stop_grad"]) is bool


def test_split_top_keeps_bracketed_commas():
    text = "gspo, dfpo-min,dfpo-orth[nodes=trie, eps=(0.1,0.2)],gspo[eps=1e9],"
    assert split_top(text) == ["gspo", "dfpo-min", "dfpo-orth[nodes=trie, eps=(0.1,0.2)]",
                               "gspo[eps=1e9]"]
    for bad in ("gspo[eps=1", "gspo]", "dfpo[transform='orth]"):
        with pytest.raises(ValueError, match="unbalanced"):
            split_top(bad)


@pytest.mark.parametrize("spec,match", [
    ("gspo[eps]", "is not key=value"),
    ("gspo[eps=1, eps=2]", "'eps' given twice"),
    ("gspo[eps=__import__('os')]", "not a literal"),  # literal_eval: never evaluated
    ("gspo[eps=1+", "expected name"),
    ("gspo[eps='a/b']", "'/' is not allowed"),
])
def test_malformed_specs_are_one_line_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse(spec)


def test_unknown_key_names_it_and_the_valid_keys():
    with pytest.raises(ValueError, match=r"'gspo\[foo=1\]': unknown parameter\(s\) \['foo'\]; "
                                         r"valid: \['eps', 'beta'\]"):
        objectives.get("gspo[foo=1]")
    with pytest.raises(ValueError, match=r"unknown objective 'ppo\[eps=1\]'; valid: grpo"):
        objectives.get("ppo[eps=1]")
    with pytest.raises(ValueError, match=r"\['eps'\] given in brackets and as keywords"):
        objectives.get("gspo[eps=0.1]", eps=0.2)
    with pytest.raises(ConfigError, match=r"--objectives: .*unknown parameter\(s\) \['nodez'\]"):
        RunConfig(objectives=["dfpo-orth[nodez=trie]"])


@pytest.mark.parametrize("spec,name,params", [
    ("dfpo-orth[nodes=trie]", "dfpo-orth", {"nodes": "trie"}),
    ("gspo[eps=0.05]", "gspo", {"eps": (0.05, 0.05)}),
    ("dfpo[transform=min, scope=all, eps=(0.1, 0.2)]", "dfpo",
     {"transform": "min", "scope": "all", "eps": (0.1, 0.2)}),
    ("grpo[norm=seq]", "grpo", {"norm": "seq"}),
])
def test_variant_is_the_objective_built_with_its_params(spec, name, params):
    b = random_batch(n_groups=3, G=4, T=10, seed=3, off_policy=0.4)
    W_spec = objectives.get(spec).modulation(b)
    W_kw = objectives.get(name, **params).modulation(b)
    assert torch.equal(W_spec, W_kw)
    assert not torch.equal(W_spec, objectives.get(name).modulation(b))  # the params matter


def test_variants_in_one_tandem_from_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    specs = "gspo,dfpo-orth[nodes=trie],gspo[eps=1e9]"
    rc = main(["tandem", "--objectives", specs, "--steps", "1", "--prompts", "2", "--G", "4",
               "--minibatches", "2", "--probe-contexts", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    labels = ["gspo", "dfpo-orth[nodes=trie]", "gspo[eps=1e9]"]
    assert json.loads((out / "config.json").read_text())["objectives"] == labels
    logged = {json.loads(line)["objective"] for line in (out / "metrics.jsonl").open()}
    assert logged == set(labels)
    assert {p.name for p in (out / "checkpoints").iterdir()} == set(labels)
    rc = main(["tandem", "--objectives", "gspo,gspo[bogus=1]", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "unknown parameter(s) ['bogus']; valid: ['eps', 'beta']" in capsys.readouterr().err
