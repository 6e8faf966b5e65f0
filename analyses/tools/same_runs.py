"""Are two run folders the same numbers? Bitwise, except what is allowed to differ.

Compares every value of metrics.jsonl except wall-clock timings (`time_*`) and the reasons a
newer store writes beside its nulls (`"undefined"`, where the older run has none), samples.jsonl, and
the bytes of every checkpoint and trace file; config.json except its `out`. Used to show that a
change of code that should not change behaviour (a refactor, a new option left off) did not:
train the same configuration before and after, then

    python -m analyses.tools.same_runs RUN_BEFORE RUN_AFTER

prints what matched and every difference, and exits 1 when anything differs. Bitwise equality
holds only on the same CPU model, torch build and thread count (gradlab/provenance.py). A config
key that only the newer run has is allowed when its value is `RunConfig`'s default (an option the
older code did not have, left off); the output names each one.

    python -m analyses.tools.same_runs OLD_RUN NEW_FOLDER --retrain --record figures/ablations.json

first trains OLD_RUN's own config.json again, with the code installed now, into NEW_FOLDER (at
the config's thread count); `--record` writes the check into each figure JSON's `same_runs`
list (the before run's code hash, the after run's, the run, identical or not, what matched),
which `python -m analyses.tools.provenance` prints beside the figure's runs by that code. `--outputs OLD NEW` compares two output files
byte for byte instead (a figure measured in-process, with no run folder).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradlab import jsonio

ALLOWED_CONFIG = {"out"}  # where the run was written


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _new_defaults(ca: dict, cb: dict) -> dict:
    """Config keys only the newer run b has, whose value is RunConfig's default: {key: value}."""
    from dataclasses import MISSING, fields

    from gradlab.loop.config import RunConfig

    default = {f.name: f.default if f.default is not MISSING else f.default_factory()
               for f in fields(RunConfig)}
    return {k: cb[k] for k in sorted(set(cb) - set(ca)) if k in default and cb[k] == default[k]}


def compare(a: Path, b: Path) -> tuple[dict, list[str]]:
    """(counts of what matched, differences as lines) between run folders a and b; counts
    holds "new options": the config keys allowed by `_new_defaults`."""
    from gradlab.loop.config import current_form

    diffs, counts = [], {"metric values": 0, "files": 0}
    # an older run's flat measuring flags compare as the instrument spec they measure
    ca, cb = (current_form(json.loads((p / "config.json").read_text())) for p in (a, b))
    counts["new options"] = _new_defaults(ca, cb)
    for k in sorted((set(ca) | set(cb)) - ALLOWED_CONFIG - set(counts["new options"])):
        if ca.get(k) != cb.get(k):
            diffs.append(f"config.json: {k} {ca.get(k)!r} vs {cb.get(k)!r}")
    ma, mb = _jsonl(a / "metrics.jsonl"), _jsonl(b / "metrics.jsonl")
    if len(ma) != len(mb):
        diffs.append(f"metrics.jsonl: {len(ma)} vs {len(mb)} rows")
    for i, (x, y) in enumerate(zip(ma, mb)):
        for k in sorted(set(x) | set(y)):
            if k.startswith("time_"):
                continue
            if k == jsonio.UNDEFINED and k not in x:
                # the reasons of a newer store's nulls; the nulls themselves are compared
                counts["undefined reasons added"] = counts.get("undefined reasons added", 0) + 1
                continue
            if x.get(k) != y.get(k):
                diffs.append(f"metrics.jsonl row {i} ({x.get('objective')}, step {x.get('step')}): "
                             f"{k} {x.get(k)!r} vs {y.get(k)!r}")
            elif k != jsonio.UNDEFINED:  # the reasons are compared, not counted as values
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


def _code(run: Path) -> str | None:
    from gradlab.provenance import summary

    return summary(run, False)["code_hash"]


def retrain(old: Path, new: Path) -> None:
    """Train `old`'s configuration (its config.json, out → `new`) with the code installed now."""
    import dataclasses

    from gradlab.loop.config import RunConfig
    from gradlab.loop.train import train

    train(dataclasses.replace(RunConfig.from_json(old / "config.json"), out=str(new)))


def record(figure: Path, entry: dict) -> None:
    """Add (or replace, same code hashes and run) a check in a figure JSON's `same_runs`."""
    meta = json.loads(figure.read_text())
    keep = [p for p in meta.get("same_runs", []) if (p.get("code_hash"), p.get("against_code_hash"),
            p.get("run")) != (entry["code_hash"], entry["against_code_hash"], entry["run"])]
    meta["same_runs"] = keep + [entry]
    figure.write_text(jsonio.dumps(meta, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="the run (or, with --outputs, the file) of the older code")
    p.add_argument("b", type=Path, help="the same configuration by the newer code")
    p.add_argument("--show", type=int, default=20, help="differences printed at most")
    p.add_argument("--outputs", action="store_true",
                   help="a and b are output files (a figure made in-process): compare bytes")
    p.add_argument("--record", nargs="+", type=Path, metavar="FIGURE_JSON", default=[],
                   help="record the check in these figure JSONs' same_runs lists")
    p.add_argument("--codes", nargs=2, metavar=("OLD", "NEW"),
                   help="the two code hashes (needed with --outputs; read from the runs otherwise)")
    p.add_argument("--label", help="the run's name in the record (default: a's folder name)")
    p.add_argument("--retrain", action="store_true",
                   help="first train a's config.json with the code installed now into b (a new folder)")
    args = p.parse_args(argv)
    if args.retrain:
        if args.outputs or args.b.exists():
            p.error(f"--retrain: {args.b} must be a new folder (and not with --outputs)")
        retrain(args.a, args.b)
    if args.outputs:
        if not args.codes and args.record:
            p.error("--outputs --record: give --codes OLD NEW")
        same = args.a.read_bytes() == args.b.read_bytes()
        detail = f"{args.a.name}: {args.a.stat().st_size:,} bytes " + ("identical" if same else "differ")
        diffs = [] if same else [detail]
    else:
        for run in (args.a, args.b):
            if not (run / "metrics.jsonl").exists():
                p.error(f"{run}: not a run folder (no metrics.jsonl)")
        counts, diffs = compare(args.a, args.b)
        detail = (f"{counts['metric values']:,} metric values and {counts['files']} checkpoint, "
                  "trace and sample files identical")
        if counts["new options"]:
            detail += ("; the newer config adds " + ", ".join(f"{k}={v!r}" for k, v in
                       counts["new options"].items()) + " (options the older code did not have, "
                       "at their defaults)")
        if counts.get("undefined reasons added"):
            detail += (f"; the newer store gives the reason of its nulls in "
                       f"{counts['undefined reasons added']:,} rows (values the same)")
    print(detail)
    if diffs:
        print(f"{len(diffs)} differences:\n" + "\n".join(diffs[:args.show]))
    else:
        print("the same numbers")
    old, new = args.codes or (_code(args.a), _code(args.b))
    for fig in args.record:
        record(fig, {"code_hash": old, "against_code_hash": new,
                     "run": args.label or f"{args.a.parent.name}/{args.a.name}",
                     "identical": not diffs, "detail": detail if not diffs else
                     f"{len(diffs)} differences, first: {diffs[0]}"})
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
