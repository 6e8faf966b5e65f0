"""One optimizer step of the loop, in its phases (docs/concepts/instruments.md):

1. forward/backward — log-probs → loss, a hook on the (B, T) log-probs gives W (`_accumulate`);
2. guard — a non-finite loss or gradient stops or skips the update (loop/faults/guard.py);
3. the step's instruments — they read W, the batch and the nodes and return numbers;
4. "update"-phase instruments, before — forwards on the weights before the step (tax, drift);
5. apply — clip and `opt.step()`;
6. "update"-phase instruments, after — forwards on the weights after it (drift, token flips).

A data-parallel rank with no rows in the step runs the same phases on nothing: zero-loss
passes join the gradient reduction, its instruments join the ranks' collectives.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

import torch

from ...core.batch import TokenBatch
from ...instruments import Instrument, InstrumentSet
from ...instruments.host import HostView
from ...probes import ModulationProbe
from ..config import RunConfig
from ..faults.guard import admit, check_update
from ..numerics.logprobs import token_logps
from ..numerics.precision import amp_context
from ..rollouts.rollout import Rollout
from ..runs.traces import record_trace
from ..scale.dist import Dist, unwrap
from ..scale.fsdp import FullGrads, gathered, is_sharded
from .batches import micro_batches
from .learner import Learner
from .metrics import StepMetrics
from .view import step_view


@dataclass
class StepWork:
    """What one optimizer step trains on: `rows` (B,) of `rollout`, whose (N,) sequence
    advantages are `advantages`, at rollout step `step` (the instruments' schedules)."""

    rollout: Rollout
    advantages: torch.Tensor
    rows: torch.Tensor
    step: int


def optimizer_step(learner: Learner, cfg: RunConfig, work: StepWork, acc: StepMetrics,
                   instruments: InstrumentSet, dist: Dist) -> None:
    """One optimizer step of `learner` on `work`, measured by the due `instruments`.

    The step's rows are cut into micro-batches of whole groups (`cfg.micro_batch`), each a
    forward/backward whose loss uses the *step's* normalisers (sequences, tokens, width), so the
    accumulated gradient is the one-pass gradient. W, log-probs and entropy are gathered into
    (B, T) tensors of the whole step; the instruments then read the whole step once.
    """
    acc.declare(instruments.quantities())
    rollout, rows = work.rollout, work.rows
    view = step_view(learner.model, cfg, rollout, rows, dist, objective=learner.objective)
    t0 = time.perf_counter()
    loss = _forward_backward(learner, cfg, work, view, instruments, dist)
    guarded = bool(rows.numel()) or dist.fsdp  # FSDP: the ranks agree on a non-finite shard
    admitted = admit(learner.model, learner.opt, cfg, loss, acc, learner.where) if guarded else None
    if guarded and admitted is None:
        return  # a non-finite loss or gradient, skipped (loop/faults/guard.py)
    if not view.idle and view.W is not None and dist.main \
            and hasattr(learner.objective, "check_closed_form"):
        _say(learner.objective.check_closed_form(view.batch, view.W))  # a user loss, once
    acc.time("update", t0)
    t1 = time.perf_counter()
    if view.idle:
        acc.add_scalar("loss", 0.0)
    else:
        acc.add_basic(view.batch, view.entropy, loss, learner.objective.stats(view.batch))
        acc.add_advantages(view.trained, view.grid())  # W's advantages (IBPO: per token)
        acc.record(instruments.measure(view, work.step))
        record_trace(learner.tracer, learner.objective, rollout, rows, view.trained, view.W)
    dist.fix_grads(learner.model)
    updating = instruments.due(work.step, "update")
    taxed = any("grads" in i.needs for i in updating)
    view.grads = _grads_for_tax(learner, taxed)
    with _local_forwards(learner, _overrides(updating, "before"), grad=taxed):
        for inst in updating:
            if (r := inst.before(view)) is not None:
                acc.record(r)
    acc.time("probes", t1)
    t2 = time.perf_counter()
    acc.add_scalar("grad_norm", _clip(learner, cfg))
    learner.opt.step()
    if admitted is not None:  # a parameter the update made non-finite: stop or put back
        check_update(learner.opt, cfg, admitted, acc, learner.where)
    learner.opt.zero_grad(set_to_none=True)
    acc.time("update", t2)
    if _overrides(updating, "after"):
        t3 = time.perf_counter()
        with _local_forwards(learner, True):
            for inst in updating:
                acc.record(inst.after(view))
        acc.time("probes", t3)


def _forward_backward(learner: Learner, cfg: RunConfig, work: StepWork, view: HostView,
                      instruments: InstrumentSet, dist: Dist) -> torch.Tensor:
    """Phase 1: every micro-batch's forward/backward, gradients accumulated; fills the view's
    batch, W and entropy. An idle rank runs zero-loss passes only. Returns the step's loss."""
    rollout, rows = work.rollout, work.rows
    dev = rollout.group.device  # normalisers: the global minibatch's totals (nccl: CUDA tensors)
    tot = dist.sum(torch.tensor([rows.numel(), int(rollout.response_mask[rows].sum())], device=dev))
    width = int(dist.max(torch.tensor(rollout.response_ids.shape[1], device=dev)))
    passes = _lockstep_passes(cfg, rollout, rows, dist)
    if rows.numel() == 0:  # none of this step's groups are on this rank
        for _ in range(max(passes, 1)):
            _zero_pass(learner, cfg, rollout)
        return torch.zeros((), device=dev)
    # W is measured when a due instrument reads it, or for the token traces of a traced step
    watch = "W" in instruments.needs(work.step) or learner.tracer is not None
    view.batch, view.W, view.entropy, loss = _accumulate(
        learner, cfg, rollout, work.advantages, rows=rows,
        norms=(int(tot[0]), int(tot[1]), width), passes=passes, watch=watch)
    return loss


def _overrides(instruments: list[Instrument], method: str) -> bool:
    """Whether any of `instruments` implements `method` ("before"/"after": it runs forwards
    there, so under FSDP the ranks gather full weights together)."""
    return any(getattr(type(i), method) is not getattr(Instrument, method) for i in instruments)


def _say(line: str | None) -> None:
    """One warning line on stderr (the run goes on)."""
    if line:
        print(f"gradlab: warning: {line}", file=sys.stderr, flush=True)


def _local_forwards(learner: Learner, on: bool, grad: bool = False):
    """Under FSDP, a block of forwards whose number differs per rank runs on gathered full
    weights (`gradlab.loop.scale.fsdp.gathered`: one all-gather that every rank joins, so `on` must
    be the same on all ranks); otherwise nothing."""
    return gathered(learner.model, grad) if on and is_sharded(learner.model) else contextlib.nullcontext()


def _grads_for_tax(learner: Learner, taxed: bool):
    """What `reduce_tax` reads the step's gradient from: the model, or under FSDP its
    gradients all-gathered (`FullGrads`, a collective every rank joins when `taxed`)."""
    return FullGrads(learner.model) if taxed and is_sharded(learner.model) else unwrap(learner.model)


def _clip(learner: Learner, cfg: RunConfig) -> torch.Tensor:
    """Clip the gradient norm to `cfg.grad_clip`; returns the norm before clipping (a plain
    tensor: FSDP's sharded gradients give a replicated DTensor, made full here)."""
    norm = torch.nn.utils.clip_grad_norm_(learner.model.parameters(), cfg.grad_clip)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _lockstep_passes(cfg: RunConfig, rollout: Rollout, rows: torch.Tensor, dist: Dist) -> int:
    """Micro-batch forward/backward passes this rank runs in the step: its own count, or under
    FSDP (every forward a collective) the largest count over ranks — fewer groups are padded
    with zero-loss passes (`_zero_pass`)."""
    n = len(micro_batches(rollout.group[rows], cfg.micro_batch, cfg.G)) if rows.numel() else 0
    if not dist.fsdp:
        return n
    return int(dist.max(torch.tensor(n, device=rollout.group.device)))


def _zero_pass(learner: Learner, cfg: RunConfig, rollout: Rollout) -> None:
    """A forward/backward on one row of this rank's rollout with loss × 0: it joins the ranks'
    gradient reduction (DDP's all-reduce, FSDP's all-gathers and reduce-scatter) and adds 0."""
    one = rollout.rows(torch.arange(1, device=rollout.group.device))
    with amp_context(cfg):
        logps = token_logps(learner.model, one.prompt_ids, one.prompt_mask, one.response_ids,
                            one.response_mask, cfg.temperature)
    (0.0 * logps.sum()).backward()


def _accumulate(learner: Learner, cfg: RunConfig, rollout: Rollout, adv: torch.Tensor, *,
                rows: torch.Tensor, norms: tuple[int, int, int], passes: int = 0,
                watch: bool | None = None) -> tuple[
                    TokenBatch, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Forward/backward of every micro-batch of the step, gradients accumulated in `.grad`.

    norms: the step's (sequences, response tokens, padded width), global under DDP. Each
    micro-batch is cut after its last response token (right padding only; causal attention
    makes the earlier positions' log-probs independent of it). Under DDP every micro-batch but
    the last runs under `no_sync`, so gradients are all-reduced once per step. passes: under
    FSDP the ranks' largest micro-batch count; this rank pads with zero-loss passes up to it.
    watch: measure W (default: yes). Returns (the step's TokenBatch (B, T) with
    detached log-probs, W (B, T) or None when not watched, entropy (B, T), the loss: sum of
    the micro-batch losses = the one-pass loss).
    """
    watch = True if watch is None else watch
    B, T = rows.numel(), rollout.response_ids.shape[1]
    dev = rollout.response_ids.device
    logps = torch.zeros(B, T, device=dev)
    ent = torch.zeros(B, T, device=dev)
    W = torch.zeros(B, T, device=dev) if watch else None
    loss = torch.zeros((), device=dev)
    parts = micro_batches(rollout.group[rows], cfg.micro_batch, cfg.G)
    for k, part in enumerate(parts):
        r = rows[part]  # (b,) this micro-batch's rollout rows
        used = rollout.response_mask[r].any(0).nonzero()
        t = int(used.max()) + 1 if used.numel() else 1
        last = k == len(parts) - 1
        no_sync = not last and hasattr(learner.model, "no_sync")  # DDP: all-reduce on the last
        sync = learner.model.no_sync() if no_sync else contextlib.nullcontext()
        with sync:
            with amp_context(cfg):
                s = rollout.rows(r, t=t)
                lp, e = token_logps(learner.model, s.prompt_ids, s.prompt_mask, s.response_ids,
                                    s.response_mask, cfg.temperature, return_entropy=True,
                                    entropy_grad=False)
            mb = rollout.token_batch(lp, adv, r, t=t, norms=norms, validate=False)
            with ModulationProbe(enabled=watch) as probe:
                part_loss = learner.objective.loss(mb.replace(logps=probe.watch(lp)))
                part_loss.backward()
        logps[part, :t] = lp.detach().to(logps.dtype)
        ent[part, :t] = e.detach().to(ent.dtype)
        if W is not None:
            W[part, :t] = probe.W.to(W.dtype)
        loss = loss + part_loss.detach()
        # the entropy's graph is not freed by the loss's backward: drop it before the next
        # micro-batch's forward, so at most one micro-batch's activations are ever alive
        del lp, e, part_loss, mb, probe
    for _ in range(passes - len(parts)):  # FSDP lock-step: as many passes as the busiest rank
        _zero_pass(learner, cfg, rollout)
    return rollout.token_batch(logps, adv, rows, norms=norms, validate=False), W, ent, loss
