"""The one reduction of instrument readings: optimizer steps and data-parallel ranks → metrics.

Every host reduces the same way. Over the optimizer steps of one rollout step (a TRL window, a
verl mini-batch) `Reduction` keeps sums, maxima and per-step means on the device; `finish` syncs
once with the host, combines the ranks (`gather`: sums add, maxima max, means pool over the
steps where they are defined), then applies the declared rules (`Ratio`, `Derived`: NaN where a
denominator is 0, never 0). gradlab's loop builds its step metrics on it
(`gradlab.loop.update.metrics.StepMetrics`); TRL and verl call `reduce_readings`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .base import Readings


class Reduction:
    """Sums, maxima and per-step means of one rollout step, reduced in `finish`.

    `summed_means`: per-step scalars whose ranks' means add instead of pooling (the loop's loss:
    each rank's part of a global minibatch loss is a share of it)."""

    def __init__(self, summed_means: Iterable[str] = ()) -> None:
        self.sums: dict[str, list] = defaultdict(list)  # summed at finish
        self.means: dict[str, list] = defaultdict(list)  # averaged at finish
        # means over the steps where the value is defined: name → flags beside `means`
        self.defined: dict[str, list] = defaultdict(list)
        self.maxes: dict[str, list] = defaultdict(list)
        self.summed_means = frozenset(summed_means)

    def add_scalar(self, name: str, v, defined=None) -> None:
        """A per-step value, averaged over the optimizer steps in `finish`.

        defined: a 0-dim bool (tensor) when v can be undefined (a share whose denominator is
        0): the mean then runs over the steps where it is defined only, and is NaN when none
        is. A NaN of a non-finite input keeps defined=True, so it stays NaN in the mean."""
        v = v.detach() if torch.is_tensor(v) else v
        if defined is not None:
            d = torch.as_tensor(defined)
            v = torch.where(d, torch.as_tensor(v), 0)  # an undefined step adds nothing
            self.defined[name].append(d)
        self.means[name].append(v)

    def record(self, r: Readings) -> None:
        """An instrument's `Readings` of one optimizer step: sums add, maxima max, means are
        averaged over the steps where they are defined (`add_scalar`)."""
        for k, v in r.sums.items():
            self.sums[k].append(v)
        for k, v in r.maxes.items():
            self.maxes[k].append(v)
        for k, (v, defined) in r.means.items():
            self.add_scalar(k, v, defined)

    def local(self) -> tuple[dict, dict, dict]:
        """This process's (sums, {name: (Σ value, steps defined)}, maxima) as floats: one sync."""
        def f64(v):
            return torch.stack([torch.as_tensor(x, dtype=torch.float64).cpu() for x in v])

        sums = {k: f64(v).sum() for k, v in self.sums.items()}
        means = {k: torch.stack([f64(v).sum(), f64(self.defined[k]).sum() if k in self.defined
                                 else torch.tensor(float(len(v)))])
                 for k, v in self.means.items()}
        maxes = {k: f64(v).max() for k, v in self.maxes.items()}
        flat = torch.stack(list(sums.values()) + [x for v in means.values() for x in v] +
                           list(maxes.values())).tolist() if (sums or means or maxes) else []
        it = iter(flat)
        return ({k: next(it) for k in sums}, {k: (next(it), next(it)) for k in means},
                {k: next(it) for k in maxes})

    def finish(self, quantities: list | None = None,
               gather: Callable[[tuple], list[tuple]] = lambda x: [x]) -> dict[str, float]:
        """The metrics: every rank's `local` numbers (`gather`), combined — sums add, maxima
        max, means pool over all ranks' steps where defined (NaN where none is) — then the
        declared `quantities` (their ratios NaN where the denominator is 0)."""
        out: dict = {}
        parts = gather(self.local())
        for s_, _, _ in parts:
            for k, v in s_.items():
                out[k] = out.get(k, 0.0) + v
        pooled: dict = {}
        for _, m_, _ in parts:
            for k, (tot, n) in m_.items():
                add = k in self.summed_means
                a, b = pooled.get(k, (0.0, 0.0))
                pooled[k] = (a + (tot / n if add else tot), b + (1 if add else n))
        # b = 0: no step where the value is defined (`add_scalar`), so the mean is undefined
        out.update({k: (a if k in self.summed_means else a / b if b else math.nan)
                    for k, (a, b) in pooled.items()})
        for _, _, x_ in parts:
            for k, v in x_.items():
                old = out.get(k, -float("inf"))
                out[k] = math.nan if math.isnan(old) or math.isnan(v) else max(old, v)
        return finalize(out, quantities or [])


def finalize(totals: dict, quantities: list) -> dict[str, float]:
    """The reported metrics of reduced sums: the sums themselves, plus every declared rule's
    metric. Each ratio is NaN where its denominator is 0; the rule says when."""
    out = dict(totals)
    for q in quantities:
        q.apply(totals, out)
    return out


def reduce_readings(parts: list[Readings], quantities: list | None = None,
                    extra: dict[str, float | Tensor] | None = None) -> dict[str, float]:
    """One process's reduction of several optimizer steps' `Readings` into metrics (floats,
    float64), by `Reduction`: `extra` are totals the ratios may divide by (e.g. n_tokens)."""
    red = Reduction()
    for k, v in (extra or {}).items():
        red.sums[k].append(v)
    for r in parts:
        red.record(r)
    return red.finish(quantities)
