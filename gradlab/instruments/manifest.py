"""A run's instruments, written beside its metrics (`instruments.json`): what was measured,
on which schedule, and the curves each one asks `gradlab view` to draw (so a viewer needs no
import of a user's instrument code)."""

from __future__ import annotations

import json
from pathlib import Path

from .. import jsonio
from .base import Instrument

NAME = "instruments.json"


def write_manifest(run: str | Path, instruments: list[Instrument]) -> Path:
    """Write `instruments.json` into the run folder `run`; returns its path."""
    from ..atomic import write_file

    rows = [{"name": i.name, "class": f"{type(i).__module__}:{type(i).__qualname__}",
             "every": i.schedule.every, "start": i.schedule.start, "first": i.schedule.first,
             "phase": i.phase, "cost": i.cost, "curves": [list(c) for c in i.curves]}
            for i in instruments]
    path = Path(run) / NAME
    write_file(path, jsonio.dumps(rows, indent=1) + "\n")
    return path


def manifest_curves(run: str | Path) -> list[tuple[str, str]]:
    """The (metric, title) curves the run's instruments declared ([] without a manifest)."""
    path = Path(run) / NAME
    if not path.exists():
        return []
    return [tuple(c) for row in json.loads(path.read_text()) for c in row.get("curves", [])]
