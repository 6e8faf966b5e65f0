"""A run's instruments, written beside its metrics (`instruments.json`): what was measured,
on which schedule, every metric each one writes (its unit, and why it can be undefined), and
the curves each one asks `gradlab view` to draw — so the viewer and the run store read a run
without importing any instrument's code (a user's included).

The file is a JSON list, one entry per instrument, and first an entry "loop" for what
gradlab's loop records itself (rollout reward, accuracy, entropy, …; a TRL run has none):

    {"name": "residual", "class": "gradlab.instruments.builtin:Residual", "every": 1,
     "start": 0, "first": null, "phase": "step", "cost": "cheap",
     "curves": [["rho_prefix", "cancellation ratio ρ (full-group nodes)", "log"], …],
     "metrics": [{"name": "rho_prefix", "unit": "ratio", "undefined": "no node of …"},
                 {"name": "residual_prefix", "unit": "sum", "part_of": "rho_prefix"}, …,
                 {"family": "flips/", "unit": "ratio", "undefined": "…"}]}

A curve is [metric, title], with "log" third where it is drawn on a log axis. A metric
entry names one metric, or (`family`) every metric whose name starts so: the
metrics of a `Derived` rule known only at run time. `undefined` is "" for a metric that
always has a value; `part_of` marks a sum or count a ratio is made of, kept in the record.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .. import jsonio
from .base import Derived, Instrument, Ratio

NAME = "instruments.json"
LOOP = "loop"  # the entry of what gradlab's loop records itself

_NO_GRAD = "no gradient (every group tied)"
# Curves and raw readings (sums, maxima, means written as they are) of the built-in
# instruments, beside what their classes declare: metric (or family, ending "/") → (unit,
# when it is undefined).
BUILTIN_CURVES: dict[str, tuple[tuple[str, ...], ...]] = {  # (metric, title[, "log"])
    "residual": (("rho_prefix", "cancellation ratio ρ (full-group nodes)", "log"),
                 ("rho_trie", "cancellation ratio ρ (trie nodes)", "log")),
    "tax": (("tax_share", "‖g_tax‖ / ‖g_total‖"),),
}
BUILTIN_READINGS: dict[str, dict[str, tuple[str, str]]] = {
    "modulation": {"w_dev": ("W", "non-finite W"), "w_max": ("W", "non-finite W")},
    "residual": {"mass_prefix": ("W", ""), "mass_trie": ("W", "")},
    "same_batch": {"cf/": ("W", "no node of the kind, or W ≡ 0 at its nodes")},
    "tax": {"tax_norm": ("norm", ""), "total_norm": ("norm", ""),
            "tax_share": ("share", _NO_GRAD), "tax_cos": ("cosine", f"{_NO_GRAD}, or g_tax = 0"),
            "tax_share/": ("share", f"{_NO_GRAD} in the layer group")},
    "fisher": {"fisher_nodes": ("count", "")},
}


def quantity_rows(quantities: list) -> list[dict]:
    """The manifest's metric entries of `Ratio`/`Derived` rules: each ratio, the sums it keeps
    in the record (`part_of`), and each derived rule's metrics — by name where its rule names
    them on empty sums, and always as its `family`."""
    rows: list[dict] = []
    for q in quantities:
        if isinstance(q, Ratio):
            rows.append({"name": q.name, "unit": q.unit, "undefined": q.undefined})
            rows += [{"name": part, "unit": "sum", "undefined": "", "part_of": q.name}
                     for part, drop in ((q.num, q.drop_num), (q.den, q.drop_den)) if not drop]
        elif isinstance(q, Derived):
            try:  # the metrics it makes of empty sums (all NaN) are its names
                made = q.fn(defaultdict(float))
            except Exception:  # a rule that cannot run on empty sums: its family only
                made = {}
            rows += [{"name": k, "unit": q.unit, "undefined": q.undefined} for k in made]
            rows.append({"family": q.family, "unit": q.unit, "undefined": q.undefined})
    return rows


def _readings_rows(table: dict[str, tuple[str, str]]) -> list[dict]:
    return [{"family" if k.endswith(("/", "_")) else "name": k, "unit": u, "undefined": why}
            for k, (u, why) in table.items()]


def loop_entry() -> dict:
    """The manifest entry of what gradlab's loop records itself (`gradlab.instruments.own`)."""
    from .own import OWN_CURVES, OWN_QUANTITIES, OWN_RECORDS, TOKEN_STATS, TOKSUM

    stats = [{"name": k, "unit": u, "undefined": "no response token", "part_of": TOKSUM}
             for k, u in TOKEN_STATS.items()]
    return {"name": LOOP, "class": None, "curves": [list(c) for c in OWN_CURVES],
            "metrics": quantity_rows(OWN_QUANTITIES) + stats + _readings_rows(OWN_RECORDS)}


