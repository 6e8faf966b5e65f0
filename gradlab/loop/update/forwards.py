"""The extra forwards the loop's instruments need (`gradlab.loop.update.view`): the learning
tax's forward + backward over the nodes' representative rows, the policy at full-group nodes
before and after the optimizer step, and the sampled tokens' log-probs after it. Every one runs
in chunks of `micro_batch` rows, so memory stays bounded by the micro-batch
(docs/concepts/tax.md, docs/concepts/drift.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.batch import TokenBatch
from ...core.nodes import SharedNodes
from ...probes import layer_groups
from ...probes.drift import kl_nodes, kl_rows
from ...probes.fisher import context_logprobs_fn, float64_meter, kl_and_fisher
from ...probes.tax import residual_grad_outputs, tax_grads, tax_report
from ..config import RunConfig
from ..numerics.logprobs import context_logprobs, token_logps
from ..numerics.precision import amp_context
from ..rollouts.rollout import Rollout


def _chunks(n: int, cfg: RunConfig) -> range:
    """Start offsets of row chunks for the probes' extra forwards (one chunk per micro-batch)."""
    return range(0, n, cfg.micro_batch or max(n, 1))


def tax_step(raw: torch.nn.Module, cfg: RunConfig, ro: Rollout, rows: torch.Tensor,
             batch: TokenBatch, W: torch.Tensor, sn: SharedNodes) -> dict:
    """The parameter-space learning tax g_tax at full-group nodes (docs/concepts/tax.md), from a
    forward + backward over the nodes' representative rows, truncated after the shared prefix
    (see `gradlab.probes.tax.tax_from_reps`; a test holds it to `learning_tax`), in chunks of
    `micro_batch` rows whose g_tax add up. raw: the unwrapped model (full weights)."""
    params = dict(raw.named_parameters())
    # g_tax in float32: under FSDP --amp the gathered weights are bf16 (loop/numerics/precision.py),
    # and the ranks' sum (`reduce_tax`) needs one dtype, that of an idle rank's float32 zeros
    if sn.n == 0:
        return tax_report({n: torch.zeros_like(p, dtype=torch.float32)
                           for n, p in params.items()}, params)
    reps = torch.unique(sn.rep)
    t_max = int(sn.position.max()) + 1
    residual_at = residual_grad_outputs(W, batch, sn)[:, :t_max]  # (B, t_max) d_n at (rep, t_n)
    tax = None
    for c in _chunks(reps.numel(), cfg):
        part = reps[c: c + (cfg.micro_batch or reps.numel())]
        s = ro.rows(rows[part], t=t_max)
        with amp_context(cfg):
            lp = token_logps(raw, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                             cfg.temperature)
        g = {n: v.float() for n, v in tax_grads(lp, residual_at[part], params).items()}
        tax = g if tax is None else {n: tax[n] + g[n] for n in tax}
    return tax_report(tax, params, None, layer_groups(raw))


@dataclass
class NodesBefore:
    """What the drift keeps of π_before across the optimizer step, for N full-group nodes:
    token_logp (N,) log π_before of each node's shared token; kept (K,) the nodes whose full
    distribution is kept for the KL (`gradlab.probes.drift.kl_nodes`, K ≤ KL_BUDGET // V);
    dist (K, V) log π_before(·) at those nodes (nats, at the run's temperature)."""

    token_logp: torch.Tensor
    kept: torch.Tensor
    dist: torch.Tensor

    def slot(self) -> torch.Tensor:
        """(N,) long: the row of `dist` holding node n, −1 for nodes not kept."""
        out = torch.full_like(self.token_logp, -1, dtype=torch.long)
        return out.index_put_((self.kept,), torch.arange(self.kept.numel(), device=out.device))


@torch.no_grad()
def node_logprobs(model, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, sn,
                  cap: int | None = None) -> NodesBefore:
    """π_before at the N full-group nodes of `sn`: every node's shared-token log-prob and the
    full distributions of at most `cap` of them (`kl_nodes`; default KL_BUDGET // V), from
    one representative row per group, truncated after the last shared position, in chunks of
    `micro_batch` rows (`_node_chunks`). Memory held: (N,) + (K, V), whatever the batch."""
    tok = torch.zeros(sn.n, device=sn.rep.device)
    held = None
    for idx, lp in _node_chunks(model, cfg, ro, rows, sn):
        if held is None:
            kept = kl_nodes(sn.n, lp.shape[-1], cap).to(sn.rep.device)
            held = NodesBefore(tok, kept, lp.new_empty(kept.numel(), lp.shape[-1]))
            slot = held.slot()
        tok[idx] = lp.gather(-1, sn.token[idx, None]).squeeze(-1)
        if (kept := _kept(slot, idx)) is not None:
            held.dist.index_copy_(0, kept[0], lp[kept[1]])
    return held


