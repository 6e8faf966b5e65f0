"""torchrun + DDP (gloo, 2 CPU processes) against one process on the same global batch."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from procs import run_tree
from safetensors.torch import load_file

import gradlab

ARGS = ["--objectives", "grpo,gspo", "--prompts", "4", "--G", "4", "--minibatches", "2",
        "--ckpt-every", "3", "--tax-every", "1", "--probe-contexts", "4", "--no-progress"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(out: Path, steps: int, popen: bool = False, extra: tuple = ()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "gradlab", "tandem", "--out", str(out), "--steps", str(steps), *ARGS, *extra]
    if popen:
        return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return run_tree(cmd, timeout=600, together=120, env=ENV)


# Metrics not held to one process, with why: wall-clock times; tax_cos, the cosine of a g_tax
# that is float noise (~1e-10) on on-policy optimizer steps and is averaged over steps, so its
# rounding (summation order differs per rank) is not small; attr_length, whose counterfactual
# sets T_i to the mean length of the rows the objective sees, a rank's own rows under DDP.
NOT_COMPARED = ("tax_cos", "attr_length")


def _same_store(wa, wb) -> None:
    """Every metric of the store (not a chosen few) as one process, within float rounding
    (rtol 1e-4: measured ≤ 1e-6 relative): sums, maxima, per-step pooled values and the ratios
    that DDP reduces from numerators and denominators (clip_frac, ratio_mean, attr_*). The
    attribution shares are ratios to attr_residual, compared where it is not float noise."""
    assert sorted(wa.columns) == sorted(wb.columns)
    cols = [c for c in wa.columns if wa[c].dtype.kind == "f" and not c.startswith("time_")
            and c not in NOT_COMPARED]
    assert {"clip_frac", "ratio_mean", "attr_clip", "attr_coupling", "rho_prefix"} <= set(cols)
    assert "shared_mass_share" in cols or "shared_mass_share" not in wb.columns
    real = wa["attr_residual"].to_numpy() > 1e-6
    assert real.any()  # an attribution of a real residual is compared
    bad = {}
    for c in cols:
        rows = real if c.startswith("attr_") and c != "attr_residual" else slice(None)
        a, b = wa[c].to_numpy()[rows], wb[c].to_numpy()[rows]
        if not np.allclose(b, a, rtol=1e-4, atol=1e-6, equal_nan=True):
            bad[c] = (a.tolist(), b.tolist())
    assert not bad, "\n".join(f"{c}: one process {a}, two ranks {b}" for c, (a, b) in bad.items())


# the default instruments and a user's one (examples/own_instrument.py): its sums reduce over ranks
OWN = ("--instruments", f"default,{Path(__file__).parents[1] / 'examples' / 'own_instrument.py'}:SharedMass")


def test_two_ranks_equal_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, "-m", "gradlab", "tandem", "--out", str(one), "--steps", "3",
                    *ARGS, *OWN], env=ENV, check=True, capture_output=True, timeout=600)
    r = _torchrun(two, 3, extra=OWN)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for obj in ("grpo", "gspo"):
        a = load_file(one / "checkpoints" / obj / "model.safetensors")
        b = load_file(two / "checkpoints" / obj / "model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            scale = float(a[k].abs().max()) + 1e-12
            assert float((a[k] - b[k]).abs().max()) / scale < 1e-5, (obj, k)
    wa, wb = gradlab.load_run(one, wide=True), gradlab.load_run(two, wide=True)
    assert len(wa) == len(wb) == 6
    assert (wa["tokens"].to_numpy() == wb["tokens"].to_numpy()).all()
    for m, tol in [("reward", 0), ("accuracy", 0), ("rho_prefix", 1e-6), ("rho_trie", 1e-6),
                   ("probe_kl", 1e-6), ("drift_node_kl_mean", 1e-7), ("grad_norm", 1e-5),
                   ("tax_share", 1e-6), ("loss", 1e-6)]:
        np.testing.assert_allclose(wa[m], wb[m], rtol=1e-3, atol=tol, err_msg=m)
    assert (wa["rho_prefix"][wa["objective"] == "gspo"] > 1e-3).any()  # a real residual compared
    _same_store(wa, wb)


def test_resume_under_ddp_equals_uninterrupted(tmp_path):
    """Two ranks: 2 steps, then --resume to 3, against 3 steps in one process."""
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, "-m", "gradlab", "tandem", "--out", str(one), "--steps", "3",
                    *ARGS], env=ENV, check=True, capture_output=True, timeout=600)
    for steps, extra in ((2, ()), (3, ("--resume",))):
        r = _torchrun(two, steps, extra=extra)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wa, wb = gradlab.load_run(one, wide=True), gradlab.load_run(two, wide=True)
    assert list(wb["step"]) == list(wa["step"])
    for m in ("reward", "rho_prefix", "grad_norm", "probe_kl"):
        np.testing.assert_allclose(wa[m], wb[m], rtol=1e-3, atol=1e-6, err_msg=m)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc to find the worker processes")
def test_killing_one_rank_fails_the_launch_and_leaves_the_store_readable(tmp_path):
    out = tmp_path / "killed"
    proc = _torchrun(out, 40, popen=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and
                                          len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.1)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "FAILED" in log and "SIGKILL" in log, log[-2000:]
    df = gradlab.load_run(out)
    assert df["step"].max() >= 0 and set(df["objective"]) <= {"grpo", "gspo"}


def test_two_ranks_with_micro_batch_equal_one_process(tmp_path):
    """Micro-batching per rank (no_sync on all but the last micro-batch) against one process
    without micro-batching: same weights and metrics. 8 prompts × G = 4 and 2 minibatches:
    each rank holds 2 groups per optimizer step, so --micro-batch 4 makes 2 micro-batches
    per rank and step."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = list(ARGS)
    args[args.index("--prompts") + 1] = "8"
    subprocess.run([sys.executable, "-m", "gradlab", "tandem", "--out", str(one), "--steps", "2",
                    *args], env=ENV, check=True, capture_output=True, timeout=600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "gradlab", "tandem", "--out", str(two), "--steps", "2", *args,
           "--micro-batch", "4"]
    r = run_tree(cmd, timeout=600, together=120, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for obj in ("grpo", "gspo"):
        a = load_file(one / "checkpoints" / obj / "model.safetensors")
        b = load_file(two / "checkpoints" / obj / "model.safetensors")
        for k in a:
            scale = float(a[k].abs().max()) + 1e-12
            assert float((a[k] - b[k]).abs().max()) / scale < 1e-5, (obj, k)
    wa, wb = gradlab.load_run(one, wide=True), gradlab.load_run(two, wide=True)
    for m, tol in [("reward", 0), ("rho_prefix", 1e-6), ("rho_trie", 1e-6), ("grad_norm", 1e-5),
                   ("tax_share", 1e-6), ("loss", 1e-6), ("drift_node_dlogp_mean", 1e-6)]:
        np.testing.assert_allclose(wa[m], wb[m], rtol=1e-3, atol=tol, err_msg=m)
    _same_store(wa, wb)
