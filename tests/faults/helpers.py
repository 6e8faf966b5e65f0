"""Shared pieces of the fault suite: a tiny run's options, subprocess launchers, comparisons."""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

import gradlab

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
# one objective, 4 prompts × G 4, 2 optimizer steps per rollout step; eval at the end only
RUN = ["--objectives", "grpo", "--prompts", "4", "--G", "4", "--minibatches", "2",
       "--probe-contexts", "4", "--tax-every", "1", "--no-progress", "--lr", "1e-3",
       "--seed", "3", "--eval-size", "4", "--trace-every", "2", "--threads", "1"]
GRADLAB = [sys.executable, "-m", "gradlab"]
STEPS = 4  # the reference run's length (conftest.py); a faulted run is resumed to it


def table(path) -> pd.DataFrame:
    """Every metric of a run but wall-clock times, in a fixed order (bitwise comparisons)."""
    df = gradlab.load_run(path)
    return df[~df["metric"].str.startswith("time_")].drop(columns="run").reset_index(drop=True)


def assert_same_run(a, b) -> None:
    pd.testing.assert_frame_equal(table(a), table(b))


def gradlab_cmd(out, *args) -> list[str]:
    return [*GRADLAB, "tandem", "--out", str(out), *args]


def popen(cmd: list[str], fsize: int | None = None) -> subprocess.Popen:
    """Start `cmd`; fsize: RLIMIT_FSIZE in bytes in the child (a larger write fails EFBIG)."""
    limit = None if fsize is None else (
        lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize)))
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=limit)


def run(cmd: list[str], fsize: int | None = None, timeout: float = 300) -> tuple[int, str]:
    """(exit code, stderr) of `cmd` run to its end."""
    p = popen(cmd, fsize)
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err


def wait_lines(path: Path, n: int, proc: subprocess.Popen | None = None,
               timeout: float = 300) -> None:
    """Wait until `path` holds n complete lines (or `proc` ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended ({proc.returncode}) before {path} had {n} "
                                 f"lines: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError(f"{path} did not reach {n} lines in {timeout} s")


def last_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


def ckpt_step(out: Path, objective: str = "grpo") -> int:
    import json

    return json.loads((out / "checkpoints" / objective / "state.json").read_text())["step"]


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (a checkpoint that must survive unchanged)."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def can_unshare() -> bool:
    """True when this process may make a private mount namespace (root with CAP_SYS_ADMIN):
    the read-only and full-disk faults are then real mounts seen by the child alone."""
    import shutil

    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def in_mount_ns(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run shell `script` in a private mount namespace (its mounts vanish with it)."""
    return subprocess.run(["unshare", "-m", "sh", "-c", script], env=ENV, capture_output=True,
                          text=True, timeout=timeout)
