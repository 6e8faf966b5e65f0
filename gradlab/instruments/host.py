"""What a host hands its instruments for one optimizer step: the one view every host fills.

A host (gradlab's loop, TRL's trainer, verl's actor) gives primitives; the instruments measure.
`HostView` holds them: the step's measured W (B, T), its batch, entropy, the objective's closed
form, the `Policy` forwards before and after the optimizer step, and the step's accumulated
gradient. What a host leaves out (None) is a need it does not give: `offered()` says which,
and `InstrumentSet.check` refuses, in one line, an instrument that needs it. The methods below
are the update-phase measurements, written once for every host (`gradlab.instruments.forwards`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.batch import TokenBatch
from ..core.nodes import PrefixGrid, prefix_grid, shared_nodes
from .forwards import (
    NodesBefore,
    Policy,
    fisher_at_nodes,
    node_logprobs,
    node_moves,
    sampled_logps,
    tax_step,
)

# the hosts gradlab runs in, and the needs (`NEEDS`) each gives
HOSTS: dict[str, frozenset[str]] = {
    "loop": frozenset({"W", "batch", "objective", "entropy", "model", "grads", "others"}),
    "trl": frozenset({"W", "batch", "objective", "entropy", "model", "grads"}),
    "verl": frozenset({"W", "batch", "objective"}),
}
# why a host cannot give a need (what `gradlab instruments` prints beside a missing host)
MISSING = {
    ("verl", "model"): "verl's policy loss sees log-probs, not the model",
    ("verl", "grads"): "verl's policy loss runs before the backward",
    ("verl", "entropy"): "verl's policy loss receives no entropy",
    ("trl", "others"): "one objective per trainer: no tandem to compare on the same batch",
    ("verl", "others"): "one objective per trainer: no tandem to compare on the same batch",
}


def hosts(needs: frozenset[str] | set[str]) -> tuple[list[str], dict[str, str]]:
    """(the hosts that give every need in `needs`, {other host: why not})."""
    ok, why = [], {}
    for host, gives in HOSTS.items():
        missing = sorted(set(needs) - gives)
        if missing:
            why[host] = "; ".join(MISSING.get((host, m), f"no {m}") for m in missing)
        else:
            ok.append(host)
    return ok, why


@dataclass
class HostView:
    """One optimizer step as the instruments see it (shapes (B, T) over the step's rows).

    batch: the step's TokenBatch (None on a data-parallel rank with no rows: `idle`);
    W: the measured modulation −∂loss/∂log π the backward used; entropy (nats) or None;
    objective: the loss's closed form (`modulation`, `prepare`, mechanisms) or None;
    policy: forwards of the policy (None: the host gives no model); grads: what the tax reads
    the step's accumulated gradient from (a module whose parameters hold `.grad`);
    reduce_tax: sums a g_tax report over data-parallel ranks (None: one process)."""

    batch: TokenBatch | None = None
    W: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    objective: object = None
    policy: Policy | None = None
    grads: object = None
    reduce_tax: Callable[[dict, object], dict] | None = None
    trained_batch: TokenBatch | None = None  # set: the batch W was built from (skip prepare)
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
        IBPO; the batch itself without an objective), computed once per step."""
        if self.trained_batch is None and self.batch is not None:
            prepare = getattr(self.objective, "prepare", None)
            self.trained_batch = prepare(self.batch) if prepare else self.batch
        return self.trained_batch

    def grid(self) -> PrefixGrid | None:
        """The rows' pairwise prefix structure (`prefix_grid`), once per step (None idle): the
        nodes and a host's branch-token sums share it."""
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
        if self.idle:  # joins the ranks' g_tax sum with zeros: full shapes, float32
            dev = next(self.policy.model.parameters()).device
            tax = {"g_tax": {n: torch.zeros(p.shape, dtype=torch.float32, device=dev)
                             for n, p in self.policy.model.named_parameters()}}
        else:
            tax = tax_step(self.policy, self.trained, self.W, self.nodes()["prefix"])
        return self.reduce_tax(tax, self.grads) if self.reduce_tax is not None else tax

    def keep_node_logprobs(self) -> None:
        """Before the optimizer step: π_before at the full-group nodes (none: nothing kept)."""
        sn = self.nodes().get("prefix")
        if sn is not None and sn.n:
            self._before = node_logprobs(self.policy, sn)

    def node_drift(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After the step: ((N,) Δ log π, (K,) KL) at the nodes kept before, or None."""
        if self._before is None:
            return None
        return node_moves(self.policy, self.nodes()["prefix"], self._before)

    def keep_params(self) -> None:
        """Before the optimizer step: a copy of θ (one model's parameters), for the Fisher."""
        if not self.idle:
            self._theta = {n: p.detach().clone() for n, p in self.policy.model.named_parameters()}

    def fisher(self, cap: int) -> dict[str, torch.Tensor] | None:
        """After the step: (K,) KL and ½ δᵀFδ at ≤ cap full-group nodes (float64), or None."""
        sn = self.nodes().get("prefix")
        if self._theta is None or sn is None or sn.n == 0:
            return None
        return fisher_at_nodes(self.policy, sn, self._theta, cap)

    def sampled_after(self) -> torch.Tensor | None:
        """After the step: (B, T) log π of the step's sampled tokens (one forward, shared by
        every instrument that asks), or None on an idle rank."""
        if self._after is None and not self.idle:
            self._after = sampled_logps(self.policy, self.trained.logps)
        return self._after
