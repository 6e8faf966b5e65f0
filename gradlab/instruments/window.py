"""Instruments on a window of loss calls (TRL's generation batch, verl's mini-batch): the
integrations gather a window's W and batch over its loss calls and processes, then run the
same instrument objects as gradlab's loop once on the whole window."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.nodes import shared_nodes
from .base import Instrument

OFFERED = frozenset({"W", "batch"})  # a window holds no model forwards of its own


@dataclass
class WindowView:
    """batch (B, T) and the measured W (B, T) of one window; `trained` is the batch itself (its
    advantages are the ones the loss used); nodes computed once, shared by every instrument."""

    batch: TokenBatch
    W: Tensor
    _nodes: dict | None = None

    @property
    def trained(self) -> TokenBatch:
        return self.batch

    def nodes(self) -> dict:
        if self._nodes is None:
            trie = shared_nodes(self.batch, "trie")
            self._nodes = {"prefix": trie.full_group(), "trie": trie}
        return self._nodes


def measure_window(instruments: list[Instrument], view: WindowView) -> dict[str, float]:
    """Run `instruments` once on a whole window and finalize their numbers: {metric: float}.
    Sums and maxima are the window's own; a mean is the value, NaN where undefined; each
    instrument's ratios (`quantities`) are NaN where their denominator is 0. n_tokens (the
    window's response tokens) is there for ratios per token."""
    from .base import Readings

    r = Readings()
    for inst in instruments:
        r.update(inst.measure(view))
    totals = {k: _float(v) for k, v in {**r.sums, **r.maxes}.items()}
    for k, (v, defined) in r.means.items():
        totals[k] = _float(v) if defined is None or bool(defined) else math.nan
    totals.setdefault("n_tokens", float(view.batch.mask.sum()))
    out = dict(totals)
    for q in (q for inst in instruments for q in inst.quantities()):
        q.apply(totals, out)
    return out


def _float(v) -> float:
    return float(v.double()) if torch.is_tensor(v) else float(v)
