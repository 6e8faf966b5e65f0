"""What the loop hands its instruments for one optimizer step (`gradlab.instruments`).

A `StepView` gives every need of `gradlab.instruments.NEEDS`: the step's measured W, its batch
(and the advantages W was built from, `trained`), entropy, the objective, the other objectives of
same-batch mode, the step's shared-token nodes (computed once, shared by every instrument), and
the forwards an "update"-phase instrument asks for (`gradlab.loop.update.forwards`). On a rank
with no rows in the step (`idle`), the same calls return nothing to measure but still join the
ranks' collectives (the learning tax's sum), so an idle rank runs the same instruments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.batch import TokenBatch
from ...core.nodes import PrefixGrid, prefix_grid, shared_nodes
from ...instruments import (
    Attribution,
    DivergentDrift,
    Drift,
    Flips,
    InstrumentSet,
    Modulation,
    Residual,
    SameBatch,
    Schedule,
    Tax,
    resolve,
)
from ...probes.tax import reduce_tax
from ..config import RunConfig
from ..rollouts.rollout import Rollout
from ..scale.dist import Dist, unwrap
from .forwards import (
    NodesBefore,
    fisher_at_nodes,
    node_logprobs,
    node_moves,
    sampled_logps,
    tax_step,
)

OFFERED = frozenset({"W", "batch", "objective", "entropy", "model", "grads"})


@dataclass
class StepView:
    """One optimizer step as the instruments see it. batch (B, T) is None on an idle rank;
    W (B, T) the measured modulation (None when not measured), entropy (B, T) nats.
    model: the learner's model (wrapped under DDP/FSDP); grads: what the tax reads the step's
    gradient from (the model, or FSDP's gathered gradients)."""

    model: torch.nn.Module
    cfg: RunConfig
    rollout: Rollout
    rows: torch.Tensor  # (B,) rollout rows of the step
    dist: Dist
    batch: TokenBatch | None = None
    W: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    objective: object = None
    grads: object = None
    trained_batch: TokenBatch | None = None  # set: skip objective.prepare (tests)
    _nodes: dict | None = None
    _grid: PrefixGrid | None = None
    _before: NodesBefore | None = None
    _after: torch.Tensor | None = None
    _theta: dict | None = None

    @property
    def idle(self) -> bool:
        return self.batch is None

    @property
    def trained(self) -> TokenBatch | None:
        """The batch with the advantages W is built from (`objective.prepare`: per token for
        IBPO), computed once per step."""
        if self.trained_batch is None and self.batch is not None:
            self.trained_batch = self.objective.prepare(self.batch)
        return self.trained_batch

    def grid(self) -> PrefixGrid | None:
        """The rows' pairwise prefix structure (`prefix_grid`), once per step (None idle)."""
        if self._grid is None and self.batch is not None:
            b = self.batch
            self._grid = prefix_grid(b.tokens, b.mask, b.group)
        return self._grid

    def nodes(self) -> dict:
        """{"prefix": full-group nodes, "trie": every trie node} of the step's rows ({} idle)."""
        if self._nodes is None:
            trie = shared_nodes(self.batch, "trie", self.grid()) if self.batch is not None else None
            self._nodes = {} if trie is None else {"prefix": trie.full_group(), "trie": trie}
        return self._nodes

    # ---------------------------------------------------------------- forwards ("model")
    def learning_tax(self) -> dict:
        """This step's g_tax report (`gradlab.probes.tax.tax_report`), summed over ranks."""
        raw = unwrap(self.model)
        if self.idle:  # joins the ranks' g_tax sum with zeros: full shapes, float32 like
            dev = self.rollout.group.device  # `tax_step`'s (FSDP --amp gathers bf16 weights)
            tax = {"g_tax": {n: torch.zeros(p.shape, dtype=torch.float32, device=dev)
                             for n, p in raw.named_parameters()}}
        else:
            tax = tax_step(raw, self.cfg, self.rollout, self.rows, self.trained, self.W,
                           self.nodes()["prefix"])
        return reduce_tax(tax, self.grads, self.dist) if self.dist.enabled else tax

    def keep_node_logprobs(self) -> None:
        """Before the optimizer step: π_before at the full-group nodes (none: nothing kept)."""
        sn = self.nodes().get("prefix")
        if sn is not None and sn.n:
            self._before = node_logprobs(unwrap(self.model), self.cfg, self.rollout, self.rows, sn)

    def node_drift(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After the step: ((N,) Δ log π, (K,) KL) at the nodes kept before, or None."""
        if self._before is None:
            return None
        return node_moves(unwrap(self.model), self.cfg, self.rollout, self.rows,
                          self.nodes()["prefix"], self._before)

    def keep_params(self) -> None:
        """Before the optimizer step: a copy of θ (one model's parameters), for the Fisher."""
        if not self.idle:
            self._theta = {n: p.detach().clone() for n, p in unwrap(self.model).named_parameters()}

    def fisher(self, cap: int) -> dict[str, torch.Tensor] | None:
        """After the step: (K,) KL and ½ δᵀFδ at ≤ cap full-group nodes (float64), or None."""
        sn = self.nodes().get("prefix")
        if self._theta is None or sn is None or sn.n == 0:
            return None
        return fisher_at_nodes(unwrap(self.model), self.cfg, self.rollout, self.rows, sn,
                               self._theta, cap)

    def sampled_after(self) -> torch.Tensor | None:
        """After the step: (B, T) log π of the step's sampled tokens (one forward, shared by
        every instrument that asks), or None on an idle rank."""
        if self._after is None and not self.idle:
            self._after = sampled_logps(unwrap(self.model), self.cfg, self.rollout, self.rows,
                                        self.trained.logps)
        return self._after




def loop_instruments(cfg: RunConfig, others: list | tuple = ()) -> InstrumentSet:
    """The instruments a run measures: `cfg.instruments` when set (a spec,
    `gradlab.instruments.resolve`, the presets' sparse ones every `tax_every` steps), else
    what the flags say — with probes: W's deviation and ρ every step (+ the other objectives'
    ρ in same-batch mode), attribution and the learning tax every `tax_every` steps, drift at
    the nodes every step and at divergent tokens every `tax_every` steps (`drift`); the
    token-flip ledger every `tax_every` steps (`flips`)."""
    if cfg.instruments:
        chosen = resolve(cfg.instruments, heavy_every=cfg.tax_every)
        if others and not any(i.name == "same_batch" for i in chosen):
            chosen.append(SameBatch())
    else:
        every, heavy = Schedule(), Schedule(every=cfg.tax_every)
        chosen = [Modulation(every), Residual(every)] if cfg.probes else []
        if cfg.probes and others:
            chosen.append(SameBatch(every))
        if cfg.probes:
            chosen += [Attribution(heavy), Tax(heavy)]
        if cfg.probes and cfg.drift:
            chosen += [Drift(every), DivergentDrift(heavy)]
        if cfg.flips:
            chosen.append(Flips(heavy))
    for inst in chosen:  # the other objectives' pairs (same-batch mode), for any spec
        if isinstance(inst, SameBatch):
            inst.others = list(others)
    out = InstrumentSet(chosen)
    out.check(set(OFFERED), "gradlab's loop")
    if cfg.fsdp and out.get("fisher") is not None:
        raise ValueError("instrument 'fisher' copies the whole model: one process or DDP, not --fsdp")
    return out
