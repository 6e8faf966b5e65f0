"""Which code made each published figure's runs, computed now from figures/**/*.json.

    python -m analyses.tools.provenance            # every figure under figures/
    python -m analyses.tools.provenance --figures DIR

Per figure JSON it prints the runs it lists: those made by the shipped code (code hash equal to
`gradlab.provenance.code_hash()` of the package installed now), those made by other code (with
each hash, its commit and how many runs), and for other code whether `analyses/tools/same_runs.py`
showed a run of it identical to one of the code that scored the figure (the JSON's `same_runs`
records, where the check was made). A figure whose JSON lists no runs is "runs not recorded"
with the commit that made it where the JSON names one. Whether a run's code is the shipped code
is never stored in the JSON: it changes with every later change to gradlab/, so it is computed
here each time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FIGURES = Path(__file__).resolve().parents[2] / "figures"


def listed_runs(meta: dict) -> list[dict]:
    """The per-run provenance rows a figure JSON lists (`runs` or `run_provenance`: a list of
    rows, or a mapping run → record holding its `provenance`), or []."""
    for key in ("runs", "run_provenance"):
        rows = meta.get(key)
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            return rows
        if isinstance(rows, dict) and rows and all(
                isinstance(v, dict) and isinstance(v.get("provenance"), dict) for v in rows.values()):
            return [{"run": k, **v["provenance"]} for k, v in rows.items()]
    return []


def made_by(meta: dict) -> str:
    """The commit (and command) a JSON without per-run rows names for its runs, or ''."""
    for src in (meta.get("runs_made_by"), meta.get("provenance"), meta):
        if isinstance(src, dict) and src.get("commit"):
            dirty = " + uncommitted changes" if src.get("dirty") else ""
            cmd = f" by `{src['command']}`" if src.get("command") else ""
            return f"commit {src['commit'][:7]}{dirty}{cmd}"
    return ""


def describe(meta: dict, shipped: str) -> list[str]:
    """Lines for one figure's JSON: runs by the shipped code, by other code, same_runs proofs."""
    runs = listed_runs(meta)
    if not runs:
        made = made_by(meta)
        return ["  runs not recorded" + (f"; made at {made}" if made else "")]
    mine = [r for r in runs if _hashes(r) == {shipped}]
    lines = [f"  {len(runs)} runs listed; by the shipped code ({shipped}): {len(mine)}"]
    others: dict[str, list[dict]] = {}
    for r in runs:
        if _hashes(r) != {shipped}:
            others.setdefault(r.get("code_hash") or "unrecorded", []).append(r)
    proofs: dict[str, list[dict]] = {}
    for p in meta.get("same_runs", []):
        proofs.setdefault(p["code_hash"], []).append(p)
    for h, rs in others.items():
        commits = sorted({(r.get("commit") or "?")[:7] for r in rs})
        lines.append(f"  by other code {h}: {len(rs)} runs (commit {', '.join(commits)})")
        injected = sorted({r["injected"] for r in rs if r.get("injected")})
        if injected and len(injected) == len(rs):  # a regression study's deliberately changed copy
            lines.append(f"    injected change {', '.join(injected)}: other code by design")
            continue
        lines += ["    same_runs: " + _proof(q) for q in proofs.get(h, [])] or ["    same_runs: not recorded"]
    return lines


def _hashes(row: dict) -> set[str]:
    return set((row.get("code_hash") or "unrecorded").split(","))


def _proof(p: dict) -> str:
    verdict = "identical" if p.get("identical") else "DIFFERENT"
    return (f"{verdict} to code {p.get('against_code_hash', '?')} on {p['run']} "
            f"({p.get('detail', '')})").replace(" ()", "")


def report(figures: Path = FIGURES) -> list[str]:
    """The report's lines for every *.json under `figures` (sub-folders included)."""
    from gradlab.provenance import code_hash

    shipped = code_hash()
    out = [f"shipped code: {shipped}"]
    for path in sorted(figures.rglob("*.json")):
        try:
            meta = json.loads(path.read_text())
        except ValueError as e:
            out += [f"{path.relative_to(figures)}:", f"  unreadable JSON ({e})"]
            continue
        if isinstance(meta, dict):
            out += [f"{path.relative_to(figures)}:", *describe(meta, shipped)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--figures", default=str(FIGURES), help="folder of figure JSONs (default figures/)")
    a = p.parse_args(argv)
    if not Path(a.figures).is_dir():
        print(f"analyses.tools.provenance: --figures {a.figures}: no such folder", file=sys.stderr)
        return 2
    print("\n".join(report(Path(a.figures))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
