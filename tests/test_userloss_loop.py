"""A user's loss in the loop (`--objectives examples/my_losses.py:dr_grpo,grpo`): it trains beside
the built-ins with the same W measurement, its ρ and tax reach the end table and `gradlab view`,
resume is exact, and its faults are one line with the right exit code."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import run_tree
from tolerance import assert_close_f32

import gradlab
from gradlab import objectives
from gradlab.cli.main import main
from gradlab.core.variants import label, parse
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.train import train
from gradlab.testing import random_batch

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "my_losses.py")
TINY = ["--prompts", "2", "--G", "4", "--minibatches", "2", "--probe-contexts", "2",
        "--tax-every", "1", "--trace-every", "1", "--eval-every", "0", "--no-progress"]


# ----------------------------------------------------------------------------- no model


def test_spec_parses_and_labels():
    assert parse("examples/my_losses.py:dr_grpo") == ("examples/my_losses.py:dr_grpo", {})
    assert parse("a/b.py:f[name=mine]") == ("a/b.py:f", {"name": "mine"})
    assert label("a/b.py:f") == "f" and label("pkg.mod:f[name=x-1]") == "x-1"
    assert label("dfpo-orth[nodes=trie]") == "dfpo-orth[nodes=trie]"  # a built-in: the spec
    for bad, match in (("a.py:f[eps=1]", "takes only"), ("a.py:f[name=a/b]", "'/' is not allowed"),
                       ("a.py:1f", "path/file.py:function")):
        with pytest.raises(ValueError, match=match):
            label(bad)


@pytest.mark.parametrize("spec,builtin", [
    (f"{EXAMPLE}:dr_grpo", ("grpo", {"norm": "const"})),  # Dr. GRPO is GRPO with 1/(B T_max)
    (f"{EXAMPLE}:seq_clip", ("gspo", {})),  # the sequence-level clip is GSPO's
])
@pytest.mark.parametrize("off_policy", [0.0, 1.0])  # 1.0: clips fire
def test_example_losses_match_the_builtin_closed_forms(spec, builtin, off_policy):
    """Value and W (closed form where given, else autograd on the batch) against the built-in
    objective's own formula: an independent computation, float64."""
    b = random_batch(off_policy=off_policy, seed=3)
    b = b.replace(n_seqs=2 * b.B, n_tokens=3 * int(b.mask.sum()), width=b.T + 5)  # a micro-batch's
    user, ref = objectives.get(spec), objectives.get(builtin[0], **builtin[1])
    assert abs(float(user.loss(b)) - float(ref.loss(b))) <= 1e-12 * max(1.0, abs(float(ref.loss(b))))
    W_ref = ref.modulation(b)
    assert W_ref.abs().max() > 0
    torch.testing.assert_close(user.modulation(b), W_ref, rtol=0, atol=1e-12 * float(W_ref.abs().max()))
    torch.testing.assert_close(user.autograd_modulation(b), W_ref, rtol=0,
                               atol=1e-12 * float(W_ref.abs().max()))


def test_attribution_is_undefined_and_labels_must_differ():
    user = objectives.get(f"{EXAMPLE}:seq_clip[name=mine]")
    assert user.name == "mine" and user.mechanisms == ()
    with pytest.raises(ValueError, match="no mechanisms to switch off"):
        user.modulation(random_batch(), off=("clip",))
    with pytest.raises(ConfigError, match=r"duplicate names \['dr_grpo'\]"):
        RunConfig(objectives=[f"{EXAMPLE}:dr_grpo", f"{EXAMPLE}:dr_grpo[name=dr_grpo]"])
    two = RunConfig(objectives=[f"{EXAMPLE}:dr_grpo", f"{EXAMPLE}:dr_grpo[name=two]"])
    assert len(two.objectives) == 2  # other labels: accepted


