"""One optimizer step of the loop, written out: log-probs → loss (hook on the (B, T) log-probs)
→ backward → probes (they return numbers) → optimizer. Also the scheduled learning tax and the
drift of the step just taken (MATH.md §3–4), and how a rollout batch is cut into steps.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..core import objectives
from ..core.batch import TokenBatch
from ..probes import ModulationProbe, layer_groups, measure_step, node_drift, shared_drift
from ..probes.tax import reduce_tax, residual_grad_outputs, tax_from_reps, tax_report
from .config import RunConfig
from .dist import Dist, unwrap
from .guard import admit
from .logprobs import token_logps
from .metrics import StepMetrics
from .rollout import Rollout
from .traces import record_trace


def amp_context(cfg: RunConfig):
    """bf16 autocast on CUDA when asked; a no-op on CPU."""
    if cfg.amp and cfg.device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def minibatches(group: torch.Tensor, k: int, gen: torch.Generator, split: bool,
                n_groups: int | None = None) -> list[torch.Tensor]:
    """Row indices of k optimizer steps. Whole groups per step unless `split` (then rows are
    shuffled and cut like TRL's generation batch, so a group is spread over steps).

    group (N,) holds global group labels 0..n_groups−1; the permutation is over all n_groups
    labels, so every data-parallel rank (same generator state) agrees on which groups make up
    each global step and takes its own rows of them.
    """
    dev = group.device
    if split:
        perm = torch.randperm(group.numel(), generator=gen, device=dev)
        return list(perm.chunk(k))
    n = int(group.max()) + 1 if n_groups is None else n_groups
    order = torch.randperm(n, generator=gen, device=dev)
    return [torch.isin(group, part).nonzero().squeeze(-1) for part in order.chunk(k)]


def optimizer_step(L, cfg: RunConfig, ro: Rollout, adv: torch.Tensor,
                   rows: torch.Tensor, acc: StepMetrics, heavy: bool,
                   others: list[tuple[str, objectives.Objective]], D: Dist) -> None:
    """One optimizer step of learner L on rows of the rollout, with the probes."""
    # normalisers use the global minibatch's totals (identical to the local ones in one process)
    dev = ro.group.device  # nccl reduces CUDA tensors only
    tot = D.sum(torch.tensor([rows.numel(), int(ro.response_mask[rows].sum())], device=dev))
    width = int(D.max(torch.tensor(ro.response_ids.shape[1], device=dev)))
    if rows.numel() == 0:  # none of this step's groups are on this rank
        return _idle_step(L, cfg, ro, acc, heavy, D)
    t0 = time.perf_counter()
    with amp_context(cfg):
        logps, ent, logprobs = token_logps(
            L.model, ro.prompt_ids[rows], ro.prompt_mask[rows], ro.response_ids[rows],
            ro.response_mask[rows], cfg.temperature, return_entropy=True, return_logprobs=True)
    batch = TokenBatch(ro.response_ids[rows], ro.response_mask[rows], logps, ro.old_logps[rows],
                       adv[rows], ro.group[rows], n_seqs=int(tot[0]), n_tokens=int(tot[1]),
                       width=width, validate=False)
    with ModulationProbe(enabled=cfg.probes) as probe:
        watched = probe.watch(logps)
        loss, stats = L.objective(batch.replace(logps=watched))
        loss.backward()
    if not admit(L, cfg, loss, acc):  # non-finite loss/gradient: stop or skip (loop/guard.py)
        return
    acc.time("update", t0)
    t1 = time.perf_counter()
    acc.add_basic(batch, ent.detach(), loss.detach(), stats)
    sn = None
    if cfg.probes:
        readings = measure_step(L.objective, batch, probe.W, ent.detach(), heavy, others)
        acc.record(readings)
        sn = readings.prefix_nodes
    record_trace(L, ro, rows, batch, probe.W)  # token traces (loop/traces.py), on traced steps
    D.fix_grads(L.model)
    if cfg.probes and heavy:
        tax = tax_step(L, cfg, ro, rows, batch, probe.W, sn)
        acc.add_tax(reduce_tax(tax, unwrap(L.model), D) if D.enabled else tax)
    acc.time("probes", t1)
    t2 = time.perf_counter()
    acc.add_scalar("grad_norm", torch.nn.utils.clip_grad_norm_(L.model.parameters(), cfg.grad_clip))
    L.opt.step()
    L.opt.zero_grad(set_to_none=True)
    acc.time("update", t2)
    if cfg.probes and cfg.drift:
        t3 = time.perf_counter()
        drift_step(L, cfg, ro, rows, batch, logprobs.detach(), sn, heavy, acc)
        acc.time("probes", t3)


def tax_step(L, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, batch: TokenBatch,
             W: torch.Tensor, sn) -> dict:
    """The parameter-space learning tax g_tax at full-group nodes (MATH.md §3), from one
    forward + backward over the nodes' representative rows, truncated after the shared prefix
    (see `gradlab.probes.tax.tax_from_reps`; a test holds it to `learning_tax`)."""
    raw = unwrap(L.model)
    params = dict(raw.named_parameters())
    if sn.n == 0:
        return tax_report({n: torch.zeros_like(p) for n, p in params.items()}, params)
    reps = torch.unique(sn.rep)
    t_max = int(sn.position.max()) + 1
    r = rows[reps]
    with amp_context(cfg):
        lp = token_logps(raw, ro.prompt_ids[r], ro.prompt_mask[r], ro.response_ids[r, :t_max],
                         ro.response_mask[r, :t_max], cfg.temperature)
    D = residual_grad_outputs(W, batch, sn)[reps, :t_max]
    return tax_from_reps(lp, D, params, layer_groups(raw))


@torch.no_grad()
def drift_step(L, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, batch: TokenBatch,
               before: torch.Tensor, sn, heavy: bool, acc: StepMetrics) -> None:
    """How the step just taken moved the policy (MATH.md §4), from `before` (B, T, V).

    Cheap (every step): at the full-group shared nodes only — one representative row per
    group, truncated after its last shared position, so the extra forward is ~1/G of a batch
    forward over the shared prefix. Heavy steps: every position (divergent tokens by sign of A).
    """
    raw = unwrap(L.model)
    with amp_context(cfg):
        if heavy:
            _, after = token_logps(raw, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                   ro.response_ids[rows], ro.response_mask[rows],
                                   cfg.temperature, return_logprobs=True)
            acc.add_drift(node_drift(before, after, batch, sn))
            return
        if sn.n == 0:
            return
        reps = torch.unique(sn.rep)  # (R,) local rows
        t_max = int(sn.position.max()) + 1
        r = rows[reps]
        _, after = token_logps(raw, ro.prompt_ids[r], ro.prompt_mask[r], ro.response_ids[r, :t_max],
                               ro.response_mask[r, :t_max], cfg.temperature, return_logprobs=True)
    a = after[torch.searchsorted(reps, sn.rep), sn.position]  # (N, V)
    acc.add_drift(shared_drift(before[sn.rep, sn.position], a, sn.token))


def _idle_step(L, cfg: RunConfig, ro: Rollout, acc: StepMetrics, heavy: bool,
               D: Dist) -> None:
    """A rank with no rows in this global step still joins DDP's gradient all-reduce (and the
    tax reduction) with a zero contribution, then takes the same optimizer step."""
    one = torch.arange(1, device=ro.group.device)
    logps = token_logps(L.model, ro.prompt_ids[one], ro.prompt_mask[one], ro.response_ids[one],
                        ro.response_mask[one], cfg.temperature)
    (0.0 * logps.sum()).backward()
    D.fix_grads(L.model)
    if cfg.probes and heavy:
        raw = unwrap(L.model)
        zero = {n: torch.zeros_like(p) for n, p in raw.named_parameters()}
        acc.add_tax(reduce_tax({"g_tax": zero}, raw, D))  # joins the ranks' g_tax sum
    acc.add_scalar("loss", 0.0)
    acc.add_scalar("grad_norm", torch.nn.utils.clip_grad_norm_(L.model.parameters(), cfg.grad_clip))
    L.opt.step()
    L.opt.zero_grad(set_to_none=True)
