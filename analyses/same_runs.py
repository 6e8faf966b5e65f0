"""Are two run folders the same numbers? Bitwise, except what is allowed to differ.

Compares every value of metrics.jsonl except wall-clock timings (`time_*`), samples.jsonl, and
the bytes of every checkpoint and trace file; config.json except its `out` and options that one
file lacks (a run older than the option) while the other holds them at RunConfig's default. Used to show that a
change of code that should not change behaviour (a refactor, a new option left off) did not:
train the same configuration before and after, then

    python analyses/same_runs.py RUN_BEFORE RUN_AFTER

prints what matched and every difference, and exits 1 when anything differs. Bitwise equality
holds only on the same CPU model, torch build and thread count (gradlab/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ALLOWED_CONFIG = {"out"}  # where the run was written


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _defaults() -> dict:
    """RunConfig's defaults, by option (an option one config.json lacks, because the run is
    older than it, and the other holds at its default is not a difference)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dataclasses import MISSING, fields

    from gradlab.loop.config import RunConfig

    return {f.name: f.default if f.default is not MISSING else f.default_factory()
            for f in fields(RunConfig)}


def compare(a: Path, b: Path) -> tuple[dict, list[str]]:
    """(counts of what matched, differences as lines) between run folders a and b."""
    diffs, counts = [], {"metric values": 0, "files": 0, "new options at their default": 0}
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    defaults = _defaults()
    for k in sorted((set(ca) | set(cb)) - ALLOWED_CONFIG):
        if (k in ca) != (k in cb) and k in defaults and ca.get(k, cb.get(k)) == defaults[k]:
            counts["new options at their default"] += 1  # an option added since, left off
        elif ca.get(k) != cb.get(k):
            diffs.append(f"config.json: {k} {ca.get(k)!r} vs {cb.get(k)!r}")
    ma, mb = _jsonl(a / "metrics.jsonl"), _jsonl(b / "metrics.jsonl")
    if len(ma) != len(mb):
        diffs.append(f"metrics.jsonl: {len(ma)} vs {len(mb)} rows")
    for i, (x, y) in enumerate(zip(ma, mb)):
        for k in sorted(set(x) | set(y)):
            if k.startswith("time_"):
                continue
            if x.get(k) != y.get(k):
                diffs.append(f"metrics.jsonl row {i} ({x.get('objective')}, step {x.get('step')}): "
                             f"{k} {x.get(k)!r} vs {y.get(k)!r}")
            else:
                counts["metric values"] += 1
    files = lambda p: {f.relative_to(p) for d in ("checkpoints", "traces") if (p / d).exists()
                       for f in (p / d).rglob("*") if f.is_file()} | {Path("samples.jsonl")}
    fa, fb = files(a), files(b)
    diffs += [f"only in {a}: {f}" for f in sorted(fa - fb)] + [f"only in {b}: {f}" for f in sorted(fb - fa)]
    for f in sorted(fa & fb):
        pa, pb = a / f, b / f
        if pa.exists() != pb.exists() or (pa.exists() and pa.read_bytes() != pb.read_bytes()):
            diffs.append(f"{f}: bytes differ")
        else:
            counts["files"] += 1
    return counts, diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--show", type=int, default=20, help="differences printed at most")
    args = p.parse_args(argv)
    for run in (args.a, args.b):
        if not (run / "metrics.jsonl").exists():
            p.error(f"{run}: not a run folder (no metrics.jsonl)")
    counts, diffs = compare(args.a, args.b)
    print(f"{counts['metric values']} metric values (timings excluded) and {counts['files']} "
          f"checkpoint, trace and sample files identical"
          + (f"; {counts['new options at their default']} option(s) only one config.json holds, "
             "at RunConfig's default" if counts["new options at their default"] else ""))
    if diffs:
        print(f"{len(diffs)} differences:\n" + "\n".join(diffs[:args.show]))
        return 1
    print("the same numbers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
