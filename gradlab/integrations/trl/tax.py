"""The learning tax ‖g_tax‖/‖g‖ inside TRL: a sampled probe of `GradlabGRPOTrainer`.

`GradlabConfig(tax_every=k)` measures it on every k-th optimizer step (`state.global_step % k
== 0`) of a measured window, with the same code as gradlab's own loop
(`gradlab.probes.tax`, docs/concepts/tax.md):

- after each loss call's backward, W of that call (the hook's, `_gl_harvest`) gives the residual
  d_n at the full-group prefix nodes of the call's rows (`residual_grad_outputs`);
- g_tax = −Σ_n d_n ∇θ l_{rep(n)} comes from one extra forward + backward over the nodes'
  representative rows only, truncated after the last node position (`tax_grads`, as the loop's
  `tax_step`): TRL's own `_get_per_token_logps_and_entropies` makes those log-probs, at TRL's
  temperature, so ∇l is the loss's own;
- with gradient accumulation, the calls' g_tax parts add up, and on the call that completes the
  optimizer step `tax_report` compares their sum with the accumulated `.grad` (before TRL clips
  it): tax_share, tax_cos, the norms and tax_share/<layer group> (`layer_groups`).

Nodes are those of each loss call's rows: with TRL's row shuffle (steps_per_generation > 1) a
group may be split over optimizer steps, and a node is then a token shared by the group's rows
inside that step (what that step's gradient can cancel). Undefined figures are NaN (no
full-group token: g_tax = 0, tax_cos undefined; g = 0: tax_share undefined).

Cost: one forward + backward over ≤ B/G rows × the longest shared prefix, per taxed loss call
(measured in `time_tax`, seconds per optimizer step). One process only: refused under torchrun.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ...core.batch import TokenBatch
from ...core.nodes import shared_nodes
from ...instruments import Tax, reduce_readings
from ...probes.tax import layer_groups, residual_grad_outputs, tax_grads, tax_report

FIGURES = ("tax_share", "tax_cos", "tax_norm", "total_norm")


class TRLTaxProbe:
    """Learning tax of a TRL trainer's optimizer steps (module docstring).

    every: optimizer steps between two taxed ones (0 = off). After training, `steps` holds one
    dict per taxed optimizer step: global_step, n_nodes, tax_share, tax_cos, tax_norm,
    total_norm, tax_share/<group>, time_tax (seconds of the probe's extra pass).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.steps: list[dict] = []
        self._pending: list[dict] = []  # taxed steps of the current window
        self._g: dict[str, Tensor] | None = None  # g_tax parts of the current optimizer step
        self._nodes, self._time = 0, 0.0

    def due(self, trainer, part: dict) -> bool:
        return bool(self.every) and part.get("measure", False) and \
            trainer.state.global_step % self.every == 0

    def after_backward(self, trainer, part: dict) -> None:
        """Called after the loss call of `part` (its W harvested): add this call's g_tax; on the
        call that completes the optimizer step, report against the accumulated gradient."""
        if not self.due(trainer, part):
            return
        t0 = time.perf_counter()
        model = trainer.model
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        g, nodes = call_tax(trainer, part, params)
        self._g = g if self._g is None else {n: self._g[n] + g[n] for n in g}
        self._nodes += nodes
        if trainer.accelerator.sync_gradients:  # the optimizer step's last loss call
            rep = tax_report(self._g, params, None, layer_groups(model))
            self._time += time.perf_counter() - t0
            self._finish(trainer.state.global_step, rep)
        else:
            self._time += time.perf_counter() - t0

    def _finish(self, step: int, rep: dict) -> None:
        row = {"global_step": step, "n_nodes": self._nodes}
        row.update({k: float(rep[k]) for k in FIGURES})
        row.update({f"tax_share/{grp}": float(v["tax_share"]) for grp, v in rep["groups"].items()})
        row["time_tax"] = self._time
        self.steps.append(row)
        r = Tax.readings(rep)  # the loop's tax instrument: how a step's figures reduce
        r.mean("n_nodes", float(self._nodes))
        r.mean("time_tax", self._time)
        self._pending.append(r)
        self._g, self._nodes, self._time = None, 0, 0.0

    def drain(self) -> dict[str, float]:
        """The window's figures from its taxed steps (empty when none), reduced as the loop's
        `tax` instrument does: each share averaged over the steps where it is defined (NaN
        when none is), the norms over every step; tax_steps their count."""
        parts, self._pending = self._pending, []
        if not parts:
            return {}
        return {"tax_steps": float(len(parts)), **reduce_readings(parts)}


def call_batch(trainer, part: dict) -> TokenBatch:
    """TokenBatch (b, T) of one loss call's rows from the generation batch: tokens, sampled mask,
    its log-probs (old = TRL's old log-probs, else the same), advantages, groups relabelled
    0..k−1 (a group of the call may hold fewer than G rows)."""
    gen, rows = trainer._gl_gen, part["row"]
    lp = part["logps"]
    old = part["old"] if part.get("old") is not None else lp
    group = torch.unique(gen["group"][rows], return_inverse=True)[1]
    return TokenBatch(tokens=gen["tokens"][rows], mask=gen["mask"][rows], logps=lp,
                      old_logps=old, advantages=gen["advantages"][rows].to(lp.dtype),
                      group=group, validate=False)


def call_tax(trainer, part: dict, params: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
    """({name: g_tax part} of one loss call (loss-gradient sign, float32), its number of
    full-group nodes); zeros without a node. W: the call's measured W (`part["W"]`, already
    divided by the process count)."""
    batch = call_batch(trainer, part)
    sn = shared_nodes(batch, "prefix")
    if sn.n == 0:
        return {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}, 0
    gen, rows = trainer._gl_gen, part["row"]
    reps = torch.unique(sn.rep)  # local indices into the call's rows
    t_max = int(sn.position.max()) + 1
    D = residual_grad_outputs(part["W"], batch, sn)[reps, :t_max]
    r = rows[reps]
    ids = torch.cat([gen["prompt_ids"][r], gen["tokens"][r, :t_max]], dim=1)
    # attention over every sampled token: a representative may be a row TRL's loss drops
    attn = torch.cat([gen["prompt_mask"][r], gen["mask"][r, :t_max].long()], dim=1)
    lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, t_max)[0]
    return {n: v.float() for n, v in tax_grads(lp, D, params).items()}, sn.n


def check_tax(trainer) -> None:
    """Refuse what the probe cannot measure: several processes (g_tax is per process)."""
    if trainer.gradlab.tax_every and trainer.accelerator.num_processes > 1:
        raise ValueError(f"GradlabConfig: tax_every={trainer.gradlab.tax_every} with "
                         f"{trainer.accelerator.num_processes} processes; the TRL tax probe runs "
                         "in one process (set tax_every=0)")
