"""A machine's own reference of the main job and the exact half of `gradlab reproduce --check`.

On one CPU model, torch build and thread count (the *fingerprint*) the same code gives the
same numbers bitwise. `gradlab reproduce --save-reference FILE` stores, per seed, the summary
numbers (`reproduce.summarize`) and every per-step metric series of the tidy table, with the
run configuration (and which options were typed), the fingerprint and the code hash.
`gradlab reproduce --check FILE` re-runs that configuration and, on the same fingerprint,
compares exactly: a value is unchanged when |new − ref| ≤ `RTOL` · max(|new|, |ref|) (the
float64 round-off of the summary arithmetic; the stored series themselves are bitwise), and
NaN equals NaN. Every summary number and series that changed is listed with the first step
where it parted and its size in units of the seed spread (several reference seeds) or
relative to the reference value (one seed). Wall-clock timings (time_*) are not compared.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from ... import provenance
from ..runs.store import load_run

RTOL = 1e-12
FINGERPRINT = ("cpu_model", "cpu_capability", "torch", "threads")


def untimed(names) -> list[str]:
    """The names that are not wall-clock timings (time_*, time_*_s)."""
    return [c for c in names if not str(c).startswith("time_")]


def fingerprint(run: str | Path) -> dict:
    """CPU model and kernels, torch build and threads of a run folder (its provenance.json, last segment),
    the code hash of every segment (comma-joined) and the last segment's user files
    (`gradlab.provenance.user_files`)."""
    segs = (provenance.read(run) or {}).get("segments", [])
    last = segs[-1] if segs else {}
    return {**{k: last.get(k) for k in FINGERPRINT},
            "code_hash": ",".join(dict.fromkeys(s.get("code_hash", "?") for s in segs)) or None,
            "commit": last.get("commit"), "user_files": last.get("user_files") or {}}


def same_machine(a: dict, b: dict) -> bool:
    """True iff two fingerprints agree on CPU model and kernels, torch build and thread count."""
    return all(a.get(k) == b.get(k) for k in FINGERPRINT)


UNDEFINED_MEAN = "no finite value at any step of the run"


def summary_numbers(summary: pd.DataFrame) -> dict:
    """{objective: {number: value}} of a summary frame, timings left out; an undefined number
    is NaN and named in the objective's "undefined" entry with its reason (gradlab.jsonio
    writes it as null)."""
    s = summary.set_index("objective")
    out = {}
    for obj in s.index:
        row = {c: float(s.loc[obj, c]) for c in untimed(s.columns)}
        why = {c: UNDEFINED_MEAN for c, v in row.items() if not math.isfinite(v)}
        out[obj] = {**row, "undefined": why} if why else row
    return out


def series(tidy: pd.DataFrame) -> dict:
    """{objective: {metric: {"steps": [...], "values": [...]}}} of a run's tidy table, the
    step's token count as the series "tokens", timings left out; an undefined step is NaN
    (gradlab.jsonio writes it as null, with the reason under "values")."""
    out: dict = {}
    for obj, d in tidy.groupby("objective", sort=False):
        wide = d.pivot_table(index="step", columns="metric", values="value", dropna=False,
                             aggfunc="first").sort_index()
        tokens = d.groupby("step")["tokens"].first().reindex(wide.index)
        per = {m: wide[m] for m in untimed(wide.columns)}
        per["tokens"] = tokens
        out[str(obj)] = {m: {"steps": [int(i) for i in v.index],
                             "values": [float(x) for x in v.to_numpy(dtype=float)]}
                         for m, v in sorted(per.items())}
    return out


def run_record(run: str | Path, summary: pd.DataFrame) -> dict:
    """What a saved reference keeps of one seed's run: folder, fingerprint, summary, series."""
    return {"run": str(run), "fingerprint": fingerprint(run),
            "summary": summary_numbers(summary), "series": series(load_run(run))}


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise "changed": NaN vs NaN unchanged, NaN vs a number changed, else |Δ| beyond
    RTOL relative."""
    na, nb = np.isnan(a), np.isnan(b)
    with np.errstate(invalid="ignore"):
        far = np.abs(a - b) > RTOL * np.maximum(np.abs(a), np.abs(b))
    return (na != nb) | (~na & ~nb & far)


def _arr(vals) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in vals], dtype=float)


def _spread(ref: dict, pick) -> float:
    """The seed sd of a quantity across the reference's seeds (`pick(run_record)` → value or
    array; arrays: the mean over steps of the per-step sd); NaN with fewer than 2 seeds."""
    vals = [pick(r) for r in ref["runs"]]
    vals = [v for v in vals if v is not None]
    if len(vals) < 2:
        return math.nan
    try:
        with warnings.catch_warnings():  # a step measured in one seed only: its sd is NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            sd = np.nanstd(np.vstack([np.atleast_1d(v) for v in vals]), axis=0, ddof=1)
    except ValueError:  # series of unequal lengths
        return math.nan
    return float(np.nanmean(sd)) if np.isfinite(sd).any() else math.nan


def compare_numbers(ref: dict, i: int, new: dict) -> list[dict]:
    """The summary numbers of reference seed `i` that changed in `new` (summary_numbers):
    objective, what, ref, new, delta, size (in seed sd, NaN without a spread), rel."""
    old = ref["runs"][i]["summary"]
    rows = []
    for obj in sorted(set(old) | set(new)):
        a, b = old.get(obj, {}), new.get(obj, {})
        for m in sorted((set(a) | set(b)) - {"undefined"}):  # undefined: NaN, compared as such
            x, y = _arr([a.get(m)]), _arr([b.get(m)])
            if (m in a) == (m in b) and not _differ(x, y)[0]:
                continue
            d = float(y[0] - x[0])
            sd = _spread(ref, lambda r, o=obj, m=m: r["summary"].get(o, {}).get(m))
            rows.append({"objective": obj, "what": m, "ref": float(x[0]), "new": float(y[0]),
                         "delta": d, "size": d / sd if sd > 0 else math.nan,
                         "rel": d / abs(x[0]) if x[0] else math.nan,
                         "note": "" if (m in a) == (m in b) else
                         ("only in the reference" if m in a else "only in the check run")})
    return rows


def compare_series(ref: dict, i: int, new: dict) -> list[dict]:
    """The per-step series of reference seed `i` that changed in `new` (`series`): objective,
    what, first (the first step where it parted), max |Δ| and its size in seed sd."""
    old = ref["runs"][i]["series"]
    rows = []
    for obj in sorted(set(old) | set(new)):
        a, b = old.get(obj, {}), new.get(obj, {})
        for m in sorted(set(a) | set(b)):
            if m not in a or m not in b:
                rows.append({"objective": obj, "what": m, "first": math.nan,
                             "max_abs": math.nan, "size": math.nan,
                             "note": "only in the reference" if m in a else
                             "only in the check run"})
                continue
            row = _series_change(ref, obj, m, a[m], b[m])
            if row:
                rows.append(row)
    return rows


def _series_change(ref: dict, obj: str, m: str, a: dict, b: dict) -> dict | None:
    sa, sb = a["steps"], b["steps"]
    steps = sorted(set(sa) | set(sb))
    va = pd.Series(_arr(a["values"]), index=sa).reindex(steps).to_numpy()
    vb = pd.Series(_arr(b["values"]), index=sb).reindex(steps).to_numpy()
    moved = _differ(va, vb) | ~np.isin(steps, sa) | ~np.isin(steps, sb)
    if not moved.any():
        return None
    first = int(np.array(steps)[moved][0])
    with np.errstate(invalid="ignore"):
        gap = np.abs(vb - va)
    max_abs = float(np.nanmax(gap)) if np.isfinite(gap).any() else math.nan
    sd = _spread(ref, lambda r: _arr(r["series"].get(obj, {}).get(m, {}).get("values", []))
                 if m in r["series"].get(obj, {}) else None)
    return {"objective": obj, "what": m, "first": first, "max_abs": max_abs,
            "size": max_abs / sd if sd > 0 else math.nan,
            "note": "" if len(sa) == len(sb) else f"{len(sa)} → {len(sb)} steps"}


def _size(r: dict) -> str:
    if math.isfinite(r.get("size", math.nan)):
        return f"{r['size']:+.3g} sd" if "delta" in r else f"{r['size']:.3g} sd"
    if math.isfinite(r.get("rel", math.nan)):
        return f"{100 * r['rel']:+.3g} % (no seed spread)"
    return "—"


def exact_report(numbers: list[dict], changed: list[dict], seeds: list[int]) -> str:
    """Markdown: the summary numbers and the per-step series that changed (per seed, the
    series by first step parted), or the word "identical"."""
    from .reference import fmt

    head = (f"Exact check (same CPU model, torch build and threads as the reference) of seed(s) "
            f"{seeds}: a value is unchanged when |Δ| ≤ {RTOL:g} × its magnitude (NaN = NaN); "
            "timings (time_*) are not compared.")
    if not numbers and not changed:
        return head + "\n\nidentical: every summary number and every per-step series"
    out = [head, ""]
    if numbers:
        out += [f"Summary numbers that changed ({len(numbers)}):", "",
                "| seed | objective | number | reference | check | Δ | size |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['seed']} | {r['objective']} | {r['what']} | {fmt(r['ref'])} | "
                f"{fmt(r['new'])} | {fmt(r['delta'], '+.3g')} | {r['note'] or _size(r)} |"
                for r in numbers]
        out.append("")
    if changed:
        order = sorted(changed, key=lambda r: (r["seed"], r["first"] if math.isfinite(
            r["first"]) else math.inf, r["objective"], r["what"]))
        out += [f"Per-step series that changed ({len(changed)}; earliest first):", "",
                "| seed | objective | series | first step parted | max abs Δ | size |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['seed']} | {r['objective']} | {r['what']} | {fmt(r['first'], 'g')} | "
                f"{fmt(r['max_abs'])} | {r['note'] or _size(r)} |" for r in order]
        out.append("")
    out.append(f"CHANGED: {len(numbers)} summary number(s) and {len(changed)} per-step "
               "series differ from the reference")
    return "\n".join(out)
