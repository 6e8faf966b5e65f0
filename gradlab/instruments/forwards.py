"""The extra forwards of the instruments that read the policy around the optimizer step,
written once against the `Policy` a host gives (`gradlab.instruments.host`): the learning tax's
forward + backward over the nodes' representative rows, the policy at full-group nodes before
and after the step, the sampled tokens' log-probs after it, and Prop. 3.1's float64 pass.
Every one runs in chunks of `policy.chunk` rows, so memory stays bounded by the host's
micro-batch (docs/concepts/tax.md, docs/concepts/drift.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from ..core.batch import TokenBatch
from ..core.nodes import SharedNodes
from ..probes.drift import kl_nodes, kl_rows
from ..probes.fisher import float64_meter, kl_and_fisher
from ..probes.tax import layer_groups, residual_grad_outputs, tax_grads, tax_report

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Policy:
    """The forwards a host gives its instruments (need "model"): the policy over the step's rows.

    model: the unwrapped policy (full weights). inputs(rows, t_max): (prompt_ids, prompt_mask,
    response_ids, response_mask) of the step's local rows `rows` (k,), responses cut after
    `t_max` tokens (None: whole), prompts left-padded as the host's forward takes them.
    token_logps(model, *inputs, temperature) -> (k, t) log π of the sampled tokens, with
    gradient: the host's own forward, the one its loss differentiates (the learning tax's ∇l).
    context_logprobs(model, *inputs, *, row, pos, temperature) yields (start, (c, V)) next-token
    log-softmax at chosen contexts (`gradlab.loop.numerics.logprobs.context_logprobs`);
    context_logprobs_fn(model, *inputs, *, row, pos, temperature) -> f(params) -> (c, V), the same
    as a function of the parameters (Prop. 3.1's forward-mode pass).
    temperature: the loss's. chunk: rows per extra forward (None: all at once).
    autocast: the host's precision context around each forward."""

    model: torch.nn.Module
    inputs: Callable[[torch.Tensor, int | None], Inputs]
    token_logps: Callable[..., torch.Tensor]
    context_logprobs: Callable[..., Iterator[tuple[int, torch.Tensor]]]
    context_logprobs_fn: Callable[..., Callable]
    temperature: float = 1.0
    chunk: int | None = None
    autocast: Callable[[], AbstractContextManager] = field(default=nullcontext)


def _chunks(n: int, policy: Policy) -> range:
    """Start offsets of row chunks for the extra forwards (one chunk per host micro-batch)."""
    return range(0, n, policy.chunk or max(n, 1))


def tax_step(policy: Policy, batch: TokenBatch, W: torch.Tensor, sn: SharedNodes) -> dict:
    """The parameter-space learning tax g_tax at full-group nodes (docs/concepts/tax.md), from a
    forward + backward over the nodes' representative rows, truncated after the shared prefix
    (see `gradlab.probes.tax.tax_from_reps`; a test holds it to `learning_tax`), in chunks of
    `policy.chunk` rows whose g_tax add up, each through the host's own forward."""
    raw = policy.model
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
    for c in _chunks(reps.numel(), policy):
        part = reps[c: c + (policy.chunk or reps.numel())]
        with policy.autocast():
            lp = policy.token_logps(raw, *policy.inputs(part, t_max), policy.temperature)
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
def node_logprobs(policy: Policy, sn: SharedNodes, cap: int | None = None) -> NodesBefore:
    """π_before at the N full-group nodes of `sn`: every node's shared-token log-prob and the
    full distributions of at most `cap` of them (`kl_nodes`; default KL_BUDGET // V), from
    one representative row per group, truncated after the last shared position, in chunks of
    `policy.chunk` rows (`_node_chunks`). Memory held: (N,) + (K, V), whatever the batch."""
    tok = torch.zeros(sn.n, device=sn.rep.device)
    held = None
    for idx, lp in _node_chunks(policy, sn):
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
def _node_chunks(policy: Policy, sn: SharedNodes):
    """Yields (idx (c,) node indices, (c, V) log-probs at those nodes): one micro-batch of
    representative rows per body forward, the LM head on the nodes' hidden states only, at
    most LOGIT_BUDGET // V nodes at a time (`context_logprobs`)."""
    reps = torch.unique(sn.rep)  # (R,) local rows
    which = torch.searchsorted(reps, sn.rep)  # (N,) index into reps
    t_max = int(sn.position.max()) + 1
    size = policy.chunk or reps.numel()
    for c in _chunks(reps.numel(), policy):
        sel = ((which >= c) & (which < c + size)).nonzero().squeeze(-1)
        it = policy.context_logprobs(policy.model, *policy.inputs(reps[c: c + size], t_max),
                                     row=which[sel] - c, pos=sn.position[sel],
                                     temperature=policy.temperature)
        while True:
            with policy.autocast():
                part = next(it, None)
            if part is None:
                break
            yield sel[part[0]: part[0] + part[1].shape[0]], part[1]


@torch.no_grad()
def node_moves(policy: Policy, sn: SharedNodes, before: NodesBefore
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """How the step just taken moved the policy at the N full-group nodes of `sn`: (N,) Δ log π
    of each node's shared token (after − before, nats) and (K,) KL(π_before ‖ π_after) at the
    nodes `before.kept`, from one forward over a representative row per group, truncated
    after its last shared position; π_after is reduced chunk by chunk, never held whole."""
    after, kl = torch.zeros_like(before.token_logp), before.dist.new_zeros(before.kept.numel())
    slot = before.slot()
    for idx, lp in _node_chunks(policy, sn):
        after[idx] = lp.gather(-1, sn.token[idx, None]).squeeze(-1)
        if (kept := _kept(slot, idx)) is not None:
            kl[kept[0]] = kl_rows(_held_rows(before.dist, kept[0]), lp[kept[1]])
    return after - before.token_logp, kl


@torch.no_grad()
def sampled_logps(policy: Policy, like: torch.Tensor) -> torch.Tensor:
    """(B, T) log π of the step's own sampled tokens under the policy as it is now (nats, at
    the loss's temperature), in the shape and dtype of `like` (B = the step's rows); forwards
    in chunks of `policy.chunk` rows (the whole step when unset)."""
    after = torch.zeros_like(like)
    n = like.shape[0]
    size = policy.chunk or max(n, 1)
    for c in range(0, n, size):
        r = torch.arange(c, min(c + size, n), device=like.device)
        with policy.autocast():
            after[c: c + size] = policy.token_logps(policy.model, *policy.inputs(r, None),
                                                    policy.temperature).to(after.dtype)
    return after


def fisher_at_nodes(policy: Policy, sn: SharedNodes, before: dict[str, torch.Tensor], cap: int
                    ) -> dict[str, torch.Tensor]:
    """Prop. 3.1 at (at most `cap`, evenly spaced: `kl_nodes`) full-group nodes of `sn`, in
    float64 (`gradlab.probes.fisher`): the measured KL(π_θ ‖ π_θ+δ) of the step δ = θ+ − θ just
    taken and ½ δᵀF(h)δ, each (K,) nats. before: θ (the parameters before the step)."""
    meter = float64_meter(policy.model)
    after = {n: p.detach().double() for n, p in meter.named_parameters()}
    theta = {n: before[n].double() for n in after}
    delta = {n: after[n] - theta[n] for n in after}
    kept = kl_nodes(sn.n, 1, cap).to(sn.rep.device)  # (K,) node indices
    reps = torch.unique(sn.rep[kept])
    t_max = int(sn.position[kept].max()) + 1
    f = policy.context_logprobs_fn(meter, *policy.inputs(reps, t_max),
                                   row=torch.searchsorted(reps, sn.rep[kept]),
                                   pos=sn.position[kept], temperature=policy.temperature)
    res = kl_and_fisher(f, theta, after, {"delta": delta})
    return {"kl": res["kl"], "half_fisher": res["half_delta"]}
