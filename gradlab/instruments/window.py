"""Instruments on a window of loss calls (TRL's generation batch, verl's mini-batch): the
integrations gather a window's W and batch over its loss calls and processes, then run the
same instrument objects as gradlab's loop once on the whole window."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..core.batch import TokenBatch
from ..core.nodes import shared_nodes
from .base import Instrument, reduce_readings

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
    """Run `instruments` once on a whole window and finalize their numbers: {metric: float}
    (`reduce_readings` of the one step). n_tokens (the window's response tokens) is there for
    ratios per token."""
    parts = [inst.measure(view) for inst in instruments]
    quantities = [q for inst in instruments for q in inst.quantities()]
    return reduce_readings(parts, quantities, {"n_tokens": float(view.batch.mask.sum())})
