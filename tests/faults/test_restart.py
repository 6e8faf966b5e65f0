"""Restarted ranks: `--resume auto`, a job restarted by torchrun resuming by itself, and a rank
killed under `torchrun --max-restarts 1` ending in a complete run with every step once and the
uninterrupted metrics (loop/runs/resume.py `resolve_resume`, loop/scale/dist.py rendezvous per round)."""

import os
import signal
import sys
import time

import numpy as np
import pytest

import gradlab
from gradlab.cli.main import main

from .helpers import ENV, RUN, STEPS, assert_same_run, ckpt_step, wait_lines

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
DDP = [*RUN, "--ckpt-every", "1", "--eval-every", "0"]  # evaluation is covered elsewhere


def test_resume_auto_starts_fresh_then_resumes(tmp_path, reference):
    out = tmp_path / "run"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1", "--resume", "auto"]) == 0
    assert ckpt_step(out) == 1  # nothing there: a fresh run
    assert main(["tandem", "--out", str(out), "--resume", "auto", "--steps", str(STEPS)]) == 0
    assert_same_run(reference, out)


def test_resume_takes_no_other_value(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tandem", "--out", str(tmp_path), "--resume", "yes"])
    assert e.value.code == 2
    assert "--resume takes no value or 'auto'" in capsys.readouterr().err


def test_a_restarted_job_resumes_by_itself(tmp_path, reference, monkeypatch):
    """TORCHELASTIC_RESTART_COUNT=1 (what torchrun sets in a restarted worker) and the same
    command line as the first round: the run continues from its checkpoint."""
    out = tmp_path / "run"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1"]) == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert main(["tandem", "--out", str(out), *RUN, "--steps", str(STEPS)]) == 0
    assert_same_run(reference, out)


def _children(pid: int) -> list[int]:
    from test_ddp import _children as children  # tests/test_ddp.py: /proc walk

    return children(pid)


def _killed_run(out, steps: int) -> str:
    """torchrun --max-restarts 1; rank 1 is killed (-9) once two steps are written."""
    import subprocess

    cmd = [*TORCHRUN, "--max-restarts", "1", "-m", "gradlab", "tandem", "--out", str(out),
           "--steps", str(steps), *DDP]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_lines(out / "metrics.jsonl", 2, timeout=300)
    workers = _children(p.pid)
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)  # the later-started worker: local rank 1
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-3000:]
    assert log.count("restart 1 of this torchrun job: resuming") == 1, log[-3000:]
    assert "exitcode: -9" in log, log[-3000:]
    return log


@pytest.mark.skipif(not os.path.exists("/proc"), reason="finds the workers through /proc")
def test_killed_rank_is_restarted_and_the_run_completes(tmp_path, reference):
    """Every step once, the tokens of the uninterrupted single-process run exactly, and its
    metrics within data-parallel rounding (tests/test_ddp.py: summation order per rank)."""
    out = tmp_path / "run"
    _killed_run(out, STEPS)
    got, want = gradlab.load_run(out, wide=True), gradlab.load_run(reference, wide=True)
    assert list(got["step"]) == list(range(STEPS))  # no duplicated or missing step
    assert list(got["tokens"]) == list(want["tokens"])
    assert list(got["reward"]) == list(want["reward"])
    for m in ("loss", "grad_norm", "rho_prefix", "probe_kl", "entropy"):
        np.testing.assert_allclose(got[m], want[m], rtol=1e-4, atol=1e-6, err_msg=m)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc"), reason="finds the workers through /proc")
def test_killed_rank_run_is_bitwise_the_uninterrupted_two_rank_run(tmp_path):
    import subprocess

    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run([*TORCHRUN, "-m", "gradlab", "tandem", "--out", str(full), "--steps", "5",
                    *DDP], env=ENV, check=True, capture_output=True, timeout=600)
    _killed_run(killed, 5)
    assert_same_run(full, killed)


@pytest.mark.skipif(not os.path.exists("/proc"), reason="finds the workers through /proc")
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 only: the ranks agree (one all-reduce per step), both checkpoint and
    exit 143 — nothing hangs — and rank 0 prints the torchrun command that resumes."""
    import subprocess

    out = tmp_path / "run"
    cmd = [*TORCHRUN, "-m", "gradlab", "tandem", "--out", str(out), "--steps", "50", *DDP]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_lines(out / "metrics.jsonl", 1, timeout=300)
    t0 = time.time()
    os.kill(max(_children(p.pid)), signal.SIGTERM)
    log, _ = p.communicate(timeout=300)
    k = ckpt_step(out)
    assert 1 <= k < 50 and (out / "metrics.jsonl").read_text().count("\n") == k, log[-3000:]
    assert log.count("stopped by SIGTERM") == 1, log[-3000:]
    assert (f"resume with: torchrun --nproc_per_node=2 -m gradlab tandem --out {out} --resume"
            in log), log[-3000:]
    assert "exitcode: 143" in log and "exitcode: -" not in log, log[-3000:]  # no rank killed
    assert time.time() - t0 < 120
