"""Token traces: written by the loop, read by gradlab.load_traces, checked against independent
computations (autograd W, ratios from log-probs, the logged sample texts), crash-safe on resume."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from tolerance import assert_close_f32

import gradlab
from gradlab import objectives
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.runs.traces import COLUMNS, token_rows
from gradlab.loop.train import train
from gradlab.testing import measure_modulation, random_batch

TINY = dict(prompts=2, G=4, minibatches=2, probe_contexts=2, tax_every=0, progress=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A default-settings run (trace_every, trace_groups at their defaults), 2 objectives."""
    out = tmp_path_factory.mktemp("tr") / "run"
    train(RunConfig(out=str(out), objectives=["grpo", "gspo"], steps=2, **TINY))
    return out


def test_default_run_holds_traces(run):
    df = gradlab.load_traces(run)
    assert list(df.columns) == ["run", *COLUMNS]
    cfg = RunConfig()
    assert set(df["step"]) == {0}  # step 0 is traced; default every = cfg.trace_every > 1
    assert cfg.trace_every > 1 and df["group"].nunique() == cfg.trace_groups == 2
    assert set(df["objective"]) == {"grpo", "gspo"}
    assert df["mask"].all() and (df.groupby(["objective", "group"])["row"].nunique() == 4).all()
    # the hook-measured W is the objective's gradient: equal to the closed form
    assert_close_f32(df["W"].to_numpy(), df["W_closed"].to_numpy(), msg="hook vs closed-form W")
    # first optimizer step of step 0 is on-policy: every ratio is 1 (to float round-off of the
    # sampler's and the trainer's forward), the later one is not
    first = df[df["opt_step"] == 0]
    assert np.allclose(first["r"], 1, atol=1e-5) and np.allclose(first["s"], 1, atol=1e-5)
    assert (df[df["opt_step"] == 1]["r"] - 1).abs().max() > 1e-4
    one = gradlab.load_traces(run, objective="gspo", step=0)
    assert set(one["objective"]) == {"gspo"} and len(one) == (df["objective"] == "gspo").sum()
    with pytest.raises(FileNotFoundError, match="step=5"):
        gradlab.load_traces(run, step=5)


def test_trace_tokens_are_the_logged_responses(run):
    """Group 0's responses in samples.jsonl, re-assembled from the traced token texts."""
    df = gradlab.load_traces(run, objective="grpo", step=0)
    rec = next(json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()
               if json.loads(x)["objective"] == "grpo" and json.loads(x)["step"] == 0)
    g0 = df[df["group"] == df["group"].min()]
    texts = [("".join(d.sort_values("position")["text"])).removesuffix("EOS")
             for _, d in g0.groupby("row")]
    assert texts == rec["responses"]
    # full-group node ids only where the trie node spans the whole group
    full = g0[g0["prefix_node"] >= 0]
    assert (full["trie_size"] == 4).all() and (g0[g0["trie_node"] < 0]["trie_size"] == 0).all()


def test_grpo_traces_cancel_at_full_group_nodes(run):
    df = gradlab.load_traces(run, objective="grpo", step=0)
    nodes = df[df["prefix_node"] >= 0].groupby(["opt_step", "prefix_node"])["W"]
    assert nodes.sum().abs().max() <= 1e-6 * nodes.apply(lambda w: w.abs().sum()).max()


def test_token_rows_against_autograd_and_log_probs():
    b = random_batch(n_groups=2, G=4, T=8, seed=3, off_policy=0.5)
    obj = objectives.get("grpo", eps=0.05)  # tight clip: some tokens clipped
    W = measure_modulation(obj.loss, b)
    cols = pd.DataFrame(token_rows(b, W, objective=obj))
    m = b.mask
    d = (b.logps - b.old_logps) * m
    assert np.allclose(cols["r"], torch.exp(d)[m].numpy())
    s = torch.exp(d.sum(-1) / m.sum(-1)).unsqueeze(-1).expand_as(d)
    assert np.allclose(cols["s"], s[m].numpy())
    assert np.allclose(cols["W"], W[m].float().numpy())
    assert_close_f32(cols["W_closed"].to_numpy(), cols["W"].to_numpy(), msg="closed-form vs hook W")
    ratio = torch.exp(b.logps - b.old_logps)
    A = b.advantages.unsqueeze(-1)
    clipped = (((A > 0) & (ratio > 1.05)) | ((A < 0) & (ratio < 0.95)))[m]
    assert cols["clip"].any() and (cols["clip"].to_numpy() == clipped.numpy()).all()
    assert (cols.loc[cols["clip"], "W"] == 0).all()


def test_resume_drops_traces_after_checkpoint_and_matches_uninterrupted(tmp_path):
    kw = dict(objectives=["grpo"], trace_every=1, **TINY)
    train(RunConfig(out=str(tmp_path / "full"), steps=3, **kw))
    part = tmp_path / "part"
    train(RunConfig(out=str(part), steps=2, ckpt_every=1, **kw))
    junk = part / "traces" / "grpo"
    for s in (2, 7):  # as if written after the checkpoint, before a crash
        (junk / f"step00000{s}.parquet").write_bytes((junk / "step000000.parquet").read_bytes())
    (junk / "step000009.parquet.tmp").write_bytes(b"torn")
    train(RunConfig(out=str(part), steps=3, ckpt_every=1, **kw), resume=True)
    a, b = (gradlab.load_traces(p).drop(columns="run") for p in (tmp_path / "full", part))
    assert sorted(set(b["step"])) == [0, 1, 2]
    pd.testing.assert_frame_equal(a, b)


def test_trace_options_are_checked():
    with pytest.raises(ConfigError, match="--trace-every"):
        RunConfig(trace_every=-1)
    with pytest.raises(ConfigError, match="--log"):
        RunConfig(log="wandb")
