"""The fault suite: every fault a user can cause gets its documented outcome — a
one-line error with the right exit code, or a defined result — and no data is lost."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import gradlab
from gradlab import objectives
from gradlab.cli.main import main
from gradlab.core.cancellation import cancellation
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.runs.store import CorruptFileError
from gradlab.loop.setup.policy import load_policy, save_policy
from gradlab.loop.train import train
from gradlab.loop.update.metrics import StepMetrics, finalize
from gradlab.testing import measure_modulation, random_batch

DATA = Path(__file__).parent / "data"
FAST = ["--steps", "2", "--prompts", "4", "--G", "4", "--minibatches", "2", "--ckpt-every", "1",
        "--probe-contexts", "4", "--tax-every", "1", "--no-progress"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def nan_policy(tmp_path_factory) -> Path:
    """The shipped tiny policy with one weight matrix set to NaN (a diverged checkpoint)."""
    model, tok = load_policy()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.fill_(float("nan"))
    return save_policy(model, tok, tmp_path_factory.mktemp("nanpolicy") / "p")


# ----------------------------------------------------------------------------- 1. non-finite


def test_nan_policy_stops_with_exit_3_naming_step_and_objective(tmp_path, nan_policy, capsys):
    out = tmp_path / "r"
    rc = main(["tandem", "--out", str(out), "--model", str(nan_policy), "--objectives", "gspo", *FAST])
    assert rc == 3
    err = _one_line(capsys)
    assert "step 0, objective gspo: non-finite loss" in err
    assert not (out / "checkpoints").exists()  # nothing of the bad step was written
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_huge_lr_stops_with_exit_3_and_writes_nothing_of_the_bad_step(tmp_path, capsys):
    """--lr 1e30: the first update leaves huge weights, the second minibatch's gradient is
    non-finite: exit 3 naming step 0 and the objective; no checkpoint, no metrics row."""
    out = tmp_path / "r"
    rc = main(["tandem", "--out", str(out), "--objectives", "grpo", *FAST, "--lr", "1e30"])
    assert rc == 3
    assert "step 0, objective grpo: non-finite gradient" in _one_line(capsys)
    assert not (out / "checkpoints").exists()
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


@pytest.mark.parametrize("how", ["nan-policy", "lr-inf"])
def test_skip_drops_every_bad_update_and_counts_it(tmp_path, nan_policy, how, capsys):
    """NaN weights (bad loss and gradient) or --lr inf (the update itself makes the weights
    non-finite: parameters and optimizer state are put back): every optimizer step is skipped,
    counted, and the checkpoint holds exactly the initial weights."""
    out = tmp_path / "r"
    extra = ["--model", str(nan_policy)] if how == "nan-policy" else ["--lr", "inf"]
    assert main(["tandem", "--out", str(out), "--objectives", "grpo", *FAST, *extra,
                 "--on-nonfinite", "skip"]) == 0
    wide = gradlab.load_run(out, wide=True)
    assert (wide["nonfinite_steps"] == 2).all()  # both optimizer steps of each rollout step
    init, _ = load_policy(nan_policy if how == "nan-policy" else None)
    saved = load_file(out / "checkpoints" / "grpo" / "model.safetensors")
    for name, w in saved.items():
        torch.testing.assert_close(w, init.state_dict()[name], rtol=0, atol=0, equal_nan=True)


def test_skip_counts_zero_on_healthy_steps(tmp_path):
    out = tmp_path / "r"
    assert main(["tandem", "--out", str(out), "--objectives", "grpo", *FAST,
                 "--on-nonfinite", "skip"]) == 0
    assert (gradlab.load_run(out, wide=True)["nonfinite_steps"] == 0).all()


def test_a_metric_of_a_non_finite_w_is_nan_never_zero():
    nan = math.nan
    r = finalize({"residual_prefix": nan, "scale_prefix": nan, "n_tokens": 4.0,
                 "entropy_sum": nan, "drift_node_kl_sum": nan, "drift_node_count": 2.0})
    assert math.isnan(r["rho_prefix"]) and math.isnan(r["entropy"])
    assert math.isnan(r["drift_node_kl_mean"])
    # a zero denominator is undefined too (W ≡ 0 at the nodes): NaN, not a cancelled 0
    assert math.isnan(finalize({"residual_prefix": 0.0, "scale_prefix": 0.0})["rho_prefix"])
    acc = StepMetrics()
    acc.maxes["w_max"] += [torch.tensor(1.0), torch.tensor(nan)]
    assert math.isnan(acc.finish()["w_max"])
    from gradlab.probes.tax import _norms

    g = {"w": torch.tensor([nan, 1.0])}
    assert math.isnan(float(_norms(g, g, ["w"])["tax_share"]))
    assert math.isnan(float(_norms(g, g, ["w"])["tax_cos"]))


# ----------------------------------------------------------------------------- 4. masked inert



# every objective, and the variants whose code paths differ (normalisers, KL, no-stop-grad)
INERT_CASES = [(n, {}) for n in objectives.names()] + [
    ("grpo", {"norm": "seq"}), ("grpo", {"norm": "const"}), ("grpo", {"beta": 0.1}),
    ("gspo", {"beta": 0.1}), ("dfpo", {"stop_grad": False}), ("dfpo-min", {"nodes": "trie"}),
    ("dfpo-orth", {"scope": "all"}), ("dfpo", {"base": "grpo"}), ("dfpo-min", {"base": "gspo-token"}),
]
GARBAGE = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, 3.0])


def _report(obj, b):
    W = obj.modulation(b)
    loss, stats = obj(b)
    hook = measure_modulation(obj.loss, b)
    rep = cancellation(hook, b, "prefix")
    return W, loss.detach(), {k: v for k, v in stats.items()}, hook, (rep.ratio, rep.residual)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), values=st.lists(GARBAGE, min_size=3, max_size=3),
       off=st.sampled_from([0.0, 0.3, 1.0]))
@pytest.mark.parametrize("name,params", INERT_CASES, ids=lambda x: str(x))
def test_values_outside_the_mask_are_inert(name, params, seed, values, off):
    """NaN, ±inf or garbage in logps/old_logps/ref_logps at padded positions give bitwise the
    same W (closed form and hook), loss, stats and cancellation report as zeros there."""
    obj = objectives.get(name, **params)
    b = random_batch(n_groups=3, G=4, T=10, seed=seed, off_policy=off)
    pad = ~b.mask
    assert bool(pad.any())
    zero = b.replace(logps=b.logps.masked_fill(pad, 0.0), old_logps=b.old_logps.masked_fill(pad, 0.0),
                     ref_logps=(b.logps - 0.1).masked_fill(pad, 0.0))
    dirty = b.replace(logps=b.logps.masked_fill(pad, values[0]),
                      old_logps=b.old_logps.masked_fill(pad, values[1]),
                      ref_logps=(b.logps - 0.1).masked_fill(pad, values[2]))
    for x, y in zip(_report(obj, zero), _report(obj, dirty)):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)
        elif isinstance(x, tuple):  # (ρ, residual): ρ may be NaN (undefined) in both
            assert all(u == v or (u != u and v != v) for u, v in zip(x, y)), (x, y)
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_dfpo_min_with_a_nan_weight_inside_the_mask_gives_nan_not_index_error():
    from gradlab.core.dfpo import transform_weights

    w = torch.tensor([[1.0, 2.0], [math.nan, 3.0]])
    node = torch.tensor([[0, -1], [0, -1]])
    out = transform_weights(w, torch.tensor([1.0, -1.0]), node, 1, "min")
    assert math.isnan(out[0, 0]) and math.isnan(out[1, 0]) and out[0, 1] == 2.0


# ----------------------------------------------------------------------------- 2. one writer


HOLD = ("import sys, time\nfrom gradlab.loop.runs.store import RunStore\n"
        "s = RunStore(sys.argv[1], {'steps': 1})\nprint('holding', flush=True)\ntime.sleep(120)\n")


def test_second_writer_and_resume_of_a_live_run_name_the_holder(tmp_path, capsys):
    """A real second process holds RUN's lock: a fresh run and --resume into RUN are refused
    with one line naming its pid and host; once it is killed (-9) the folder is free again."""
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "holding"
        for extra in ([], ["--resume"]):
            assert main(["tandem", "--out", str(out), "--objectives", "grpo", *FAST, *extra]) == 2
            err = _one_line(capsys)
            assert f"is in use by pid {p.pid} on host " in err, err
        assert not (out / "metrics.jsonl").exists()  # nothing written by the refused runs
    finally:
        p.kill()
        p.wait()
    assert main(["tandem", "--out", str(out), "--objectives", "grpo", *FAST, "--steps", "1"]) == 0
    assert str(__import__("os").getpid()) in (out / ".lock").read_text()  # the new holder


def test_lock_is_reentrant_in_one_process_and_released_after_training(tmp_path):
    from gradlab.loop.runs.lock import _HELD, acquire

    a = acquire(tmp_path)
    b = acquire(tmp_path)
    assert a is b and a.count == 2
    a.release()
    b.release()
    assert not _HELD
    out = tmp_path / "t"
    assert main(["tandem", "--out", str(out), "--objectives", "grpo", *FAST, "--steps", "1"]) == 0
    assert not _HELD  # train() released it: another process may now write
    p = subprocess.run([sys.executable, "-c", "import sys; from gradlab.loop.runs.lock import acquire; "
                        "acquire(sys.argv[1]); print('ok')", str(out)], capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr


# ----------------------------------------------------------------------------- 3. resume



RUN = ["--objectives", "grpo", "--prompts", "4", "--G", "4", "--minibatches", "2",
       "--probe-contexts", "4", "--tax-every", "1", "--no-progress", "--lr", "1e-3", "--seed", "3"]


def _table(path) -> pd.DataFrame:
    df = gradlab.load_run(path)
    return df[~df["metric"].str.startswith("time_")].drop(columns="run").reset_index(drop=True)


def test_resume_alone_reads_the_stored_configuration(tmp_path):
    """Non-default options, then `--out DIR --resume --steps 3` alone: the stored options are
    used (the result equals an uninterrupted 3-step run) and config.json records steps=3."""
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["tandem", "--out", str(full), *RUN, "--steps", "3"]) == 0
    assert main(["tandem", "--out", str(part), *RUN, "--steps", "1"]) == 0
    assert main(["tandem", "--out", str(part), "--resume", "--steps", "3"]) == 0
    pd.testing.assert_frame_equal(_table(full), _table(part))
    stored = json.loads((part / "config.json").read_text())
    assert stored["steps"] == 3 and stored["lr"] == 1e-3 and stored["seed"] == 3


def test_resume_with_differing_options_is_refused_with_the_list(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1"]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["tandem", "--out", str(out), "--resume", "--lr", "0.5", "--prompts", "8"]) == 2
    err = _one_line(capsys)
    assert "--lr: stored 0.001, given 0.5" in err and "--prompts: stored 4, given 8" in err
    assert (out / "metrics.jsonl").read_text() == before
    assert json.loads((out / "config.json").read_text())["lr"] == 1e-3  # config.json unchanged
    with pytest.raises(ConfigError, match="--seed: stored 3, given 0"):  # the Python API too
        cfg = RunConfig(**{**json.loads((out / "config.json").read_text()), "seed": 0})
        train(cfg, resume=True)


def test_a_folder_without_checkpoint_restarts_from_step_0_under_resume(tmp_path):
    """Killed before its first checkpoint (config.json and metrics rows, no checkpoint):
    --resume starts over, and the result equals an uninterrupted run (no duplicate rows)."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert main(["tandem", "--out", str(full), *RUN, "--steps", "2"]) == 0
    assert main(["tandem", "--out", str(killed), *RUN, "--steps", "2"]) == 0
    shutil.rmtree(killed / "checkpoints")
    assert main(["tandem", "--out", str(killed), "--resume"]) == 0
    pd.testing.assert_frame_equal(_table(full), _table(killed))


