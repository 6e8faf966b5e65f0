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
from gradlab.cli import main
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.train import train
from gradlab.loop.update.step import minibatches

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
    assert "| held-out accuracy |" in capsys.readouterr().out  # the short table; summary.md has all
    # a second fresh run into the same folder is refused with a one-line error
    assert main(["reproduce", "--out", str(out), "--steps", "2", "--no-progress"]) == 2


def test_no_probes_trains_with_plain_metrics_only(tmp_path):
    cfg = RunConfig(out=str(tmp_path / "np"), objectives=["gspo"], probes=False, **SMALL)
    train(cfg)
    ms = set(gradlab.load_run(tmp_path / "np")["metric"])
    assert {"reward", "accuracy", "loss", "grad_norm", "entropy", "clip_frac"} <= ms
    assert not any(m.startswith(("rho", "tax", "drift", "probe")) for m in ms)
