"""Seconds per rollout step of the main job at 1 and 2 torch threads, with and without another
process spinning on one core: the measurement behind the CLI's default of one thread
(docs/performance.md#threads).

Each repeat runs `gradlab reproduce --steps STEPS --threads T` for T = 1, 2 (interleaved, fresh
run folders in a temporary directory), first as is, then with `python -c "while True: pass"`
running beside it. Per run: the median of the run's own `time_step` (seconds per objective and
rollout step) and the command's wall time. Printed: per condition and thread count the median
over repeats with the range, and the 2-thread / 1-thread ratio.

    OMP_NUM_THREADS=1 python -m analyses.benchmarks.bench_threads --steps 6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(out: Path, threads: int, steps: int) -> tuple[float, float]:
    """(median seconds per objective-step, wall seconds) of one `gradlab reproduce`."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gradlab", "reproduce", "--steps", str(steps),
                    "--threads", str(threads), "--out", str(out), "--no-progress"],
                   check=True, capture_output=True)
    wall = time.perf_counter() - t0
    steps_s = [json.loads(line).get("time_step") for line in (out / "metrics.jsonl").open()]
    return statistics.median(t for t in steps_s if t is not None), wall


def measure(steps: int, repeats: int) -> dict:
    """{(condition, threads): [(step_s, wall_s), ...]} over `repeats` interleaved repeats."""
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for cond in ("as is", "+ one spinning process"):
                spin = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        if cond != "as is" else None)
                try:
                    for t in (1, 2):
                        res.setdefault((cond, t), []).append(
                            one_run(Path(tmp) / f"{r}-{t}-{cond[0]}", t, steps))
                finally:
                    if spin is not None:
                        spin.kill()
                        spin.wait()
    return res


def table(res: dict) -> str:
    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3g} ({min(xs):.3g}–{max(xs):.3g})"

    lines = ["| condition | 1 thread: s per step | 2 threads: s per step | 2 / 1 | "
             "1 thread: wall s | 2 threads: wall s |", "|---|---|---|---|---|---|"]
    for cond in dict.fromkeys(c for c, _ in res):
        one, two = res[(cond, 1)], res[(cond, 2)]
        ratio = statistics.median(s for s, _ in two) / statistics.median(s for s, _ in one)
        lines.append(f"| {cond} | {cell([s for s, _ in one])} | {cell([s for s, _ in two])} | "
                     f"{ratio:.1f}× | {cell([w for _, w in one])} | {cell([w for _, w in two])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="rollout steps per run (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    a = p.parse_args()
    print(table(measure(a.steps, a.repeats)))