def test_missing_file_or_function_is_exit_2_before_any_work(tmp_path, capsys):
    for spec, what in ((str(tmp_path / "nope.py") + ":f", "no file"),
                       (f"{EXAMPLE}:nosuch", "has no callable 'nosuch'"),
                       ("no_such_module_xyz:f", "no module 'no_such_module_xyz'")):
        assert main(["tandem", "--objectives", f"{spec},grpo", "--out", str(tmp_path / "o"),
                     "--steps", "1", *TINY]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and what in err[0] and err[0].startswith("gradlab tandem: error: ")
        assert not (tmp_path / "o").exists()


def test_a_module_that_raises_on_import_is_exit_3_before_any_work(tmp_path, monkeypatch, capsys):
    (tmp_path / "imp.py").write_text("x = undefined_thing\ndef f(batch):\n    return batch.logps.sum()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["tandem", "--objectives", "imp.py:f,grpo", "--out", "o", "--steps", "1"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gradlab tandem: error: objective imp.py:f: importing imp.py raised NameError("
                   "\"name 'undefined_thing' is not defined\") (exit code 3: a fault in the loss)"]
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- in the loop


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`gradlab tandem --objectives examples/my_losses.py:dr_grpo,grpo[norm=const] --steps 2`:
    the user's Dr. GRPO beside the built-in one, from one start."""
    out = tmp_path_factory.mktemp("own") / "run"
    args = ["tandem", "--objectives", f"{EXAMPLE}:dr_grpo,grpo[norm=const]", "--out", str(out),
            "--steps", "2", "--ckpt-every", "1", *TINY]
    return out, args


def test_tandem_trains_the_user_loss_with_rho_and_tax_in_the_table(run, capsys):
    out, args = run
    assert main(args) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| dr_grpo |"))
    cells = [c.strip() for c in row.strip("|").split("|")]  # objective, reward, held-out, ρ ×2, tax
    m = gradlab.load_run(out)
    d = m[m["objective"] == "dr_grpo"].set_index(["step", "metric"])["value"]
    assert sorted(set(m["objective"])) == ["dr_grpo", "grpo[norm=const]"]
    for cell in cells[3:6]:
        assert re.fullmatch(r"[0-9.e+-]+", cell), row  # measured, not "—"
    # step 0 is the same sample for both learners: the same W up to round-off (the traces)
    tr = gradlab.load_traces(out, step=0)
    a = tr[(tr["objective"] == "dr_grpo") & (tr["opt_step"] == 0)].sort_values(["group", "row", "position"])
    b = tr[(tr["objective"] == "grpo[norm=const]") & (tr["opt_step"] == 0)].sort_values(
        ["group", "row", "position"])
    assert len(a) == len(b) > 0 and (a["W"].abs() > 0).any()
    assert_close_f32(a["W"].to_numpy(copy=True), b["W"].to_numpy(copy=True))
    assert_close_f32(a["W"].to_numpy(copy=True), a["W_closed"].to_numpy(copy=True))  # dr_grpo.modulation
    assert not a["clip"].any()  # a user loss has no clip flag
    for k in ("rho_prefix", "rho_trie", "tax_share", "ratio_mean"):
        assert_close_f32(torch.tensor(d[0, k]), torch.tensor(
            m[(m["objective"] == "grpo[norm=const]") & (m["step"] == 0) & (m["metric"] == k)]
            ["value"].iloc[0]), ulps=2048, scale=1.0 if k.startswith("rho") else None)
    assert d[0, "w_dev"] < 1e-4 * d[0, "w_max"]
    rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    user0 = next(r for r in rec if r["objective"] == "dr_grpo" and r["step"] == 0)
    ref0 = next(r for r in rec if r["objective"] == "grpo[norm=const]" and r["step"] == 0)
    assert user0["attr_coupling"] is None and ref0["attr_coupling"] is not None  # NaN: undefined
    assert "clip_frac" not in user0 and "clip_frac" in ref0  # which tokens it clips: unknown
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["objectives"][0] == f"{EXAMPLE}:dr_grpo" and cfg["threads"] == 1


def test_view_has_the_user_loss_strips(run, tmp_path):
    out, _ = run
    page = tmp_path / "page.html"
    assert main(["view", str(out), "--out", str(page)]) == 0
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>',
                                page.read_text(), re.S).group(1).replace("<\\/", "</"))
    tr = gradlab.load_traces(out, objective="dr_grpo")
    assert sorted(data["dr_grpo"]) == ["0", "1"]
    g = data["dr_grpo"]["1"]
    n = sum(len(v["W"]) for v in g.values())
    assert n == int((tr["step"] == 1).sum()) > 0  # every traced token of step 1 has a strip cell


