"""Instruments: one object per measured quantity (docs/concepts/instruments.md).

An instrument says what it needs (W, the batch, forwards before and after the step), when it
runs (`Schedule`), how its partial sums reduce over optimizer steps and data-parallel ranks
(`Readings`), and how they finalize into metrics (`Ratio`, `Derived`: each with its undefined
case). gradlab's loop, the TRL trainer and verl's actor run the same objects.

    import gradlab.instruments as gi
    gi.available()                         # every registered instrument
    gi.resolve("cheap,tax@10")             # a preset plus one scheduled instrument
    @gi.register
    class Spread(gi.Instrument): ...       # your own (docs/guides/own-instrument.md)
"""

from .base import NEEDS, Derived, Instrument, Ratio, Readings, check_needs, div
from .builtin import (
    Attribution,
    DivergentDrift,
    Drift,
    Fisher,
    Flips,
    Modulation,
    Residual,
    SameBatch,
    Tax,
    residual_sums,
)
from .reduce import Reduction, reduce_readings
from .registry import PRESETS, available, register, resolve
from .schedule import Schedule
from .set import InstrumentSet

__all__ = [
    "NEEDS", "PRESETS", "Reduction", "Attribution", "Derived", "DivergentDrift", "Drift", "Fisher", "Flips", "Instrument",
    "InstrumentSet", "Modulation", "Ratio", "Readings", "Residual", "SameBatch", "Schedule", "Tax",
    "available", "check_needs", "div", "reduce_readings", "register", "resolve", "residual_sums",
]
