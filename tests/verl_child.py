"""Run a test file's verl cases in a child python that sees .verl-site.

verl 0.9 pins transformers<5.11 while this environment runs 5.24 (TRL), so verl is not installed
here: .ci/run puts it (without dependencies) into .verl-site/, and each verl test file runs itself
again in a child python with that folder on PYTHONPATH, where its verl cases run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("GRADLAB_VERL_SITE", ROOT / ".verl-site"))


def run_in_verl_env(test_file: str, have_verl: bool, **env: str) -> None:
    """Run `test_file` under pytest in a child python with .verl-site on PYTHONPATH (plus `env`);
    fail with the child's output unless every case passed. Skips when verl is importable in this
    process (the cases then run here directly) or not installed."""
    if have_verl:
        pytest.skip("verl importable in this process: the cases run here directly")
    if not (SITE / "verl").is_dir():
        pytest.skip(f"verl not installed: no {SITE}/verl (the verl block of .ci/run makes it)")
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]),
                 "OMP_NUM_THREADS": "1", **env}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-W", "ignore::UserWarning", str(Path(test_file))], cwd=ROOT, env=child_env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "error" not in last, r.stdout[-2000:]