def instrument_entry(i: Instrument) -> dict:
    """The manifest entry of one instrument: schedule, curves and every metric it writes."""
    builtin = type(i).__module__ == "gradlab.instruments.builtin"
    curves = [*(BUILTIN_CURVES.get(i.name, ()) if builtin else ()), *i.curves]
    readings = BUILTIN_READINGS.get(i.name, {}) if builtin else {}
    rows = quantity_rows(i.quantities()) + _readings_rows(readings)
    return {"name": i.name, "class": f"{type(i).__module__}:{type(i).__qualname__}",
            "every": i.schedule.every, "start": i.schedule.start, "first": i.schedule.first,
            "phase": i.phase, "cost": i.cost, "curves": [list(c) for c in curves],
            "metrics": rows + _writes_rows(i.writes, rows)}


def _writes_rows(writes: tuple[str, ...], rows: list[dict]) -> list[dict]:
    """Entries (unit "": not declared) for what an instrument's `writes` names and `rows` does
    not: "tax_share/<layer group>" or "drift_node_*" is the family before the first "<" or "*",
    covered where `rows` names a metric of it."""
    names = {q["name"] for q in rows if "name" in q}
    families = {q["family"] for q in rows if "family" in q}
    out = []
    for w in writes:
        cut = min((w.index(c) for c in "<*" if c in w), default=None)
        key = w if cut is None else w[:cut]
        covered = (key in names | families or any(key.startswith(f) for f in families) or
                   (cut is not None and any(n.startswith(key) for n in names)))
        if not covered:
            out.append({"name" if cut is None else "family": key, "unit": "", "undefined": ""})
            (names if cut is None else families).add(key)
    return out


def write_manifest(run: str | Path, instruments: list[Instrument], loop: bool = False) -> Path:
    """Write `instruments.json` into the run folder `run`; returns its path. loop: the run is
    gradlab's loop (its own records get the entry "loop"). A resumed run whose manifest says the
    same already is left as it is (no write, so a full disk fails where the run writes next)."""
    from ..atomic import write_file

    rows = ([loop_entry()] if loop else []) + [instrument_entry(i) for i in instruments]
    path = Path(run) / NAME
    text = jsonio.dumps(rows, indent=1) + "\n"
    if not (path.is_file() and path.read_text() == text):
        write_file(path, text)
    return path


class Manifest:
    """The manifest of one run, read: `curves` [(metric, title)] in declaration order,
    `unit(metric)` and `undefined(metric)` (its reason) by name or family ("" unknown),
    `names()` what it names. `Manifest.read(run)` raises a one-line FileNotFoundError for a
    run folder without one."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self.curves: list[tuple[str, str]] = []
        self.log: set[str] = set()  # curves drawn on a log axis (span float round-off to ~1)
        self.metrics: dict[str, dict] = {}
        self.families: dict[str, dict] = {}
        for row in rows:
            for m, title, *how in row.get("curves", []):
                if m not in dict(self.curves):
                    self.curves.append((m, title))
                    self.log.update([m] if "log" in how else [])
            for q in row.get("metrics", []):
                into, key = (self.metrics, q["name"]) if "name" in q else (self.families, q["family"])
                if key not in into or (into[key].get("part_of") and not q.get("part_of")):
                    into[key] = {**q, "instrument": row.get("name")}

    @classmethod
    def read(cls, run: str | Path) -> Manifest:
        path = Path(run) / NAME
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: gradlab's loop and the TRL trainer write it when a run "
                f"starts; re-make it with `python -m gradlab.loop.recipes.manifest {run}`")
        return cls(json.loads(path.read_text()))

    @classmethod
    def of(cls, run: str | Path) -> Manifest | None:
        """The run's manifest, or None where the folder has none."""
        try:
            return cls.read(run)
        except FileNotFoundError:
            return None

    def describe(self, metric: str) -> dict | None:
        """The entry naming `metric`, or the longest family it belongs to; None if neither."""
        if metric in self.metrics:
            return self.metrics[metric]
        fams = [f for f in self.families if metric.startswith(f)]
        return self.families[max(fams, key=len)] if fams else None

    def unit(self, metric: str) -> str:
        d = self.describe(metric)
        return d.get("unit", "") if d else ""

    def undefined(self, metric: str) -> str:
        d = self.describe(metric)
        return d.get("undefined", "") if d else ""

    def names(self, metric: str) -> bool:
        return self.describe(metric) is not None


def builtin_manifest() -> Manifest:
    """The manifest of gradlab's loop measuring every built-in instrument: the reasons of a
    record that no run's manifest explains."""
    from .registry import resolve

    return Manifest([loop_entry()] + [instrument_entry(i) for i in resolve("full,same_batch")])
