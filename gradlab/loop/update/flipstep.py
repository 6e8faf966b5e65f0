"""The token-flip ledger in the loop (docs/concepts/token-flips.md): on heavy steps of a run
with `flips` on, Δ log π of every sampled token across the optimizer step, binned by advantage
sign × node kind × confidence (`gradlab.probes.flips`), added to the step's metrics as sums."""

from __future__ import annotations

import torch

from ...core.batch import TokenBatch
from ...core.nodes import shared_nodes
from ...probes.flips import flip_ledger
from ..config import RunConfig
from ..numerics.logprobs import token_logps
from ..numerics.precision import amp_context
from ..rollouts.rollout import Rollout
from ..scale.dist import unwrap
from .metrics import StepMetrics


@torch.no_grad()
def sampled_logps(model, cfg: RunConfig, ro: Rollout, rows: torch.Tensor,
                  like: torch.Tensor) -> torch.Tensor:
    """(B, T) log π of the step's own sampled tokens (rollout rows `rows`, B = rows.numel())
    under `model` as it is now (nats, at the run's temperature), in the shape and dtype of
    `like`; forwards in chunks of `micro_batch` rows (the whole step when unset)."""
    after = torch.zeros_like(like)
    size = cfg.micro_batch or max(rows.numel(), 1)
    for c in range(0, rows.numel(), size):
        r = rows[c: c + size]
        with amp_context(cfg):
            after[c: c + size] = token_logps(model, ro.prompt_ids[r], ro.prompt_mask[r],
                                             ro.response_ids[r], ro.response_mask[r],
                                             cfg.temperature).to(after.dtype)
    return after


def flip_step(L, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, batch: TokenBatch,
              after: torch.Tensor | None, acc: StepMetrics) -> None:
    """Add the ledger of the optimizer step just taken to `acc` (sums: steps and ranks add).

    batch: the step's TokenBatch with the advantages it trained (`objective.prepare`: token
    advantages for IBPO) and its own log-probs before the step (`batch.logps`, (B, T));
    after (B, T): the same tokens' log-probs after the step when the drift probe already
    computed them, else None (then one no-grad forward here, `sampled_logps`). Node kinds are
    those of the step's rows (`shared_nodes(batch, "trie")`): with groups split over steps a
    "group" node spans the rows of its group that this step holds.
    """
    if after is None:
        after = sampled_logps(unwrap(L.model), cfg, ro, rows, batch.logps)
    ledger = flip_ledger(batch.logps, after, batch, nodes=shared_nodes(batch, "trie"))
    for k, v in ledger.items():
        acc.sums[k].append(v)
