"""Measure the effective token modulation W = −∂loss/∂l on a real backward pass (docs/concepts/modulation.md).

A backward hook on the (B, T) per-token log-prob tensor receives ∂loss/∂l, whatever the loss
is (a built-in objective, a trainer's, a hand-written one). Negated, that is W:

    with ModulationProbe() as probe:
        logps = probe.watch(token_logps(model, ...))   # (B, T), carries the graph
        loss = my_loss(logps, ...)
        loss.backward()
    probe.W                                          # (B, T), detached, on the device
    probe.deviation(objectives.get("gspo"), batch)   # max |W − closed form|, 0-dim tensor

The hook stores a device tensor and does nothing else: no `.item()`, no host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from ..core.batch import TokenBatch

if TYPE_CHECKING:
    from typing_extensions import Self


def check_logps(logps: Tensor, who: str) -> None:
    """Raise ValueError unless logps is a (B, T) tensor that carries a graph."""
    if not isinstance(logps, Tensor) or logps.dim() != 2:
        shape = tuple(logps.shape) if isinstance(logps, Tensor) else type(logps).__name__
        raise ValueError(f"{who}: expected the (B, T) per-token log-prob tensor, got {shape}")
    if not logps.requires_grad:
        raise ValueError(f"{who}: logps does not require grad (computed under no_grad?)")


class ModulationProbe:
    """Context manager that records W = −∂loss/∂logps for each watched log-prob tensor.

    enabled=False makes `watch` a no-op (W stays None): switch it with `Schedule.active(step)`.
    Only the *first* backward pass through a watched tensor is recorded; later passes through
    the same graph (e.g. `learning_tax`'s extra pass with retain_graph) are ignored, so W is the
    gradient of the training loss. Hooks are removed on exit, exceptions included.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        self.records: list[Tensor | None] = []  # one W per watch() call, in order
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False  # never swallow an exception

    def close(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def watch(self, logps: Tensor) -> Tensor:
        """Register the hook on logps (B, T) and return logps itself (use it in the loss)."""
        if not self.enabled:
            return logps
        check_logps(logps, "ModulationProbe.watch")
        k = len(self.records)
        self.records.append(None)

        def hook(grad: Tensor) -> None:
            if self.records[k] is None:  # first backward only; a Python check, no sync
                self.records[k] = -grad.detach()

        self._handles.append(logps.register_hook(hook))
        return logps

    @property
    def W(self) -> Tensor | None:
        """(B, T) measured modulation of the last watched tensor (None before its backward).

        Units: per unit of log-prob, in the loss's scale; dtype and device of the log-probs.
        """
        return self.records[-1] if self.records else None

    def deviation(self, objective, batch: TokenBatch) -> Tensor:
        """0-dim tensor max |W_measured − objective.modulation(batch)| (no host sync)."""
        if self.W is None:
            raise RuntimeError("ModulationProbe.deviation: no W recorded (no backward yet?)")
        W_closed = objective.modulation(batch)
        if W_closed.shape != self.W.shape:
            raise ValueError(
                f"ModulationProbe.deviation: measured W is {tuple(self.W.shape)}, "
                f"closed form is {tuple(W_closed.shape)}"
            )
        return (self.W - W_closed.to(self.W.dtype)).abs().amax()
