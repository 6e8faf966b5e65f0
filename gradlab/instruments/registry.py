"""The instruments by name, cost presets, and the spec string of `--instruments`.

    available()                        {name: class} of every registered instrument
    register(MyInstrument)             add yours (a class with `name`); also a decorator
    resolve("default")                 a preset → instrument objects
    resolve("residual,tax@10,my_pkg.probes:Spread@2")

A spec is comma-separated items: a preset (`PRESETS`), a registered name, or `module:Class` /
`path/file.py:Class` (imported, then registered); `@k` runs it every k-th step (`@off`: never). Without `@`, an
instrument of a preset runs on the preset's schedule, any other every step.
"""

from __future__ import annotations

from .base import Instrument
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
)
from .schedule import Schedule

_REGISTRY: dict[str, type[Instrument]] = {}

HEAVY = 5  # the presets' schedule of the instruments that cost forwards: every 5th step

# name → ((instrument, schedule every k), …); "default" is what a run measures unless told
PRESETS: dict[str, tuple[tuple[str, int], ...]] = {
    "off": (),
    "cheap": (("modulation", 1), ("residual", 1)),
    "default": (("modulation", 1), ("residual", 1), ("attribution", HEAVY), ("tax", HEAVY),
                ("drift", 1), ("drift_divergent", HEAVY)),
    "full": (("modulation", 1), ("residual", 1), ("attribution", HEAVY), ("tax", HEAVY),
             ("drift", 1), ("drift_divergent", HEAVY), ("flips", HEAVY)),
}


def register(cls: type[Instrument]) -> type[Instrument]:
    """Register an instrument class under `cls.name` (usable as a decorator). Raises on a
    missing name, a name clash with another class, or a name that is a preset."""
    name = getattr(cls, "name", "")
    if not (isinstance(cls, type) and issubclass(cls, Instrument)):
        raise TypeError(f"register: {cls!r} is not an Instrument subclass")
    if not name or "," in name or "@" in name or ":" in name:
        raise ValueError(f"register: {cls.__name__} needs a `name` without , @ or : (got {name!r})")
    if name in PRESETS:
        raise ValueError(f"register: {name!r} is a preset name")
    old = _REGISTRY.get(name)
    if old is not None and old is not cls and old.__qualname__ != cls.__qualname__:
        raise ValueError(f"register: {name!r} is already {old.__module__}.{old.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def available() -> dict[str, type[Instrument]]:
    return dict(_REGISTRY)


for _cls in (Modulation, Residual, SameBatch, Attribution, Tax, Drift, DivergentDrift, Flips,
             Fisher):
    register(_cls)


def _lookup(name: str) -> type[Instrument]:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:  # module:Class or path/file.py:Class, imported as a user's loss is
        from ..core.userloss import load_loss

        cls = load_loss(name, "--instruments")
        if not (isinstance(cls, type) and issubclass(cls, Instrument)):
            raise ValueError(f"--instruments {name!r}: {cls!r} is not a gradlab.instruments."
                             "Instrument subclass")
        return register(cls)
    raise ValueError(f"unknown instrument {name!r}; known: {', '.join(sorted(_REGISTRY))}; "
                     f"presets: {', '.join(PRESETS)}; or module:Class")


def resolve(spec: str | list | tuple, heavy_every: int = HEAVY) -> list[Instrument]:
    """Instrument objects of a spec string (module doc) or a list of specs / instruments;
    `heavy_every` replaces the presets' every-5th schedule. Order: as written, duplicates
    (by name) keep their last schedule."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    chosen: dict[str, Instrument] = {}
    for item in items:
        if isinstance(item, Instrument):
            chosen[item.name] = item
            continue
        text = str(item).strip()
        if not text:
            continue
        name, at, when = text.partition("@")
        if name in PRESETS:
            if at:
                raise ValueError(f"instrument spec {text!r}: a preset takes no @ schedule")
            for n, every in PRESETS[name]:
                k = heavy_every if every == HEAVY else every
                chosen[n] = _lookup(n)(Schedule(every=k))
            continue
        cls = _lookup(name)
        chosen[cls.name] = cls(Schedule.parse(when) if at else Schedule())
    return list(chosen.values())