def _reproduce(out, *extra):
    return [sys.executable, "-m", "gradlab", "reproduce", "--out", str(out), "--objectives",
            "grpo,gspo", "--prompts", "4", "--G", "4", "--minibatches", "2", "--ckpt-every", "1",
            "--tax-every", "0", "--probe-contexts", "4", "--no-progress", *extra]


def test_reproduce_again_remakes_figures_and_on_a_partial_run_says_what_to_type(tmp_path):
    out = tmp_path / "rep"
    p = subprocess.Popen(_reproduce(out, "--steps", "8"), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    state = out / "checkpoints" / "gspo" / "state.json"
    deadline = time.time() + 120
    while time.time() < deadline and not state.exists():
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    again = subprocess.run(_reproduce(out, "--steps", "8"), capture_output=True, text=True)
    assert again.returncode == 2
    want = f"type `gradlab reproduce --out {out} --resume` to continue it"
    assert want in again.stderr and len(again.stderr.strip().splitlines()) == 1, again.stderr
    typed = subprocess.run([sys.executable, "-m", "gradlab", "reproduce", "--out", str(out),
                            "--resume"], capture_output=True, text=True)
    assert typed.returncode == 0, typed.stderr
    assert set(gradlab.load_run(out)["step"]) == set(range(8))
    before = (out / "metrics.jsonl").read_text()
    (out / "summary.md").unlink()
    (out / "figures" / "training_curves.png").unlink()
    redo = subprocess.run(_reproduce(out, "--steps", "8"), capture_output=True, text=True)
    assert redo.returncode == 0, redo.stderr
    assert "re-made from the stored run" in (out / "summary.md").read_text()
    assert (out / "figures" / "training_curves.png").stat().st_size > 10_000
    assert (out / "metrics.jsonl").read_text() == before  # nothing trained again


# ----------------------------------------------------------------------------- 6. corrupt files


@pytest.fixture
def one_step_run(tmp_path) -> Path:
    out = tmp_path / "r"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1"]) == 0
    return out


@pytest.mark.parametrize("file,damage", [
    ("model.safetensors", "truncate"), ("model.safetensors", "garbage"),
    ("optimizer.safetensors", "truncate"), ("optimizer.safetensors", "missing"),
    ("state.json", "truncate"), ("state.json", "garbage"),
])
def test_corrupt_checkpoint_file_is_one_line_naming_path_and_what_to_do(one_step_run, file,
                                                                         damage, capsys):
    path = one_step_run / "checkpoints" / "grpo" / file
    raw = path.read_bytes()
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(raw[: len(raw) // 2] if damage == "truncate" else b"\xff\x00garbage" * 9)
    metrics = (one_step_run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["tandem", "--out", str(one_step_run), "--resume", "--steps", "2"]) == 2
    err = _one_line(capsys)
    assert str(path) in err and "start the run over with --resume" in err, err
    assert (one_step_run / "metrics.jsonl").read_text() == metrics  # nothing lost


def test_checkpoint_of_another_model_does_not_load_silently(one_step_run, capsys):
    path = one_step_run / "checkpoints" / "grpo" / "model.safetensors"
    sd = load_file(path)
    name = next(iter(sd))
    from safetensors.torch import save_file

    save_file({**sd, name: torch.zeros(3, 3)}, path)
    capsys.readouterr()
    assert main(["tandem", "--out", str(one_step_run), "--resume", "--steps", "2"]) == 2
    assert "does not fit this run" in _one_line(capsys)


def test_torn_last_metrics_line_is_cut_and_logged(one_step_run, caplog):
    metrics = one_step_run / "metrics.jsonl"
    good = metrics.read_text()
    before = _table(one_step_run)
    metrics.write_text(good + '{"step": 1, "objective": "grp')  # a crash mid-write
    pd.testing.assert_frame_equal(_table(one_step_run), before)
    assert "incomplete last line not read" in caplog.text
    assert main(["tandem", "--out", str(one_step_run), "--resume", "--steps", "2"]) == 0
    assert '"grp\n' not in metrics.read_text()
    # the good rows are kept (less the 1-step run's end-of-run evaluation, which a 2-step run
    # does not schedule at step 0: train.EVAL_KEYS)
    from gradlab.loop.train import EVAL_KEYS
    kept = [json.loads(x) for x in metrics.read_text().splitlines()]
    old = [{k: v for k, v in json.loads(x).items() if k not in EVAL_KEYS}
           for x in good.splitlines()]
    assert kept[: len(old)] == old
    assert set(gradlab.load_run(one_step_run)["step"]) == {0, 1}


def test_corrupt_metrics_line_elsewhere_is_an_error_and_nothing_is_deleted(one_step_run, capsys):
    metrics = one_step_run / "metrics.jsonl"
    text = '{"step": 0, "objective": "grpo", "loss": 1.0}\n' + "not json\n" + metrics.read_text()
    metrics.write_text(text)
    with pytest.raises(CorruptFileError, match=r"metrics.jsonl:2: corrupt line"):
        gradlab.load_run(one_step_run)
    capsys.readouterr()
    assert main(["tandem", "--out", str(one_step_run), "--resume", "--steps", "2"]) == 2
    assert "metrics.jsonl:2: corrupt line" in _one_line(capsys)
    assert metrics.read_text() == text


# ----------------------------------------------------------------------------- 5. input checks

GOOD = b'{"prompt": "3+4=?", "answer": "7", "solutions": ["so 3+4=7", "so 4+3=7"]}\n'


@pytest.mark.parametrize("body,msg", [
    (GOOD + b'{"prompt": "caf\xe9 3+4=?", "answer": "7"}\n',  # Latin-1
     ":2: not UTF-8 (byte 0xe9 at column 16: invalid continuation byte); save the file as UTF-8"),
    (GOOD + GOOD + b'{"prompt": "3+4=?", "answer": 7,}\n', ":3: invalid JSON at column 33"),
    (GOOD + b'["prompt", "answer"]\n', ':2: expected an object with "prompt" and "answer"'),
    (GOOD + '{"prompt": "café 3+4=?", "answer": "7", "solutions": ["so 3+4=7 ✓"]}\n'.encode(),
     ":2: 2 character(s) the tokenizer cannot encode (they would become <unk>): 'é' ×1, '✓' ×1"),
])
def test_task_file_faults_are_one_line_naming_file_and_line(tmp_path, body, msg, capsys):
    task = tmp_path / "t.jsonl"
    task.write_bytes(body)
    assert main(["tandem", "--out", str(tmp_path / "r"), "--task", str(task), *RUN,
                 "--steps", "1"]) == 2
    err = _one_line(capsys)
    assert f"{task}{msg}" in err, err


def test_utf8_bom_is_accepted(tmp_path):
    from gradlab.loop.setup.task import JsonlTask

    task = tmp_path / "t.jsonl"
    task.write_bytes(b"\xef\xbb\xbf" + GOOD)
    assert JsonlTask(task).problems(1, 0)[0].prompt == "3+4=?"


# ----------------------------------------------------------------------------- 7. gradlab check

LOSSES = '''
import torch

def token_mean(batch):  # W = A_i / N at every token: cancels at shared tokens
    return -(batch.advantages[:, None] * batch.logps * batch.mask).sum() / batch.mask.sum()

def seq_mean(batch):  # 1/|o_i| per sequence: a cancellation violation on unequal lengths
    per = (batch.advantages[:, None] * batch.logps * batch.mask).sum(-1) / batch.mask.sum(-1)
    return -per.mean()

def broken(batch):
    return batch.logps.sum() / 0 if False else 1 / 0

def not_scalar(batch):
    return batch.logps * batch.mask
'''


@pytest.fixture
def user_pkg(tmp_path) -> Path:
    pkg = tmp_path / "mylosses"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text(LOSSES)
    (tmp_path / "bad_import.py").write_text("import torch\nraise RuntimeError('boom at import')\n")
    return tmp_path


@pytest.mark.parametrize("args,code,err", [
    (["--loss", "mylosses.core:token_mean"], 0, None),
    (["--loss", "mylosses.core:seq_mean"], 1, None),
    (["--loss", "mylosses.core:nope"], 2, "has no callable 'nope'"),
    (["--loss", "nosuchpkg.core:fn"], 2, "no module 'nosuchpkg'"),
    (["--loss", "no_colon"], 2, "expected module:function"),
    (["--bogus-flag"], 2, "unrecognized arguments"),
    (["--loss", "mylosses.core:broken"], 3, "ZeroDivisionError: division by zero"),
    (["--loss", "mylosses.core:not_scalar"], 3, "returned shape (16, 12); expected a scalar"),
    (["--loss", "bad_import:fn"], 3, "boom at import"),
])
def test_check_exit_codes_from_the_console_script(user_pkg, args, code, err):
    """The `gradlab` console script (cwd not on sys.path: python -P) imports --loss pkg.mod:fn
    from the working directory; 0 pass, 1 violation, 2 bad arguments, 3 the loss raised."""
    p = subprocess.run([sys.executable, "-P", "-m", "gradlab", "check", *args, "--no-model",
                        "--only", "/on"],
                       cwd=user_pkg, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(gradlab.__file__).parents[1])})
    assert p.returncode == code, p.stdout[-2000:] + p.stderr[-2000:]
    if err:
        assert err in p.stderr
    if code == 3:
        if "returned" not in err:
            assert "Traceback (most recent call last)" in p.stderr  # the user's traceback
        assert p.stderr.strip().splitlines()[-1].startswith("gradlab check: error: --loss")


# ----------------------------------------------------------------------------- 9. threads


def test_threads_are_set_and_recorded_and_results_repeat_at_a_fixed_count(tmp_path):
    n = torch.get_num_threads()
    try:
        assert main(["tandem", "--out", str(tmp_path / "d"), *RUN, "--steps", "1"]) == 0
        assert json.loads((tmp_path / "d" / "config.json").read_text())["threads"] == 1  # the CLI default
        for k in ("a", "b"):
            assert main(["tandem", "--out", str(tmp_path / k), *RUN, "--steps", "1",
                         "--threads", "2"]) == 0
            assert torch.get_num_threads() == 2
            assert json.loads((tmp_path / k / "config.json").read_text())["threads"] == 2
        pd.testing.assert_frame_equal(_table(tmp_path / "a"), _table(tmp_path / "b"))
    finally:
        torch.set_num_threads(n)
    with pytest.raises(ConfigError, match="--threads: -1 is invalid"):
        RunConfig(threads=-1)


# ----------------------------------------------------------------------------- 8. TRL resume


def _trl_run(tmp_path, steps, resume=None, store_resume=False):
    pytest.importorskip("trl")
    from gradlab.integrations.audit import trl as trl_audit
    from gradlab.integrations.trl import GradlabConfig

    with trl_audit.quiet():
        args = trl_audit.grpo_args("dr_grpo", "token", 1, steps, str(tmp_path / "out"),
                                   save_strategy="steps", save_steps=2)
        gl = GradlabConfig(store=str(tmp_path / "store"), resume=store_resume)
        tr = trl_audit.make_trainer(args, trl_audit.WORKLOADS["arithmetic"], gl)
        tr.train(resume_from_checkpoint=resume)
    return tr


def test_trl_resume_continues_store_step_and_tokens(tmp_path):
    """4 steps with checkpoints at 2 and 4; then resume from checkpoint-2 (as after a crash
    past it): the store has steps 0-3 once each and tokens keep growing; TRL resumes exactly,
    so step and tokens equal the uninterrupted run's."""
    full = _trl_run(tmp_path / "a", 4)
    want = gradlab.load_run(full.gradlab_store.path, wide=True)[["step", "tokens"]]
    _trl_run(tmp_path / "b", 4)
    ck = tmp_path / "b" / "out" / "checkpoint-2"
    assert json.loads((ck / "gradlab_state.0.json").read_text())["windows"] == 2
    tr = _trl_run(tmp_path / "b", 4, resume=str(ck), store_resume=True)
    got = gradlab.load_run(tr.gradlab_store.path, wide=True)[["step", "tokens"]]
    assert list(got["step"]) == [0, 1, 2, 3]
    assert got["tokens"].is_monotonic_increasing and got["tokens"].iloc[2] > got["tokens"].iloc[1]
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True))


