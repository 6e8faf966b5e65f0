"""The non-finite guard: a diverged step stops the run (or is skipped), never reads as success.

Before each optimizer step `admit` checks the loss and every gradient; after it,
`check_update` checks every parameter. On a non-finite value:

  --on-nonfinite stop  (default) raise `NonFiniteError` naming the step, the objective and what
                       went bad; `gradlab` prints that one line and exits with code 3. Nothing
                       of the step is written, so the last checkpoint is the last good state.
  --on-nonfinite skip  drop the update (gradients cleared; parameters and optimizer state put
                       back when the step itself produced a non-finite parameter) and count it:
                       metric `nonfinite_steps` = skipped optimizer steps of the rollout step.

Skip mode keeps a copy of the parameters and optimizer state during each step (2-3x the model
in memory): that is what makes "skip" exact. Stop mode copies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ON_NONFINITE = ("stop", "skip")
EXIT_NONFINITE = 3  # gradlab's exit code for a diverged run


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient or parameter (exit code 3 in the CLI)."""


def _max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """max |x| over all tensors (NaN when any element is NaN), one device tensor, no sync.
    FSDP's sharded tensors: this rank's shard (the ranks' verdicts are combined by `_agree`)."""
    local = _local(tensors)
    if not local:
        return torch.zeros(())
    return torch.stack([t.detach().abs().amax().float() for t in local]).amax()


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The non-empty local parts of `tensors` (an FSDP shard's own elements)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return [t for t in local if t.numel()]


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool: every element of every tensor is finite (this rank's shards).

    One summing pass, no copy: a float32 sum is non-finite whenever an element is (±inf and
    NaN propagate, inf − inf is NaN). A finite sum can also overflow, so a non-finite sum
    is settled by the exact `_max_abs` (a host read of one bool; never on a healthy step
    whose sum stays below float32's 3.4e38).
    """
    local = _local(tensors)
    if not local:
        return torch.ones((), dtype=torch.bool)
    s = torch.stack([t.detach().sum(dtype=torch.float32) for t in local]).sum()
    ok = torch.isfinite(s)
    return ok if bool(ok) else torch.isfinite(_max_abs(local))


@dataclass
class Admitted:
    """`admit`'s verdict that the update may go ahead. snapshot: parameters and optimizer
    state to put back if the update itself makes a parameter non-finite (skip mode; None in
    stop mode). Owned by the step that holds it, never stored on the learner."""

    snapshot: tuple[list[torch.Tensor], dict] | None = None


def admit(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg, loss: torch.Tensor, acc,
          where: str) -> Admitted | None:
    """Check the loss and the gradients of `model` before `opt`'s step.

    Returns `Admitted` when the update may go ahead (then call `check_update` after
    `opt.step()`), None when it is skipped. Non-finite: raises `NonFiniteError` naming
    `where` (stop), or clears the gradients, counts the step in `acc` and returns None (skip).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    ok_loss, ok_grad = _agree(acc, torch.stack([torch.isfinite(loss.detach().float()).all(),
                                                _all_finite(grads).to(loss.device)]))
    if ok_loss and ok_grad:
        _count(acc, 0)
        return Admitted(_snapshot(opt) if cfg.on_nonfinite == "skip" else None)
    what = "loss" if not ok_loss else "gradient"
    if cfg.on_nonfinite == "stop":
        raise NonFiniteError(f"{where}: non-finite {what} (loss {float(loss.detach()):.4g}); the run "
                             "is stopped, its last checkpoint is the last good state "
                             "(lower --lr, or --on-nonfinite skip to drop such updates)")
    opt.zero_grad(set_to_none=True)
    _count(acc, 1)
    return None


def check_update(opt: torch.optim.Optimizer, cfg, admitted: Admitted, acc, where: str) -> None:
    """After `opt.step()`: every parameter finite, else stop (raise) or put back the admitted
    snapshot and count the optimizer step as skipped."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if _agree(acc, _all_finite(params).reshape(1))[0]:
        return
    if cfg.on_nonfinite == "stop":
        raise NonFiniteError(f"{where}: the update made a parameter non-finite; the run "
                             "is stopped, its last checkpoint is the last good state "
                             "(lower --lr, or --on-nonfinite skip to drop such updates)")
    _restore(opt, admitted.snapshot)
    acc.sums["nonfinite_steps"][-1] = torch.tensor(1.0 if acc.D.main else 0.0)


def _agree(acc, ok: torch.Tensor) -> list[bool]:
    """The verdicts `ok` (k,) bool as a list; under FSDP each rank checked only its own shard,
    so every rank takes the worst verdict over ranks (a collective all ranks join)."""
    D = getattr(acc, "D", None)
    if getattr(D, "fsdp", False):
        ok = D.max((~ok).float()) == 0
    return ok.tolist()


def _count(acc, n: int) -> None:
    """One optimizer step's count; rank 0 alone counts (every rank sees the same gradients)."""
    acc.sums["nonfinite_steps"].append(torch.tensor(float(n) if acc.D.main else 0.0))


def _snapshot(opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    return params, state


@torch.no_grad()
def _restore(opt: torch.optim.Optimizer, snap) -> None:
    params, state = snap
    for p, old in zip((p for g in opt.param_groups for p in g["params"]), params):
        p.copy_(old)
    for p in list(opt.state):
        if p in state:
            opt.state[p] = state[p]
        else:
            del opt.state[p]
