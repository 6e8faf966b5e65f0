"""One optimizer step of the loop, written out: log-probs → loss (hook on the (B, T) log-probs)
→ backward → probes (they return numbers) → optimizer. Also the scheduled learning tax and the
drift of the step just taken (docs/concepts/shared-nodes.md, docs/concepts/drift.md), and how a rollout batch is cut into steps.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

import torch

from ...core import objectives
from ...core.batch import TokenBatch
from ...probes import ModulationProbe, layer_groups, measure_step
from ...probes.drift import divergent_dlogp, drift_sums, kl_nodes, kl_rows
from ...probes.tax import reduce_tax, residual_grad_outputs, tax_grads, tax_report
from ..config import RunConfig
from ..faults.guard import admit
from ..numerics.logprobs import context_logprobs, token_logps
from ..numerics.precision import amp_context
from ..rollouts.layouts import batch_repair_of
from ..rollouts.rollout import Rollout
from ..runs.traces import record_trace
from ..scale.dist import Dist, unwrap
from ..scale.fsdp import FullGrads, gathered, is_sharded
from .batches import micro_batches, minibatches  # noqa: F401  (the loop imports them from here)
from .flipstep import flip_step, sampled_logps
from .metrics import StepMetrics


def optimizer_step(L, cfg: RunConfig, ro: Rollout, adv: torch.Tensor,
                   rows: torch.Tensor, acc: StepMetrics, heavy: bool,
                   others: list[tuple[str, objectives.Objective]], D: Dist) -> None:
    """One optimizer step of learner L on rows of the rollout, with the probes.

    The step's rows are cut into micro-batches of whole groups (`cfg.micro_batch`), each a
    forward/backward whose loss uses the *step's* normalisers (sequences, tokens, width), so the
    accumulated gradient is the one-pass gradient. W, log-probs and entropy are gathered into
    (B, T) tensors of the whole step; the probes then read the whole step once.
    """
    # normalisers use the global minibatch's totals (identical to the local ones in one process)
    dev = ro.group.device  # nccl reduces CUDA tensors only
    tot = D.sum(torch.tensor([rows.numel(), int(ro.response_mask[rows].sum())], device=dev))
    width = int(D.max(torch.tensor(ro.response_ids.shape[1], device=dev)))
    passes = _lockstep_passes(cfg, ro, rows, D)
    if rows.numel() == 0:  # none of this step's groups are on this rank
        return _idle_step(L, cfg, ro, acc, heavy, D, passes)
    t0 = time.perf_counter()
    batch, W, ent, loss = _accumulate(L, cfg, ro, adv, rows, (int(tot[0]), int(tot[1]), width),
                                      passes)
    if not admit(L, cfg, loss, acc):  # non-finite loss/gradient: stop or skip (loop/faults/guard.py)
        return
    if W is not None and D.main and hasattr(L.objective, "check_closed_form"):
        _say(L.objective.check_closed_form(batch, W))  # a user loss's fn.modulation, once
    acc.time("update", t0)
    t1 = time.perf_counter()
    acc.add_basic(batch, ent, loss, L.objective.stats(batch))  # stats of the whole step
    trained = L.objective.prepare(batch)  # the advantages W is built from (IBPO: per token)
    acc.add_advantages(trained)
    sn = None
    if cfg.probes:
        readings = measure_step(L.objective, batch, W, ent, heavy, others)
        acc.record(readings)
        sn = readings.prefix_nodes
    record_trace(L, ro, rows, trained, W)  # token traces (loop/runs/traces.py), on traced steps
    D.fix_grads(L.model)
    taxed, drift = cfg.probes and heavy, cfg.probes and cfg.drift
    grads = _grads_for_tax(L, taxed)
    with _local_forwards(L, taxed or drift, grad=taxed):  # FSDP: full weights, rank's own passes
        tax = tax_step(L, cfg, ro, rows, trained, W, sn) if taxed else None
        before = node_logprobs(unwrap(L.model), cfg, ro, rows, sn) if drift and sn.n else None
    if tax is not None:
        acc.add_tax(reduce_tax(tax, grads, D) if D.enabled else tax)
    acc.time("probes", t1)
    t2 = time.perf_counter()
    acc.add_scalar("grad_norm", _clip(L, cfg))
    L.opt.step()
    L.opt.zero_grad(set_to_none=True)
    acc.time("update", t2)
    flips = cfg.flips and heavy
    if drift or flips:
        t3 = time.perf_counter()
        with _local_forwards(L, drift or flips):
            after = drift_step(L, cfg, ro, rows, trained, before, sn, heavy, acc) if drift else None
            if flips:  # the token-flip ledger (loop/update/flipstep.py)
                flip_step(L, cfg, ro, rows, trained, after, acc)
        acc.time("probes", t3)


def _say(line: str | None) -> None:
    """One warning line on stderr (the run goes on)."""
    if line:
        print(f"gradlab: warning: {line}", file=sys.stderr, flush=True)


def _local_forwards(L, on: bool, grad: bool = False):
    """Under FSDP, a block of forwards whose number differs per rank runs on gathered full
    weights (`gradlab.loop.scale.fsdp.gathered`: one all-gather that every rank joins, so `on` must
    be the same on all ranks); otherwise nothing."""
    return gathered(L.model, grad) if on and is_sharded(L.model) else contextlib.nullcontext()


def _grads_for_tax(L, taxed: bool):
    """What `reduce_tax` reads the step's gradient from: the model, or under FSDP its
    gradients all-gathered (`FullGrads`, a collective every rank joins when `taxed`)."""
    return FullGrads(L.model) if taxed and is_sharded(L.model) else unwrap(L.model)


def _clip(L, cfg: RunConfig) -> torch.Tensor:
    """Clip the gradient norm to `cfg.grad_clip`; returns the norm before clipping (a plain
    tensor: FSDP's sharded gradients give a replicated DTensor, made full here)."""
    norm = torch.nn.utils.clip_grad_norm_(L.model.parameters(), cfg.grad_clip)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _lockstep_passes(cfg: RunConfig, ro: Rollout, rows: torch.Tensor, D: Dist) -> int:
    """Micro-batch forward/backward passes this rank runs in the step: its own count, or under
    FSDP (every forward a collective) the largest count over ranks — fewer groups are padded
    with zero-loss passes (`_zero_pass`)."""
    n = len(micro_batches(ro.group[rows], cfg.micro_batch, cfg.G)) if rows.numel() else 0
    if not D.fsdp:
        return n
    return int(D.max(torch.tensor(n, device=ro.group.device)))


def _zero_pass(L, cfg: RunConfig, ro: Rollout) -> None:
    """A forward/backward on one row of this rank's rollout with loss × 0: it joins the ranks'
    gradient reduction (DDP's all-reduce, FSDP's all-gathers and reduce-scatter) and adds 0."""
    one = torch.arange(1, device=ro.group.device)
    with amp_context(cfg):
        logps = token_logps(L.model, ro.prompt_ids[one], ro.prompt_mask[one], ro.response_ids[one],
                            ro.response_mask[one], cfg.temperature)
    (0.0 * logps.sum()).backward()


def _accumulate(L, cfg: RunConfig, ro: Rollout, adv: torch.Tensor, rows: torch.Tensor,
                norms: tuple[int, int, int], passes: int = 0) -> tuple[
                    TokenBatch, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Forward/backward of every micro-batch of the step, gradients accumulated in `.grad`.

    norms: the step's (sequences, response tokens, padded width), global under DDP. Each
    micro-batch is cut after its last response token (right padding only; causal attention
    makes the earlier positions' log-probs independent of it). Under DDP every micro-batch but
    the last runs under `no_sync`, so gradients are all-reduced once per step. passes: under
    FSDP the ranks' largest micro-batch count; this rank pads with zero-loss passes up to it.
    Returns (the step's TokenBatch (B, T) with detached log-probs, W (B, T) or None without
    probes, entropy (B, T), the loss: sum of the micro-batch losses = the one-pass loss).
    """
    B, T = rows.numel(), ro.response_ids.shape[1]
    dev = ro.response_ids.device
    logps = torch.zeros(B, T, device=dev)
    ent = torch.zeros(B, T, device=dev)
    W = torch.zeros(B, T, device=dev) if cfg.probes else None
    loss = torch.zeros((), device=dev)
    parts = micro_batches(ro.group[rows], cfg.micro_batch, cfg.G)
    for k, p in enumerate(parts):
        r = rows[p]
        used = ro.response_mask[r].any(0).nonzero()
        t = int(used.max()) + 1 if used.numel() else 1
        last = k == len(parts) - 1
        sync = contextlib.nullcontext() if last or not hasattr(L.model, "no_sync") else L.model.no_sync()
        with sync:
            with amp_context(cfg):
                lp, e = token_logps(L.model, ro.prompt_ids[r], ro.prompt_mask[r],
                                    ro.response_ids[r, :t], ro.response_mask[r, :t],
                                    cfg.temperature, return_entropy=True, entropy_grad=False)
            mb = rows_batch(ro, r, lp, adv, norms, t)
            with ModulationProbe(enabled=cfg.probes) as probe:
                part_loss = L.objective.loss(mb.replace(logps=probe.watch(lp)))
                part_loss.backward()
        logps[p, :t] = lp.detach().to(logps.dtype)
        ent[p, :t] = e.detach().to(ent.dtype)
        if W is not None:
            W[p, :t] = probe.W.to(W.dtype)
        loss = loss + part_loss.detach()
        # the entropy's graph is not freed by the loss's backward: drop it before the next
        # micro-batch's forward, so at most one micro-batch's activations are ever alive
        del lp, e, part_loss, mb, probe
    for _ in range(passes - len(parts)):  # FSDP lock-step: as many passes as the busiest rank
        _zero_pass(L, cfg, ro)
    return rows_batch(ro, rows, logps, adv, norms), W, ent, loss


def rows_batch(ro: Rollout, rows: torch.Tensor, logps: torch.Tensor, adv: torch.Tensor,
               norms: tuple[int, int, int], t: int | None = None) -> TokenBatch:
    """The TokenBatch of rollout rows `rows` (B,), cut to the first t positions: logps (B, t),
    sequence advantages adv (N,), rewards, and `repair_of` renumbered into this batch's rows
    (−1 where the corrected row is not among them); norms: the step's normaliser totals."""
    t = ro.response_ids.shape[1] if t is None else t
    ref = batch_repair_of(ro.repair_of, rows)
    rewards = ro.rewards[rows] if ro.rewards is not None else None
    return TokenBatch(ro.response_ids[rows, :t], ro.response_mask[rows, :t], logps,
                      ro.old_logps[rows, :t], adv[rows], ro.group[rows], rewards=rewards,
                      repair_of=ref, n_seqs=norms[0], n_tokens=norms[1], width=norms[2],
                      validate=False)


def _chunks(n: int, cfg: RunConfig) -> range:
    """Start offsets of row chunks for the probes' extra forwards (one chunk per micro-batch)."""
    return range(0, n, cfg.micro_batch or max(n, 1))


def tax_step(L, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, batch: TokenBatch,
             W: torch.Tensor, sn) -> dict:
    """The parameter-space learning tax g_tax at full-group nodes (docs/concepts/tax.md), from a
    forward + backward over the nodes' representative rows, truncated after the shared prefix
    (see `gradlab.probes.tax.tax_from_reps`; a test holds it to `learning_tax`), in chunks of
    `micro_batch` rows whose g_tax add up."""
    raw = unwrap(L.model)
    params = dict(raw.named_parameters())
    # g_tax in float32: under FSDP --amp the gathered weights are bf16 (loop/numerics/precision.py),
    # and the ranks' sum (`reduce_tax`) needs one dtype, that of an idle rank's float32 zeros
    if sn.n == 0:
        return tax_report({n: torch.zeros_like(p, dtype=torch.float32)
                           for n, p in params.items()}, params)
    reps = torch.unique(sn.rep)
    t_max = int(sn.position.max()) + 1
    D = residual_grad_outputs(W, batch, sn)[:, :t_max]
    tax = None
    for c in _chunks(reps.numel(), cfg):
        part = reps[c: c + (cfg.micro_batch or reps.numel())]
        r = rows[part]
        with amp_context(cfg):
            lp = token_logps(raw, ro.prompt_ids[r], ro.prompt_mask[r], ro.response_ids[r, :t_max],
                             ro.response_mask[r, :t_max], cfg.temperature)
        g = {n: v.float() for n, v in tax_grads(lp, D[part], params).items()}
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
        r = rows[reps[c: c + size]]
        sel = ((which >= c) & (which < c + size)).nonzero().squeeze(-1)
        it = context_logprobs(model, ro.prompt_ids[r], ro.prompt_mask[r],
                              ro.response_ids[r, :t_max], ro.response_mask[r, :t_max],
                              which[sel] - c, sn.position[sel], cfg.temperature)
        while True:
            with amp_context(cfg):
                part = next(it, None)
            if part is None:
                break
            yield sel[part[0]: part[0] + part[1].shape[0]], part[1]


@torch.no_grad()
def drift_step(L, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, batch: TokenBatch,
               before: NodesBefore | None, sn, heavy: bool,
               acc: StepMetrics) -> torch.Tensor | None:
    """How the step just taken moved the policy (docs/concepts/drift.md).

    before: π_before at the full-group nodes of `sn` (`node_logprobs`; None when there is no
    node). Every step: Δ log π of the shared token at every node, and KL(π_before ‖ π_after)
    at the nodes `before.kept` (all of them unless the step has more than KL_BUDGET // V
    nodes, then an evenly spaced sample: `kl_nodes`), from a forward over one representative
    row per group, truncated after its last shared position (~1/G of a batch forward over
    the shared prefix); π_after is reduced chunk by chunk, never held for all nodes.
    Heavy steps add the divergent positions, by sign of A — the sampled token's Δ log π only
    (before: the step's own log-probs `batch.logps`; after: a forward in micro-batch chunks).
    Why no KL there: it needs π_before(·) at every position, a (B, T, V) tensor kept across
    the optimizer step; memory bounded by the micro-batch matters more (`node_drift` still
    computes it for callers that hold both distributions). Returns that (B, T) "after" of
    the sampled tokens on heavy steps (the token-flip ledger reuses it), else None.
    """
    raw = unwrap(L.model)
    if before is not None:
        after, kl = torch.zeros_like(before.token_logp), before.dist.new_zeros(before.kept.numel())
        slot = before.slot()
        for idx, lp in _node_chunks(raw, cfg, ro, rows, sn):
            after[idx] = lp.gather(-1, sn.token[idx, None]).squeeze(-1)
            if (kept := _kept(slot, idx)) is not None:
                kl[kept[0]] = kl_rows(_held_rows(before.dist, kept[0]), lp[kept[1]])
        acc.add_drift(drift_sums(after - before.token_logp, kl))
    if not heavy:
        return None
    after = sampled_logps(raw, cfg, ro, rows, batch.logps)
    acc.add_drift(divergent_dlogp(batch.logps, after, batch, sn))
    return after


def _idle_step(L, cfg: RunConfig, ro: Rollout, acc: StepMetrics, heavy: bool,
               D: Dist, passes: int = 1) -> None:
    """A rank with no rows in this global step still joins DDP's gradient all-reduce (and the
    tax reduction) with a zero contribution, then takes the same optimizer step. Under FSDP it
    runs `passes` zero-loss passes and joins the drift probes' all-gathers with no forward."""
    for _ in range(max(passes, 1)):
        _zero_pass(L, cfg, ro)
    if D.fsdp and not admit(L, cfg, torch.zeros((), device=ro.group.device), acc):
        return  # under FSDP the ranks agree on a non-finite shard anywhere (loop/faults/guard.py)
    D.fix_grads(L.model)
    taxed, drift = cfg.probes and heavy, cfg.probes and cfg.drift
    grads = _grads_for_tax(L, taxed)
    with _local_forwards(L, taxed or drift, grad=taxed):  # the busy ranks' tax and node passes
        pass
    if taxed:
        dev = ro.group.device  # full shapes (a sharded parameter's .shape is the full one)
        zero = {n: torch.zeros(p.shape, dtype=p.dtype, device=dev)
                for n, p in unwrap(L.model).named_parameters()}
        acc.add_tax(reduce_tax({"g_tax": zero}, grads, D))  # joins the ranks' g_tax sum
    acc.add_scalar("loss", 0.0)
    acc.add_scalar("grad_norm", _clip(L, cfg))
    L.opt.step()
    L.opt.zero_grad(set_to_none=True)
    with _local_forwards(L, drift or (cfg.flips and heavy)):  # the busy ranks' drift, flips
        pass