def test_trl_store_reuse_error_names_gradlab_config_resume(tmp_path):
    _trl_run(tmp_path, 1)
    with pytest.raises(FileExistsError, match=r"pass GradlabConfig\(resume=True\)") as e:
        _trl_run(tmp_path, 1)
    assert "--resume" not in str(e.value)


@pytest.mark.parametrize("damage", ["one-missing", "different-steps"])
def test_checkpoints_torn_between_objectives_are_one_line(tmp_path, damage, capsys):
    """Killed between two objectives' checkpoint saves: refused with what to do, not a crash."""
    out = tmp_path / "r"
    assert main(["tandem", "--out", str(out), *RUN, "--objectives", "grpo,gspo", "--steps", "1"]) == 0
    ck = out / "checkpoints" / "gspo"
    if damage == "one-missing":
        shutil.rmtree(ck)
    else:
        st = json.loads((ck / "state.json").read_text())
        (ck / "state.json").write_text(json.dumps({**st, "step": 2}))
    capsys.readouterr()
    assert main(["tandem", "--out", str(out), "--resume", "--steps", "2"]) == 2
    err = _one_line(capsys)
    assert "(a crash while saving them)" in err and f"delete {out / 'checkpoints'}" in err


def test_all_finite_check_equals_elementwise_isfinite():
    """The guard's one-pass check (a float32 sum, exact max |x| when the sum is not finite)
    equals isfinite over every element, including finite values whose sum overflows."""
    from gradlab.loop.faults.guard import _all_finite

    big = torch.full((4,), 3e38)  # finite; the sum overflows to inf
    cases = [[torch.randn(3, 5), torch.randn(7)], [big], [big, -big], [torch.randn(4), big],
             [torch.tensor([1.0, float("inf")])], [torch.tensor([float("nan")]), torch.ones(2)],
             [torch.tensor([float("inf")]), torch.tensor([-float("inf")])], [], [torch.ones(0)],
             [torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16)]]
    for ts in cases:
        ref = all(bool(torch.isfinite(t).all()) for t in ts)
        assert bool(_all_finite(ts)) == ref, ts


def test_an_unreadable_checkpoint_state_is_named_when_a_run_is_sized_up(tmp_path, caplog):
    """`run_status` (what `gradlab reproduce` and `gradlab view` read of a run folder) counts an
    unreadable state.json as no checkpoint and says so with a warning naming the file."""
    import logging

    from gradlab.core.variants import label
    from gradlab.loop.runs.resume import run_status

    cfg = RunConfig(out=str(tmp_path), objectives=["grpo", "gspo"], steps=6)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_json()))
    (tmp_path / "metrics.jsonl").write_text("")
    for name, text in (("grpo", '{"step": 4}'), ("gspo", '{"step": ')):
        d = tmp_path / "checkpoints" / label(name)
        d.mkdir(parents=True)
        (d / "state.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="gradlab"):
        assert run_status(tmp_path) == (0, 6)
    bad = tmp_path / "checkpoints" / label("gspo") / "state.json"
    assert any(str(bad) in r.getMessage() and "counted as no checkpoint" in r.getMessage()
               for r in caplog.records), caplog.text
