"""Every result the pages quote, checked against the committed data; data blocks rewritten.

    python -m analyses.tools.quoted          # list quoted results that match no data (exit 1 if any)
    python -m analyses.tools.quoted --write  # rewrite the <!-- data:NAME -->…<!-- /data --> blocks

Pages: README.md, figures/README.md, figures/real_trl*.md, docs/**/*.md. Results are found by their form, so that a
hyper-parameter or a size is never picked up:

  interval   "x [lo, hi]" (optionally ", p P"): one data record must give all three (and P)
  range      "[lo, hi]" alone: one record's interval
  p          "p P", "Holm P": a p-value (raw or Holm-adjusted) of some comparison
  spread     "x ± s": one group's mean and sd over seeds
  value      any other number in a results table (a row holding an interval), except its
             first column and columns headed "paper" (the paper's numbers): a value of the
             files of an experiment that one of the row's intervals comes from

Each number matches a value v at its printed precision (|v − q| ≤ half a unit of the last
printed digit; "−" is a minus), in the data's units or ×100 (accuracy 0..1 quoted in points or
%). Records come from figures/comparisons.csv, every seeds file (per group: mean, t interval,
sd; paired differences between the objectives of one layout), the long tables (grouped over
seeds, steps and batches; a metric with `_lo`/`_hi` siblings is an interval) and every numeric
[m, lo, hi] and number in the JSON files. Percentages, × ratios and "a to b" ranges in prose are
not matched one by one: thousands of stored values match nearly any two-digit number, so that
check could not fail. Prose built on such derived numbers (a share averaged over steps, a ratio
of two experiments) is a data block instead, rewritten from data by
analyses.tools.quoted_data.BLOCKS.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.tools.quoted_data import render  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "figures"
NUM = r"[+\-−]?\d+(?:\.\d+)?(?:e[+\-−]?\d+)?"
PATTERNS = {
    "interval": re.compile(rf"(?<![\w.\-−+])({NUM})\s?%?\s\[({NUM}),\s({NUM})\]"
                           rf"(?:(?:,\s|\s\()p\s({NUM}))?"),
    "range": re.compile(rf"(?<![\d.%]\s)(?<![\d.%])\[({NUM}),\s({NUM})\]"),
    "p": re.compile(rf"(?:(?<![\w.])p|Holm(?:-adjusted)?(?: p)?)\s({NUM})(?![\d.])"),
    "spread": re.compile(rf"(?<![\w.])({NUM})\s?%?\s±\s({NUM})"),
}
LONG_DROP = {  # what a long table's groups average over
    "seed", "step", "batch", "opt_step", "eval_seed", "tokens", "run", "parted_at"}


@dataclass
class Quote:
    page: str
    line: int
    kind: str
    text: str
    numbers: tuple[str, ...]


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose quoted results are checked."""
    return [root / "README.md", root / "figures" / "README.md",
            root / "figures" / "real_trl.md", root / "figures" / "real_trl_cost.md",
            *sorted((root / "docs").rglob("*.md"))]


def quotes(text: str, page: str = "") -> list[Quote]:
    """Every result quoted in `text` (fenced code blocks skipped; a range inside an interval and
    a p inside an interval are the interval's, not quoted again)."""
    out, fenced, header = [], False, []
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        found: list[Quote] = []
        taken: list[tuple[int, int]] = []
        for kind, pat in PATTERNS.items():
            for m in pat.finditer(line):
                if any(a <= m.start() < b for a, b in taken):
                    continue
                taken.append(m.span())
                found.append(Quote(page, i, kind, m.group(0), tuple(g for g in m.groups() if g)))
        if not line.startswith("|"):
            header = []
        elif not header:
            header = [c.strip().lower() for c in line.strip("|").split("|")]
        elif any(q.kind == "interval" for q in found):
            found += _cells(line, header, page, i)
        out += found
    return out


def _cells(line: str, header: list[str], page: str, i: int) -> list[Quote]:
    """The numbers of a results-table row outside intervals, p-values and spreads, skipping
    the first column (the row's label) and columns headed "paper"."""
    out = []
    for col, cell in enumerate(line.strip().strip("|").split("|")):
        if col == 0 or (col < len(header) and "paper" in header[col]):
            continue
        cell = re.sub(r"(\d) (\d{3})\b", r"\1\2", cell)  # 121 090 → 121090
        for pat in PATTERNS.values():
            cell = pat.sub(" ", cell)
        for m in re.finditer(rf"(?<![\w.\-−+=])({NUM})(?![\w.])", re.sub(r"`[^`]*`", " ", cell)):
            out.append(Quote(page, i, "value", m.group(0), (m.group(1),)))
    return out


def _value(s: str) -> tuple[float, float]:
    """(value, half a unit of the last printed digit) of a printed number."""
    s = s.replace("−", "-")
    mant, _, exp = s.partition("e")
    decimals = len(mant.partition(".")[2])
    scale = 10.0 ** int(exp) if exp else 1.0
    return float(s), 0.5 * 10.0 ** -decimals * scale


def near(q: str, v: np.ndarray) -> np.ndarray:
    """Mask of v that print as q (in v's units)."""
    x, tol = _value(q)
    with np.errstate(invalid="ignore"):
        return np.abs(v - x) <= tol * (1 + 1e-9) + 1e-12


@dataclass
class Source:
    """What one data file gives: intervals (n, 4) mean, lo, hi, p (NaN where none); spreads
    (n, 2) mean, sd; values (every record's value, every number of a JSON file)."""
    name: str
    intervals: np.ndarray
    spreads: np.ndarray
    values: np.ndarray


