"""What an instrument is: one measured quantity as one object (docs/concepts/instruments.md).

An instrument declares
- `needs`: what it reads (`NEEDS`: the measured W, the step's batch, entropy, …); a host (the
  gradlab loop, the TRL trainer, verl's actor) refuses, in one line, an instrument whose needs it
  cannot give;
- `schedule`: when it runs (`Schedule`: every k steps, the first n, off);
- `measure(view) -> Readings`: its partial numbers for one optimizer step, tensors on the device:
  `sums` add over optimizer steps and data-parallel ranks, `maxes` take the max, `means` average
  over the steps where they are defined;
- `quantities()`: how the reduced sums become reported metrics (`Ratio`, `Derived`), each with
  the case in which it is undefined (NaN, never 0).

Instruments that read the weights before and after the optimizer step (`phase = "update"`)
implement `before(view)` and `after(view)` instead of `measure`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .schedule import Schedule

# what a host can hand an instrument (`view.<name>`), and which host gives it
NEEDS = {
    "W": "(B, T) measured modulation W = −∂loss/∂log π of the step (all hosts)",
    "batch": "the step's TokenBatch (B, T): tokens, mask, log-probs, advantages, groups (all hosts)",
    "objective": "the trained objective's closed form (gradlab's loop; TRL's and verl's losses "
                 "gradlab has a closed form of)",
    "entropy": "(B, T) token entropy, nats (gradlab's loop, TRL)",
    "model": "forwards of the policy before and after the optimizer step (gradlab's loop, TRL)",
    "grads": "the step's accumulated gradient, summed over ranks (gradlab's loop, TRL)",
    "others": "the other objectives of a tandem, for their closed forms on this batch (gradlab's "
              "loop, same-batch mode)",
}


@dataclass
class Readings:
    """Partial numbers of one optimizer step (0-dim tensors or floats): `sums` add over
    optimizer steps and ranks, `maxes` take the max, `means` are per-step values averaged over
    the steps where `defined` (a 0-dim bool, or None: always) holds."""

    sums: dict[str, Any] = field(default_factory=dict)
    maxes: dict[str, Any] = field(default_factory=dict)
    means: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def mean(self, name: str, value, defined=None) -> None:
        self.means[name] = (value, defined)

    def update(self, other: Readings) -> Readings:
        self.sums.update(other.sums)
        self.maxes.update(other.maxes)
        self.means.update(other.means)
        return self


def div(a: float, b: float) -> float:
    """a / b, or NaN where it is undefined: b = 0 (nothing to divide by) or either side NaN
    (a metric of a non-finite W). Never 0 for "undefined": 0 means measured and cancelled."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


@dataclass(frozen=True)
class Ratio:
    """Metric `name` = Σ num / Σ den over the rollout step (all optimizer steps and ranks),
    NaN when Σ den = 0 (`undefined` says when that happens). Reported only when `num` was
    measured; `drop_num` removes the numerator's sum from the record (a sum with no meaning
    of its own, e.g. Σ entropy), `drop_den` the denominator's (counts stay). `unit`: what
    the value measures ("ratio", "share", "nats", ...), written to the run's instruments.json."""

    name: str
    num: str
    den: str
    undefined: str
    drop_num: bool = False
    drop_den: bool = False
    unit: str = "ratio"

    def apply(self, totals: dict, out: dict) -> None:
        if self.num in totals:
            out[self.name] = div(totals[self.num], totals.get(self.den, 0))
            for part, drop in ((self.num, self.drop_num), (self.den, self.drop_den)):
                if drop:
                    out.pop(part, None)


@dataclass(frozen=True)
class Derived:
    """Metrics computed from the reduced sums by `fn(totals) -> {name: value}`, when any key
    starting with `family` was measured (a table of cells, e.g. the token-flip ledger);
    `undefined` says when a value is NaN."""

    family: str
    fn: Callable[[dict], dict]
    undefined: str
    drop: tuple[str, ...] = ()  # sums with no meaning of their own, removed from the record
    drop_family: bool = False  # remove every `family…` sum too
    unit: str = "ratio"  # what its values measure (`Ratio.unit`)

    def apply(self, totals: dict, out: dict) -> None:
        if any(k.startswith(self.family) for k in totals):
            made = self.fn(totals)
            for k in self.drop:
                out.pop(k, None)
            if self.drop_family:
                for k in [k for k in out if k.startswith(self.family)]:
                    out.pop(k)
            out.update(made)


Quantity = Ratio | Derived


class Instrument:
    """Base of an instrument (see the module doc). Subclasses set `name`, `needs` and
    `measure` (phase "step") or `before`/`after` (phase "update"), and `quantities` when
    their sums finalize into ratios. Instances are cheap; a host builds one per run."""

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset({"W", "batch"})
    phase: ClassVar[str] = "step"  # "step": reads the step's W; "update": around opt.step()
    cost: ClassVar[str] = "cheap"  # "cheap": no forward; "forward": extra forwards/backwards
    curves: ClassVar[tuple[tuple[str, str], ...]] = ()  # (metric, title) `gradlab view` draws
    writes: ClassVar[tuple[str, ...]] = ()  # the metrics it reports (`gradlab instruments`)

    def __init__(self, schedule: Schedule | None = None) -> None:
        self.schedule = schedule if schedule is not None else Schedule()

    def measure(self, view) -> Readings:  # phase "step"
        raise NotImplementedError(f"instrument {self.name!r}: no measure()")

    def before(self, view) -> Readings | None:  # phase "update": before opt.step(), grads present
        return None

    def after(self, view) -> Readings:  # phase "update": after opt.step()
        return Readings()

    def quantities(self) -> list[Quantity]:
        return []

    def __repr__(self) -> str:
        s = self.schedule
        when = "off" if not s.enabled else f"every {s.every}" + (f", first {s.first}" if s.first else "")
        return f"<instrument {self.name} ({when})>"


def check_needs(instruments: list[Instrument], offered: set[str], host: str) -> None:
    """Raise ValueError naming the first instrument whose needs `host` cannot give."""
    for inst in instruments:
        missing = sorted(set(inst.needs) - offered)
        if missing:
            raise ValueError(f"instrument {inst.name!r} needs {', '.join(missing)}, which {host} "
                             f"does not give (it gives: {', '.join(sorted(offered))})")
