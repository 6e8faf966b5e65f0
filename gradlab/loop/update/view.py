"""What the loop hands its instruments for one optimizer step (`gradlab.instruments.host`).

`step_view` fills the one `HostView` every host fills: the step's measured W, its batch, entropy,
the objective, and the loop's forwards as the `Policy` primitive (its own log-prob forward at the
run's temperature and precision, in chunks of `micro_batch` rows). On a rank with no rows in the
step (`idle`), the same calls return nothing to measure but still join the ranks' collectives
(the learning tax's sum), so an idle rank runs the same instruments.
"""

from __future__ import annotations

import torch

from ...core.batch import TokenBatch
from ...instruments import InstrumentSet, SameBatch, resolve
from ...instruments.forwards import Policy
from ...instruments.host import HOSTS, HostView
from ...probes.tax import reduce_tax
from ..config import RunConfig
from ..numerics.logprobs import context_logprobs, context_logprobs_fn, token_logps
from ..numerics.precision import amp_context
from ..rollouts.rollout import Rollout
from ..scale.dist import Dist, unwrap

OFFERED = HOSTS["loop"]


def loop_policy(model: torch.nn.Module, cfg: RunConfig, rollout: Rollout,
                rows: torch.Tensor) -> Policy:
    """The loop's forwards over the step's rollout rows `rows` (B,): local row i is rollout row
    rows[i]; gradlab's own log-prob forward at the run's temperature, under its precision."""

    def inputs(local: torch.Tensor, t_max: int | None):
        part = rollout.rows(rows[local], t=t_max)
        return part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask

    return Policy(model=unwrap(model), inputs=inputs, token_logps=token_logps,
                  context_logprobs=context_logprobs,
                  context_logprobs_fn=context_logprobs_fn, temperature=cfg.temperature,
                  chunk=cfg.micro_batch, autocast=lambda: amp_context(cfg))


def step_view(model: torch.nn.Module, cfg: RunConfig, rollout: Rollout, rows: torch.Tensor,
              dist: Dist, *, batch: TokenBatch | None = None, W: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None, objective: object = None,
              trained_batch: TokenBatch | None = None) -> HostView:
    """The loop's view of one optimizer step over rollout rows `rows` (B,); batch, W and
    entropy (B, T) are filled in by the step's forward/backward. model: the learner's model
    (wrapped under DDP/FSDP); the g_tax of every rank is summed when `dist` is enabled."""

    def summed(tax: dict, grads) -> dict:
        return reduce_tax(tax, grads, dist)

    return HostView(batch=batch, W=W, entropy=entropy, objective=objective,
                    policy=loop_policy(model, cfg, rollout, rows), trained_batch=trained_batch,
                    reduce_tax=summed if dist.enabled else None)


def loop_instruments(cfg: RunConfig, others: list | tuple = ()) -> InstrumentSet:
    """The instruments a run measures: the spec `cfg.instruments` (`gradlab.instruments.resolve`,
    the presets' sparse ones every `tax_every` steps), with the other objectives' ρ every step
    in same-batch mode (`others`: their (label, objective) pairs)."""
    chosen = resolve(cfg.instruments, heavy_every=cfg.tax_every)
    if others and not any(i.name == "same_batch" for i in chosen):
        chosen.append(SameBatch())
    for inst in chosen:  # the other objectives' pairs (same-batch mode), for any spec
        if isinstance(inst, SameBatch):
            inst.others = list(others)
    out = InstrumentSet(chosen)
    out.check(set(OFFERED), "gradlab's loop")
    if cfg.fsdp and out.get("fisher") is not None:
        raise ValueError("instrument 'fisher' copies the whole model: one process or DDP, not --fsdp")
    return out