def _kept(slot: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | slice] | None:
    """Of a chunk's nodes `idx` (c,), those whose distribution is kept (`NodesBefore.slot`):
    (their rows in `dist`, their rows in the chunk: a slice when all are kept, so no masked
    copy of the (c, V) chunk is made), or None when none is."""
    k = slot[idx] >= 0
    if bool(k.all()):
        return slot[idx], slice(None)
    return (slot[idx[k]], k) if bool(k.any()) else None


def _held_rows(dist: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """dist[i] for (n,) row indices i: a view when i is a run i0, i0 + 1, …, else a copy."""
    i0 = int(i[0])
    if bool((i == torch.arange(i0, i0 + i.numel(), device=i.device)).all()):
        return dist[i0: i0 + i.numel()]
    return dist[i]


@torch.no_grad()
def _node_chunks(model, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, sn):
    """Yields (idx (c,) node indices, (c, V) log-probs at those nodes): one micro-batch of
    representative rows per body forward, the LM head on the nodes' hidden states only, at
    most LOGIT_BUDGET // V nodes at a time (`context_logprobs`)."""
    reps = torch.unique(sn.rep)  # (R,) local rows
    which = torch.searchsorted(reps, sn.rep)  # (N,) index into reps
    t_max = int(sn.position.max()) + 1
    size = cfg.micro_batch or reps.numel()
    for c in _chunks(reps.numel(), cfg):
        s = ro.rows(rows[reps[c: c + size]], t=t_max)
        sel = ((which >= c) & (which < c + size)).nonzero().squeeze(-1)
        it = context_logprobs(model, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                              which[sel] - c, sn.position[sel], cfg.temperature)
        while True:
            with amp_context(cfg):
                part = next(it, None)
            if part is None:
                break
            yield sel[part[0]: part[0] + part[1].shape[0]], part[1]


@torch.no_grad()
def node_moves(raw: torch.nn.Module, cfg: RunConfig, ro: Rollout, rows: torch.Tensor,
               sn: SharedNodes, before: NodesBefore) -> tuple[torch.Tensor, torch.Tensor]:
    """How the step just taken moved the policy at the N full-group nodes of `sn`: (N,) Δ log π
    of each node's shared token (after − before, nats) and (K,) KL(π_before ‖ π_after) at the
    nodes `before.kept`, from one forward over a representative row per group, truncated
    after its last shared position; π_after is reduced chunk by chunk, never held whole."""
    after, kl = torch.zeros_like(before.token_logp), before.dist.new_zeros(before.kept.numel())
    slot = before.slot()
    for idx, lp in _node_chunks(raw, cfg, ro, rows, sn):
        after[idx] = lp.gather(-1, sn.token[idx, None]).squeeze(-1)
        if (kept := _kept(slot, idx)) is not None:
            kl[kept[0]] = kl_rows(_held_rows(before.dist, kept[0]), lp[kept[1]])
    return after - before.token_logp, kl


@torch.no_grad()
def sampled_logps(model, cfg: RunConfig, ro: Rollout, rows: torch.Tensor,
                  like: torch.Tensor) -> torch.Tensor:
    """(B, T) log π of the step's own sampled tokens (rollout rows `rows`, B = rows.numel())
    under `model` as it is now (nats, at the run's temperature), in the shape and dtype of
    `like`; forwards in chunks of `micro_batch` rows (the whole step when unset)."""
    after = torch.zeros_like(like)
    size = cfg.micro_batch or max(rows.numel(), 1)
    for c in range(0, rows.numel(), size):
        s = ro.rows(rows[c: c + size])
        with amp_context(cfg):
            after[c: c + size] = token_logps(model, s.prompt_ids, s.prompt_mask, s.response_ids,
                                             s.response_mask, cfg.temperature).to(after.dtype)
    return after


def fisher_at_nodes(raw: torch.nn.Module, cfg: RunConfig, ro: Rollout, rows: torch.Tensor,
                    sn: SharedNodes, before: dict[str, torch.Tensor], cap: int
                    ) -> dict[str, torch.Tensor]:
    """Prop. 3.1 at (at most `cap`, evenly spaced: `kl_nodes`) full-group nodes of `sn`, in
    float64 (`gradlab.probes.fisher`): the measured KL(π_θ ‖ π_θ+δ) of the step δ = θ+ − θ just
    taken and ½ δᵀF(h)δ, each (K,) nats. before: θ (the parameters before the step)."""
    meter = float64_meter(raw)
    after = {n: p.detach().double() for n, p in meter.named_parameters()}
    theta = {n: before[n].double() for n in after}
    delta = {n: after[n] - theta[n] for n in after}
    kept = kl_nodes(sn.n, 1, cap).to(sn.rep.device)  # (K,) node indices
    reps = torch.unique(sn.rep[kept])
    t_max = int(sn.position[kept].max()) + 1
    s = ro.rows(rows[reps], t=t_max)
    f = context_logprobs_fn(meter, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                            torch.searchsorted(reps, sn.rep[kept]),
                            sn.position[kept], cfg.temperature)
    res = kl_and_fisher(f, theta, after, {"delta": delta})
    return {"kl": res["kl"], "half_fisher": res["half_delta"]}
