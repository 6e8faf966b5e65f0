"""The loop end to end: every objective, JSONL task, determinism, resume, SIGKILL, CLI errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import gradlab
from gradlab import objectives
from gradlab.cli.main import main
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.train import train
from gradlab.loop.update.batches import minibatches

DATA = Path(__file__).parent / "data"
SMALL = dict(steps=2, prompts=4, G=4, minibatches=2, ckpt_every=1, tax_every=1, progress=False,
             probe_contexts=4)


def _metrics(path) -> pd.DataFrame:
    df = gradlab.load_run(path)
    return df[~df["metric"].str.startswith("time_")].reset_index(drop=True)


def test_every_objective_end_to_end(tmp_path):
    names = objectives.names()
    cfg = RunConfig(out=str(tmp_path / "all"), objectives=names, **SMALL)
    train(cfg)
    df = gradlab.load_run(tmp_path / "all")
    assert set(df["objective"]) == set(names)
    wide = gradlab.load_run(tmp_path / "all", wide=True)
    assert len(wide) == len(names) * SMALL["steps"]
    need = ["reward", "accuracy", "length", "entropy", "clip_frac", "grad_norm", "rho_prefix",
            "rho_trie", "shared_frac_prefix", "tokens", "time_step", "w_dev", "tax_share",
            "drift_node_kl_mean", "probe_kl", "logodds"]
    for m in need:
        assert m in wide.columns or m == "tokens", m
        if m == "rho_prefix":  # IBPO gives full-group tokens no credit: W ≡ 0 there, ρ undefined
            none = wide["scale_prefix"] == 0
            assert set(wide.loc[none, "objective"]) <= {"ibpo"}, m
            assert wide.loc[none, m].isna().all() and wide.loc[~none, m].notna().all(), m
            continue
        assert wide[m].notna().all(), m
    assert (wide["shared_frac_prefix"] > 0).all()  # the template prefix is shared
    assert (wide["w_dev"] < 1e-5).all()  # hook-measured W = closed form on every step
    by = wide.groupby("objective")["rho_prefix"].mean()
    assert by["dfpo-min"] < 1e-6 and by["dfpo-orth"] < 1e-6 and by["grpo-fix"] < 1e-6
    assert by["gspo"] > 1e-5  # off-policy minibatches: sequence coupling and clipping
    assert (tmp_path / "all" / "checkpoints" / "gspo" / "model.safetensors").exists()


def test_jsonl_task(tmp_path):
    cfg = RunConfig(out=str(tmp_path / "j"), objectives=["grpo"], task=str(DATA / "tiny_task.jsonl"),
                    **SMALL)
    train(cfg)
    assert set(gradlab.load_run(tmp_path / "j")["objective"]) == {"grpo"}


def test_same_seed_same_metrics_and_same_batch_mode(tmp_path):
    kw = dict(objectives=["gspo", "dfpo-min"], mode="same-batch", **SMALL)
    train(RunConfig(out=str(tmp_path / "a"), **kw))
    train(RunConfig(out=str(tmp_path / "b"), **kw))
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    pd.testing.assert_frame_equal(a.drop(columns="run"), b.drop(columns="run"))
    ms = set(a["metric"])
    assert "cf/dfpo-min/rho_prefix" in ms and set(a["objective"]) == {"gspo"}
    cf = a[a["metric"] == "cf/dfpo-min/rho_prefix"]["value"]
    assert (cf < 1e-6).all()


def test_groups_stay_whole_unless_split():
    group = torch.arange(6).repeat_interleave(4)[torch.randperm(24)]
    g = torch.Generator().manual_seed(0)
    parts = minibatches(group, 3, g, split=False)
    assert sorted(torch.cat(parts).tolist()) == list(range(24))
    for rows in parts:
        for lab in group[rows].unique():
            assert int((group[rows] == lab).sum()) == 4
    parts = minibatches(group, 4, g, split=True)
    assert any(int((group[r] == group[r][0]).sum()) < 4 for r in parts)


def _cli(tmp, *extra):
    return [sys.executable, "-m", "gradlab", "tandem", "--out", str(tmp), "--objectives",
            "grpo,gspo", "--prompts", "4", "--G", "4", "--minibatches", "2", "--ckpt-every", "2",
            "--tax-every", "2", "--probe-contexts", "4", "--eval-every", "2", "--eval-size", "16",
            "--no-progress", *extra]


def test_resume_equals_uninterrupted_and_sigkill_leaves_readable_store(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cli(full, "--steps", "6"), check=True, capture_output=True)
    proc = subprocess.Popen(_cli(killed, "--steps", "6"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:  # kill mid-run, after the step-2 checkpoint
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 7:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = gradlab.load_run(killed)  # every complete step loads
    assert 0 < partial["step"].max() < 5
    for line in metrics.read_text().splitlines()[:-1]:
        json.loads(line)
    subprocess.run(_cli(killed, "--steps", "6", "--resume"), check=True, capture_output=True)
    a, b = _metrics(full), _metrics(killed)
    pd.testing.assert_frame_equal(a.drop(columns="run"), b.drop(columns="run"))
    assert a[a["metric"] == "eval_accuracy"]["value"].notna().sum() == 2 * 3  # survives resume


@pytest.mark.parametrize("args,msg", [
    (["--objectives", "ppo"], "--objectives: unknown objective 'ppo'; valid: grpo"),
    (["--G", "1"], "--G: 1 is invalid; must be ≥ 2"),
    (["--max-new-tokens", "0"], "--max-new-tokens: 0 is invalid"),
    (["--model", "/nonexistent/model"], "--model: no Hugging Face model folder"),
    (["--mode", "mixed"], "--mode: unknown 'mixed'"),
    (["--minibatches", "9", "--prompts", "8"], "--minibatches: 9 > 8 prompts"),
])
def test_bad_config_one_line_error(args, msg, capsys):
    assert main(["tandem", "--out", "/tmp/x", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_config_error_is_value_error():
    with pytest.raises(ConfigError):
        RunConfig(G=1)


def test_reproduce_cli_writes_figures_and_summary(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["reproduce", "--out", str(out), "--steps", "2", "--prompts", "4", "--G", "4",
                 "--minibatches", "2", "--probe-contexts", "4", "--tax-every", "1",
                 "--no-progress"]) == 0
    assert (out / "figures" / "training_curves.png").stat().st_size > 10_000
    summary = (out / "summary.md").read_text()
    for name in ("grpo", "gspo", "dfpo-min", "dfpo-orth"):
        assert f"| {name} " in summary
    # one unit for accuracy everywhere it is printed (percent), the run-mean reward named as such
    assert "acc_last5 (%)" in summary and "reward (run mean)" in summary
    assert "| held-out accuracy (%) |" in capsys.readouterr().out  # the short table; summary.md has all
    # a second fresh run into the same folder is refused with a one-line error
    assert main(["reproduce", "--out", str(out), "--steps", "2", "--no-progress"]) == 2


def test_instruments_off_trains_with_plain_metrics_only(tmp_path):
    cfg = RunConfig(out=str(tmp_path / "np"), objectives=["gspo"], instruments="off", **SMALL)
    train(cfg)
    ms = set(gradlab.load_run(tmp_path / "np")["metric"])
    assert {"reward", "accuracy", "loss", "grad_norm", "entropy", "clip_frac"} <= ms
    assert not any(m.startswith(("rho", "tax", "drift", "probe")) for m in ms)


def _never_task(path: Path) -> str:
    """A JSONL task whose answer no response gives: every reward 0, every group tied."""
    path.write_text("".join(json.dumps({"prompt": p, "answer": "never"}) + "\n"
                            for p in ("3+4=?", "10+25=?", "12+5=?")))
    return str(path)


def test_every_group_tied_gives_undefined_not_zero(tmp_path):
    """W ≡ 0 (every group tied): ρ, the tax share and the other zero-denominator ratios are NaN
    in the store, never 0; the counts and sums stay numbers; the end-of-run table prints "—"
    with the reason."""
    from gradlab.viz.summary import run_table

    cfg = RunConfig(out=str(tmp_path / "tied"), objectives=["grpo"], steps=2, prompts=2, G=4,
                    minibatches=1, tax_every=1, progress=False, probe_contexts=2,
                    task=_never_task(tmp_path / "never.jsonl"))
    train(cfg)
    wide = gradlab.load_run(cfg.out, wide=True)
    assert (wide["zero_std_share"] == 1).all() and (wide["n_shared_prefix"] > 0).all()
    assert (wide["scale_prefix"] == 0).all() and (wide["total_norm"] == 0).all()
    for m in ("rho_prefix", "rho_trie", "tax_share", "tax_cos", "adv_branch_share"):
        assert wide[m].isna().all(), m  # undefined: NaN (null in metrics.jsonl), not 0
    for m in ("reward", "residual_prefix", "tax_norm", "adv_nonzero_frac"):
        assert (wide[m] == 0).all(), m  # measured zeros stay numbers
    assert (wide["n_tokens"] > 0).all()
    table = run_table(cfg.out)
    row = next(line for line in table.splitlines() if line.startswith("| grpo"))
    assert row == "| grpo | 0 | —¹ | —² | —² | —² |", row
    assert "—¹ not measured" in table and "—² undefined (no gradient: every group tied)" in table
    assert "| 0 |" not in row.replace("| grpo | 0 |", "")  # no 0 cell for an undefined ratio


def test_no_full_group_token_gives_undefined_rho(tmp_path):
    """At temperature 50 the two responses of each group differ from the first token: no
    node, so ρ is undefined there (NaN), and the table says "no full-group token"."""
    from gradlab.viz.summary import run_table

    cfg = RunConfig(out=str(tmp_path / "hot"), objectives=["grpo"], steps=2, prompts=2, G=2,
                    minibatches=1, tax_every=1, progress=False, probe_contexts=2,
                    temperature=50.0)
    train(cfg)
    wide = gradlab.load_run(cfg.out, wide=True)
    assert (wide["n_shared_prefix"] == 0).all() and (wide["n_shared_trie"] == 0).all()
    assert wide["rho_prefix"].isna().all() and wide["rho_trie"].isna().all()
    assert wide["entropy_shared"].isna().all() and (wide["shared_frac_prefix"] == 0).all()
    table = run_table(cfg.out)
    assert "undefined (no full-group token)" in table and "undefined (no shared token)" in table