def sources(figures: Path = FIGURES) -> list[Source]:
    """The records of every data file under `figures` (see the module docstring)."""
    from analyses.tools.quoted_data import seed_records, table_records

    out = []
    c = pd.read_csv(figures / "comparisons.csv")
    iv = np.vstack([c[["mean_diff", "lo", "hi", "p_value"]].to_numpy(float),
                    c[["mean_diff", "lo", "hi", "p_holm"]].to_numpy(float)])
    out.append(_source("comparisons.csv", iv, np.empty((0, 2))))
    for f in sorted(figures.rglob("*.csv")):
        if f.name != "comparisons.csv":
            d = pd.read_csv(f)
            iv, sp = seed_records(d) if f.name.endswith("_seeds.csv") else table_records(d, LONG_DROP)
            out.append(_source(str(f.relative_to(figures)), iv, sp))
    for f in sorted(figures.rglob("*.json")):
        doc = json.loads(f.read_text())
        out.append(_source(str(f.relative_to(figures)), _json_records(doc), np.empty((0, 2)),
                           _json_numbers(doc)))
    return out


def _source(name: str, iv: np.ndarray, sp: np.ndarray, extra: np.ndarray | None = None) -> Source:
    vals = np.concatenate([iv[:, 0], sp[:, 0], np.empty(0) if extra is None else extra])
    return Source(name, iv, sp, vals[np.isfinite(vals)])


def _json_numbers(obj) -> np.ndarray:
    """Every number in a JSON document."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list):
        parts = [_json_numbers(v) for v in obj]
        return np.concatenate(parts) if parts else np.empty(0)
    ok = isinstance(obj, (int, float)) and not isinstance(obj, bool)
    return np.asarray([obj] if ok else [], dtype=float)


def _json_records(obj) -> np.ndarray:
    """Every numeric [m, lo, hi] list, {x, x_lo, x_hi} dict and {mean, lo, hi[, p]} dict (the
    form of `gradlab.stats.paired_interval`) in a JSON document."""
    found = []
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731

    def walk(o):
        if isinstance(o, dict):
            if all(num(o.get(k)) for k in ("mean", "lo", "hi")):
                found.append((o["mean"], o["lo"], o["hi"], o["p"] if num(o.get("p")) else np.nan))
            for k, v in o.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    lo, hi = o.get(f"{k}_lo"), o.get(f"{k}_hi")
                    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
                        found.append((v, lo, hi, np.nan))
                walk(v)
        elif isinstance(o, list):
            if len(o) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in o):
                found.append((*o, np.nan))
            for v in o:
                walk(v)

    walk(obj)
    return np.asarray(found, dtype=float).reshape(-1, 4)


def _matches(q: Quote, s: Source, scale: float) -> bool:
    r = s.intervals
    if q.kind == "p":
        return bool(near(q.numbers[0], r[:, 3]).any())
    if q.kind == "value":
        return bool(near(q.numbers[0], scale * s.values).any())
    if q.kind == "spread":
        return bool((near(q.numbers[0], scale * s.spreads[:, 0])
                     & near(q.numbers[1], scale * s.spreads[:, 1])).any())
    m = np.ones(len(r), dtype=bool)
    for n, c in zip(q.numbers, (1, 2) if q.kind == "range" else (0, 1, 2)):
        m &= near(n, scale * r[:, c])
    if q.kind == "interval" and len(q.numbers) == 4:
        m &= near(q.numbers[3], r[:, 3])
    return bool(m.any())


def origins(q: Quote, src: list[Source]) -> set[str]:
    """The data files in which some record prints as the quote (in their units or ×100)."""
    return {s.name for s in src for scale in (1.0, 100.0) if _matches(q, s, scale)}


def _stem(name: str) -> str:
    """'noise_floor_seeds.csv', 'noise_floor.json' → 'noise_floor': one experiment's files."""
    return Path(name).stem.removesuffix("_seeds")


def unsourced(root: Path = ROOT, figures: Path = FIGURES, src: list[Source] | None = None,
              texts: dict[str, str] | None = None) -> list[Quote]:
    """The quotes of every page (or of `texts`: page name → text) that match no data. A table
    value must come from the files of an experiment that one of its row's intervals comes from."""
    src = src or sources(figures)
    texts = texts or {str(p.relative_to(root)): p.read_text() for p in pages(root)}
    bad = []
    for name, t in texts.items():
        row_files: dict[int, set[str]] = {}
        for q in quotes(t, name):
            if q.kind == "value":
                stems = {_stem(f) for f in row_files.get(q.line, set())}
                if not origins(q, [s for s in src if _stem(s.name) in stems]):
                    bad.append(q)
                continue
            found = origins(q, src)
            row_files.setdefault(q.line, set()).update(found)
            if not found:
                bad.append(q)
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the pages' data blocks")
    a = p.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text, FIGURES)
        if new != text:
            stale.append(page)
            if a.write:
                page.write_text(new)
    if stale:
        verb = "rewrote" if a.write else "data blocks out of date (run --write)"
        print(f"{verb}: " + ", ".join(str(s.relative_to(ROOT)) for s in stale))
    bad = unsourced()
    for q in bad:
        print(f"{q.page}:{q.line}: {q.kind} '{q.text}' matches no data")
    print(f"{len(bad)} quoted results without a source" if bad else "every quoted result has a source")
    return 1 if bad or (stale and not a.write) else 0


if __name__ == "__main__":
    sys.exit(main())
