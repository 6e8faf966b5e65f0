"""A user's own loss as an objective of the loop: ``--objectives my_losses.py:dr_grpo,grpo``.

The function takes a `TokenBatch` and returns a scalar tensor differentiable in `batch.logps`
(the contract: docs/guides/loss-contract.md). It has no closed form unless it carries one,
``fn.modulation = lambda batch: W`` ((B, T), = −∂loss/∂logps); without it W is what autograd
gives on the batch (`modulation`), and the loop measures W with the same backward hook on the
(B, T) log-probs as for a built-in objective. ρ, the learning tax, drift and traces read that
W. Mechanism attribution switches the coupling, length and clip terms of a known formula off
one at a time: a user loss has no such switches, so its attribution is undefined
(`mechanisms = ()`), and so is its clip fraction (only `ratio_mean` is reported).

A loss that raises, returns something other than a finite floating-point scalar, or a value
that does not depend on `batch.logps` raises `UserLossError` naming the function (exit code 3
in the CLI; the loop adds the step).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch import Tensor

from . import variants
from .batch import TokenBatch
from .losses import Objective, _f
from .userloss import UserLossError, load_loss

_LOADED: dict[tuple, object] = {}  # (spec, file mtime) → function: a spec loads once per edit


def _load(target: str):
    """The function `target` names, loaded once per version of its file (config validation,
    the learners and same-batch measurement all build the objective)."""
    path = Path(target.rsplit(":", 1)[0])
    key = (target, path.resolve(), path.stat().st_mtime_ns) if path.suffix == ".py" and \
        path.is_file() else (target,)
    if key not in _LOADED:
        _LOADED[key] = load_loss(target, "objective")
    return _LOADED[key]


def _where(fn, e: BaseException) -> str:
    """' (file.py line n)': the deepest frame of the traceback inside fn's own file."""
    home = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == home]
    return f" ({Path(frames[-1].filename).name} line {frames[-1].lineno})" if frames else ""


class UserObjective(Objective):
    """`fn(batch) → scalar` from ``path/file.py:fn`` or ``module:fn``, named `name` (default:
    the function's name; `gradlab.core.variants.label`)."""

    mechanisms: tuple = ()  # nothing to switch off: attribution is undefined

    def __init__(self, spec: str, name: str | None = None) -> None:
        super().__init__(0.0)
        self.spec = spec
        self.fn_name = spec.rsplit(":", 1)[1]
        self.name = variants.label(spec if name is None else f"{spec}[name={name}]")
        self.fn = _load(spec)
        closed = getattr(self.fn, "modulation", None)
        self.closed_form = closed if callable(closed) else None
        self._checked = False  # the closed form against the hook, once (`check_closed_form`)

    def _call(self, f, batch: TokenBatch, what: str):
        try:
            return f(batch)
        except Exception as e:
            raise UserLossError(f"{self.spec}: {what} raised {type(e).__name__}: {e}"
                                f"{_where(f, e)}") from e

    def loss(self, batch: TokenBatch) -> Tensor:
        """fn on the batch with logps and old_logps 0 outside the mask (`TokenBatch.inert`)."""
        batch = batch.inert()
        out = self._call(self.fn, batch, self.fn_name)
        if not torch.is_tensor(out) or out.dim() != 0 or not out.is_floating_point():
            what = (f"a tensor of shape {tuple(out.shape)} and dtype {out.dtype}"
                    if torch.is_tensor(out) else type(out).__name__)
            raise UserLossError(f"{self.spec}: {self.fn_name} returned {what}; expected a "
                                "floating-point scalar tensor")
        if batch.logps.requires_grad and not out.requires_grad:
            raise UserLossError(f"{self.spec}: {self.fn_name} returned a value that does not "
                                "depend on batch.logps (no gradient to train on)")
        if not bool(torch.isfinite(out.detach())):  # from finite log-probs: the loss's fault
            if bool(torch.isfinite(batch.logps.detach()[batch.mask]).all()):
                raise UserLossError(f"{self.spec}: {self.fn_name} returned {out.item()} from "
                                    "finite log-probs")
        return out

    def modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        """W (B, T) float (≥ float32), 0 outside the mask: `fn.modulation(batch)` when the
        function carries a closed form, else −∂loss/∂logps by autograd on this batch."""
        if off:
            raise ValueError(f"{self.name}: a user loss has no mechanisms to switch off "
                             f"({', '.join(off)}): its attribution is undefined")
        batch = batch.inert()
        if self.closed_form is None:
            return self.autograd_modulation(batch)
        with torch.no_grad():
            W = self._call(self.closed_form, batch, f"{self.fn_name}.modulation")
        if not torch.is_tensor(W) or tuple(W.shape) != tuple(batch.mask.shape):
            what = tuple(W.shape) if torch.is_tensor(W) else type(W).__name__
            raise UserLossError(f"{self.spec}: {self.fn_name}.modulation returned {what}; "
                                f"expected W of shape {tuple(batch.mask.shape)}")
        return _f(W.float() if not W.is_floating_point() else W) * batch.mask

    def autograd_modulation(self, batch: TokenBatch) -> Tensor:
        """−∂loss/∂logps (B, T) on `batch` by autograd (no model: the log-probs are a leaf)."""
        lp = _f(batch.logps.detach()).clone().requires_grad_(True)
        with torch.enable_grad():
            loss = self.loss(batch.replace(logps=lp, validate=False))
            (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
        return torch.zeros_like(lp) if g is None else (-g).detach() * batch.mask

    def check_closed_form(self, batch: TokenBatch, W: Tensor, rtol: float = 1e-4) -> str | None:
        """Once per run segment: `fn.modulation(batch)` against the hook-measured W (B, T).
        Returns one line naming the gap when max |gap| > rtol · max |W|, else None."""
        if self.closed_form is None or self._checked:
            return None
        self._checked = True
        gap = float((W - self.modulation(batch)).abs().max())
        scale = float(W.abs().max())
        if gap <= rtol * scale:
            return None
        return (f"{self.spec}: {self.fn_name}.modulation disagrees with the W measured on the "
                f"log-probs: max |gap| {gap:.3g} (max |W| {scale:.3g}, tolerance "
                f"{rtol:g} × max |W|); w_dev in metrics.jsonl tracks it per step")

    def stats(self, batch: TokenBatch) -> dict:
        """ratio_mean over the mask; no clip_frac (a user loss's clipping is not known)."""
        batch = batch.inert()
        m = batch.mask
        r = torch.exp(_f(batch.logps.detach()) - _f(batch.old_logps))
        return {"ratio_mean": (r * m).sum() / m.sum().clamp(min=1)}

    def __repr__(self) -> str:
        return f"UserObjective({self.spec!r}, name={self.name!r})"
