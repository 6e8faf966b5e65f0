"""The instruments of one run, by phase and schedule (what a host iterates over)."""

from __future__ import annotations

from collections.abc import Iterable

from .base import Instrument, Readings, check_needs


class InstrumentSet:
    """A run's instruments. `due(step, phase)` lists those that run at rollout step `step`;
    `measure` runs the due "step"-phase ones on a view and merges their readings;
    `quantities()` is every instrument's finalize rules (declared whether or not due, so that
    every data-parallel rank finalizes the same way)."""

    def __init__(self, instruments: Iterable[Instrument] = ()) -> None:
        self.items = list(instruments)
        names = [i.name for i in self.items]
        if len(set(names)) != len(names):
            raise ValueError(f"InstrumentSet: an instrument appears twice in {names}")
        # built once: the same objects every step, so a metrics object declares them in O(1)
        self._quantities = [q for i in self.items for q in i.quantities()]

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"InstrumentSet({self.items})"

    @property
    def names(self) -> list[str]:
        return [i.name for i in self.items]

    def get(self, name: str) -> Instrument | None:
        return next((i for i in self.items if i.name == name), None)

    def due(self, step: int, phase: str | None = None) -> list[Instrument]:
        return [i for i in self.items if i.schedule.active(step) and phase in (None, i.phase)]

    def needs(self, step: int) -> set[str]:
        """Union of the needs of the instruments due at `step`."""
        return {n for i in self.due(step) for n in i.needs}

    def check(self, offered: set[str], host: str) -> None:
        check_needs(self.items, offered, host)

    def measure(self, view, step: int) -> Readings:
        out = Readings()
        for inst in self.due(step, "step"):
            out.update(inst.measure(view))
        return out

    def quantities(self) -> list:
        return list(self._quantities)