def test_resume_continues_the_user_loss_exactly(run, tmp_path):
    """2 steps + --resume to 3 equals 3 steps straight (from Python: one thread by default)."""
    out, args = run
    assert main(["tandem", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 0
    torch.set_num_threads(2)  # a Python caller's count: the run sets its own (1)
    try:
        straight = train(RunConfig(out=str(tmp_path / "s"), objectives=[
            f"{EXAMPLE}:dr_grpo", "grpo[norm=const]"], steps=3, prompts=2, G=4, minibatches=2,
            probe_contexts=2, tax_every=1, trace_every=1, eval_every=0, progress=False))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)
    assert json.loads((straight.path / "config.json").read_text())["threads"] == 1
    a, b = gradlab.load_run(out), gradlab.load_run(straight.path)
    keep = ~a["metric"].str.startswith("time_")
    a, b = a[keep], b[~b["metric"].str.startswith("time_")]
    cols = ["objective", "step", "metric"]
    a, b = a.sort_values(cols).reset_index(drop=True), b.sort_values(cols).reset_index(drop=True)
    assert (a[a["step"] == 2]["objective"] == "dr_grpo").any()
    assert a[cols].equals(b[cols]) and a["value"].equals(b["value"])


def test_two_torchrun_ranks_train_the_user_loss_as_one_process(tmp_path):
    """torchrun (gloo, 2 CPU ranks): every metric of the user loss as one process computes it
    on the same global batch (rtol 1e-4, as tests/test_ddp.py holds the built-ins)."""
    args = ["tandem", "--objectives", f"{EXAMPLE}:dr_grpo,gspo", "--prompts", "4", "--G", "4",
            "--minibatches", "2", "--probe-contexts", "2", "--tax-every", "1", "--eval-every",
            "0", "--no-progress", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "gradlab", *args, "--out", str(tmp_path / "one")],
                   env=env, check=True, capture_output=True, timeout=600)
    r = run_tree([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node=2", "-m", "gradlab", *args, "--out", str(tmp_path / "two")],
                 timeout=600, together=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    wa, wb = (gradlab.load_run(tmp_path / k, wide=True) for k in ("one", "two"))
    wa, wb = (w[w["objective"] == "dr_grpo"].reset_index(drop=True) for w in (wa, wb))
    cols = [c for c in wa.columns if wa[c].dtype.kind == "f" and not c.startswith("time_")
            and c not in ("tax_cos", "attr_length")]
    assert {"rho_prefix", "tax_share", "ratio_mean", "w_dev", "loss"} <= set(cols) and len(wa) == 2
    for c in cols:
        np.testing.assert_allclose(wb[c], wa[c], rtol=1e-4, atol=1e-6, err_msg=c)


# ----------------------------------------------------------------------------- faults


BAD = '''import torch
CALLS = [0]

def boom(batch):
    CALLS[0] += 1
    if CALLS[0] > 1:  # --instruments off, --minibatches 1: one call per rollout step
        return {}["x"]
    return -(batch.logps * batch.mask).sum()

def vec(batch):
    return -(batch.logps * batch.mask).sum(-1)

def nan(batch):
    return (batch.logps * batch.mask).sum() * float("nan")

def detached(batch):
    return (batch.logps.detach() * batch.mask).sum()

def wrong(batch):
    return -(batch.advantages.unsqueeze(-1) * batch.logps * batch.mask).sum() / batch.norm_tokens()

wrong.modulation = lambda b: 2 * b.advantages.unsqueeze(-1) * b.mask / b.norm_tokens()
'''
ONE = ["--prompts", "2", "--G", "4", "--minibatches", "1", "--probe-contexts", "2",
       "--eval-every", "0", "--no-progress", "--steps", "2"]


@pytest.mark.parametrize("fn,instruments,says", [
    ("boom", "off", r"bad\.py:boom: boom raised KeyError: 'x' \(bad\.py line 7\) at step 1"),
    ("vec", "default", r"vec returned a tensor of shape \(8,\) .* at step 0"),
    ("nan", "default", r"nan returned nan from finite log-probs at step 0"),
    ("detached", "default", r"detached returned a value that does not depend on batch\.logps"),
])
def test_a_faulty_loss_is_exit_3_with_one_line(tmp_path, monkeypatch, capsys, fn, instruments,
                                              says):
    (tmp_path / "bad.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    assert main(["tandem", "--objectives", f"bad.py:{fn},grpo", "--out", "o", "--instruments",
                 instruments, *ONE]) == 3
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("gradlab tandem: error: bad.py:") and \
        re.search(says, err[0]) and err[0].endswith("(exit code 3: a fault in the loss)"), err


def test_a_wrong_closed_form_is_named_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    assert main(["tandem", "--objectives", "bad.py:wrong,grpo", "--out", "o", *ONE]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if "disagrees" in x]
    m = gradlab.load_run("o")
    w_dev = m[(m["objective"] == "wrong") & (m["step"] == 0) & (m["metric"] == "w_dev")]["value"]
    assert len(err) == 1 and "bad.py:wrong: wrong.modulation disagrees" in err[0]
    assert f"max |gap| {float(w_dev.iloc[0]):.3g}" in err[0]  # the first step's gap, measured
    assert float(w_dev.iloc[0]) > 0.5 * float(
        m[(m["objective"] == "wrong") & (m["step"] == 0) & (m["metric"] == "w_max")]["value"].iloc[0])
