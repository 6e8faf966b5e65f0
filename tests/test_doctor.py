"""`gradlab doctor` on the CPU: the report it writes, its exit codes, and that its checks catch
what they claim to catch (a wrong closed form, bf16 gaps beyond the bounds)."""

import subprocess
import sys

import pytest
import torch

from gradlab import objectives
from gradlab.cli.doctor import Check, read_step, report, tiny_case
from gradlab.loop.numerics.precision import W_EXACT_RTOL, amp_failures

ENV_RUN = {"timeout": 300, "capture_output": True, "text": True}


def test_doctor_on_cpu_passes_and_writes_the_report(tmp_path):
    out = tmp_path / "doctor.md"
    r = subprocess.run([sys.executable, "-m", "gradlab", "doctor", "--device", "cpu", "--out",
                        str(out)], **ENV_RUN)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and str(out) in r.stdout
    text = out.read_text()
    assert text.startswith("# gradlab doctor") and "**PASS** — cpu: CPU" in text
    for check in ("bf16 autocast", "W exact (float32)", "W exact under bf16 autocast",
                  "bf16 within bounds of float32", "loop (one tandem step, --amp)"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {check} |"))
        cells = [c.strip() for c in row.split(" | ")]
        assert cells[1] == "ok" and float(cells[-1].rstrip(" |")) >= 0, row
    assert "peak RSS of the process" in text and "MiB" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_doctor_asked_for_a_missing_gpu_fails_with_one_line(tmp_path):
    out = tmp_path / "doctor.md"
    r = subprocess.run([sys.executable, "-m", "gradlab", "doctor", "--device", "cuda", "--out",
                        str(out)], **ENV_RUN)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("gradlab doctor: FAIL") and "CUDA" in lines[0]
    assert "**FAIL**" in out.read_text()  # the report says so too


class _DoubledLoss:
    """GRPO whose loss is twice what its closed form says: the W the hook measures is 2× the
    closed form, the kind of mismatch the exactness check exists to catch."""

    def __init__(self) -> None:
        self.base = objectives.get("grpo")

    def loss(self, batch):
        return 2 * self.base.loss(batch)

    def modulation(self, batch):
        return self.base.modulation(batch)


def test_exactness_check_catches_a_wrong_closed_form():
    case = tiny_case("cpu", prompts=2, G=4)
    good = read_step(case.model, case.ro, case.adv, objectives.get("grpo"), amp=False)
    bad = read_step(case.model, case.ro, case.adv, _DoubledLoss(), amp=False)
    assert good.closed_gap <= W_EXACT_RTOL
    assert bad.closed_gap == pytest.approx(0.5, rel=1e-5)  # |2W − W| / |2W|
    assert torch.allclose(bad.W, 2 * good.W, rtol=1e-6, atol=0)


def test_amp_bounds_name_each_broken_one():
    ok = {"logp_max": 0.1, "logp_mean": 0.01, "w_l1": 0.01, "grad_cos": 0.999}
    assert amp_failures(ok) == []
    bad = amp_failures({"logp_max": 2.0, "logp_mean": 0.5, "w_l1": 0.5, "grad_cos": 0.5})
    assert len(bad) == 4 and any("cosine" in b for b in bad)
    assert amp_failures({**ok, "grad_cos": float("nan")})  # NaN is a failure, not a pass


def test_report_marks_failures_and_escapes_table_cells():
    checks = [Check("a", True, "fine", 0.5), Check("b", False, "max |x| = 2", 1.0)]
    text = report(checks, {"device": "cpu: CPU", "setup_s": 1.0, "peak_mib": 10.0})
    assert "**FAIL**" in text
    assert "| b | FAIL | max \\|x\\| = 2 | 1.00 |" in text.splitlines()


def test_gpu_suite_is_collected_by_its_marker():
    """`pytest -m gpu` collects tests/test_gpu.py (skipped here without CUDA, run with one)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
                        "tests/test_gpu.py"], **ENV_RUN)
    assert r.returncode == 0, r.stdout + r.stderr
    collected = [line for line in r.stdout.splitlines() if line.startswith("tests/test_gpu.py::")]
    assert len(collected) >= 4 and any("memory" in c for c in collected), r.stdout
