"""One objective's training state (the loop's `Learner`), in the layer of the step that uses it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core import objectives
from ..runs.traces import TraceWriter


@dataclass
class Learner:
    """One objective's training state: its own policy copy, optimizer and minibatch-order
    generator; `tokens` response tokens consumed so far; `tracer` its token traces
    (loop/runs/traces.py); `step` the rollout step in progress (named by error messages)."""

    name: str
    objective: objectives.Objective
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    gen: torch.Generator
    tokens: int = 0
    tracer: TraceWriter | None = None
    step: int = 0

    @property
    def where(self) -> str:
        """"step k, objective name": what an error message names."""
        return f"step {self.step}, objective {self.name}"
