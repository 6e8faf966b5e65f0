"""The group-relative RL loop, written out: rollout → batch → loss and probes → metrics.

One `Learner` per objective (its own copy of the policy, optimizer and sampling generator),
all from the same initial weights, the same prompt stream (prompts of rollout step k are a
function of (seed, k)) and the same compute: `steps` rollout batches of prompts × G responses,
each cut into `minibatches` optimizer steps (groups stay whole unless `split_groups`).

Per optimizer step the loop measures W with a backward hook on the real (B, T) log-probs,
the cancellation residual at full-group and trie nodes, and (scheduled) the parameter-space
learning tax, mechanism attribution and drift at the step's shared contexts; per rollout step
the cumulative KL at a fixed probe set of shared contexts and the equal-solution log-odds.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..core import objectives
from ..core.batch import TokenBatch, advantages
from ..probes import ModulationProbe, layer_groups, node_drift, shared_drift
from ..probes.tax import reduce_tax, residual_grad_outputs, tax_from_reps, tax_report
from .config import ConfigError, RunConfig
from .dist import Dist, setup, unwrap
from .logprobs import token_logps
from .metrics import StepMetrics, probe_metrics, probe_set
from .policy import load_policy
from .rollout import Rollout, generate
from .store import RunStore
from .task import get_task


@dataclass
class Learner:
    """One objective's training state."""

    name: str
    objective: objectives.Objective
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    gen: torch.Generator
    tokens: int = 0  # response tokens consumed so far


def amp_context(cfg: RunConfig):
    """bf16 autocast on CUDA when asked; a no-op on CPU."""
    if cfg.amp and cfg.device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_learners(cfg: RunConfig, model, names: list[str]) -> list[Learner]:
    out = []
    for name in names:
        m = copy.deepcopy(model).to(cfg.device).train()
        opt = torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)  # minibatch order
        obj = objectives.get(name, **cfg.objective_params.get(name, {}))
        out.append(Learner(name, obj, m, opt, gen))
    return out


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


def optimizer_step(L: Learner, cfg: RunConfig, ro: Rollout, adv: torch.Tensor,
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
    acc.time("update", t0)
    t1 = time.perf_counter()
    acc.add_basic(batch, ent.detach(), loss.detach(), stats)
    if cfg.probes:
        acc.add_step(L.objective, batch, probe.W, ent.detach(), heavy, others)
    D.fix_grads(L.model)
    if cfg.probes and heavy:
        tax = tax_step(L, cfg, ro, rows, batch, probe.W, acc.last_prefix_nodes)
        acc.add_tax(reduce_tax(tax, unwrap(L.model), D) if D.enabled else tax)
    acc.time("probes", t1)
    t2 = time.perf_counter()
    acc.add_scalar("grad_norm", torch.nn.utils.clip_grad_norm_(L.model.parameters(), cfg.grad_clip))
    L.opt.step()
    L.opt.zero_grad(set_to_none=True)
    acc.time("update", t2)
    if cfg.probes and cfg.drift:
        t3 = time.perf_counter()
        drift_step(L, cfg, ro, rows, batch, logprobs.detach(), acc.last_prefix_nodes, heavy, acc)
        acc.time("probes", t3)


def tax_step(L: Learner, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, batch: TokenBatch,
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
def drift_step(L: Learner, cfg: RunConfig, ro: Rollout, rows: torch.Tensor, batch: TokenBatch,
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


def _idle_step(L: Learner, cfg: RunConfig, ro: Rollout, acc: StepMetrics, heavy: bool,
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


def sample(L: Learner, cfg: RunConfig, task, tok, step: int, D: Dist) -> Rollout:
    """This rank's share of rollout batch `step`: its prompts, G responses each.

    Prompts are a function of (seed, step); sampling noise is hashed from (seed, step, global
    row), so one process and N ranks draw exactly the same global batch.
    """
    problems = task.problems(cfg.prompts, seed=cfg.seed * 1_000_003 + step)
    mine = D.local_prompts(cfg.prompts)
    g = torch.tensor(mine, device=cfg.device).repeat_interleave(cfg.G)  # global group labels
    rows = g * cfg.G + torch.arange(cfg.G, device=cfg.device).repeat(len(mine))
    keys = (cfg.seed * 1_000_003 + step) * 1_000_003 + rows
    with amp_context(cfg):
        ro = generate(unwrap(L.model), tok, [problems[i] for i in mine], cfg.G,
                      cfg.max_new_tokens or task.max_new_tokens, cfg.temperature,
                      amp=cfg.amp, task=task, row_keys=keys)
    L.model.train()
    ro.group = g
    return ro


def rollout_step(L: Learner, cfg: RunConfig, task, tok, step: int, probes,
                 others, D: Dist) -> tuple[dict, Rollout]:
    """Sample one rollout batch and make `minibatches` optimizer steps; returns (metrics, rollout)."""
    acc = StepMetrics(D)
    t0 = time.perf_counter()
    ro = sample(L, cfg, task, tok, step, D)
    acc.time("rollout", t0)
    adv = advantages(ro.rewards, ro.group, scale=cfg.adv_scale)
    L.tokens += int(D.sum(ro.response_mask.sum()))
    heavy = cfg.tax_every > 0 and step % cfg.tax_every == 0
    parts = minibatches(ro.group, cfg.minibatches, L.gen, cfg.split_groups, cfg.prompts)
    for rows in parts:
        optimizer_step(L, cfg, ro, adv, rows, acc, heavy, others, D)
    acc.add_rollout(task, ro, parts)
    rec = acc.finish()
    t1 = time.perf_counter()
    if probes is not None:
        rec.update(probe_metrics(unwrap(L.model), probes, cfg))
    acc.time("probes", t1)
    rec.update(acc.times)
    rec.update({"step": step, "objective": L.name, "seed": cfg.seed, "tokens": L.tokens})
    return rec, ro


def train(cfg: RunConfig, resume: bool = False) -> RunStore:
    """Run the tandem (or same-batch) loop; returns the run store.

    Under torchrun (WORLD_SIZE > 1) every rank runs this function on its shard of the prompts
    (gradlab.loop.dist); rank 0 alone writes the store and checkpoints.
    """
    D = setup(cfg.device)
    if D.enabled and (cfg.split_groups or cfg.prompts % D.world or cfg.adv_scale == "batch"):
        raise ConfigError(f"--prompts must be a multiple of the {D.world} ranks, and split_groups "
                          "and adv_scale='batch' need one process")
    torch.manual_seed(cfg.seed)
    store = RunStore(cfg.out, cfg.to_json(), resume=resume, write=D.main)
    builtin = cfg.task == "arithmetic"
    task = get_task(cfg.task, difficulty=cfg.difficulty) if builtin else get_task(cfg.task)
    # A JSONL task without --model uses the default tiny policy (its tokenizer covers ASCII).
    model, tok = load_policy(cfg.model, task=task if builtin else None, device=cfg.device)
    trained = cfg.objectives if cfg.mode == "tandem" else cfg.objectives[:1]
    others = [] if cfg.mode == "tandem" else [  # (name, objective) pairs
        (n, objectives.get(n, **cfg.objective_params.get(n, {}))) for n in cfg.objectives[1:]]
    learners = make_learners(cfg, model, trained)
    probes = probe_set(model.to(cfg.device), tok, task, cfg) if cfg.probes else None
    start = _resume(store, learners, D) if resume else 0
    for L in learners:
        L.model = D.wrap(L.model)
    bar = tqdm(range(start, cfg.steps), desc="train", disable=not (cfg.progress and D.main),
               initial=start, total=cfg.steps)
    for step in bar:
        post = {}
        for L in learners:
            t0 = time.perf_counter()
            rec, ro = rollout_step(L, cfg, task, tok, step, probes, others, D)
            rec["time_step"] = time.perf_counter() - t0
            store.log(rec)
            store.log({"step": step, "objective": L.name, "prompt": ro.problems[0].prompt,
                       "responses": ro.texts[: cfg.G], "rewards": ro.rewards[: cfg.G].tolist()},
                      "samples.jsonl")
            post[L.name] = f"r={rec['reward']:.2f}" + (
                f" ρ={rec['rho_prefix']:.2f}" if "rho_prefix" in rec else "")
        bar.set_postfix_str(" | ".join(f"{k}: {v}" for k, v in post.items()))
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps:
            for L in learners:
                store.save_checkpoint(L.name, unwrap(L.model), L.opt,
                                      {"step": step + 1, "tokens": L.tokens},
                                      {"gen": L.gen.get_state()})
            D.barrier()
    D.close()
    return store


def _resume(store: RunStore, learners: list[Learner], D: Dist) -> int:
    """Restore every learner from its checkpoint; drop metrics written after it."""
    steps = []
    for L in learners:
        state, extra = store.load_checkpoint(L.name, L.model, L.opt)
        L.gen.set_state(extra["gen"])
        L.tokens = state["tokens"]
        steps.append(state["step"])
    if len(set(steps)) != 1:
        raise RuntimeError(f"checkpoints of {store.path} are at different steps: {steps}")
    D.barrier()  # every rank has read the files before rank 0 rewrites the metrics
    store.truncate_after(steps[0] - 1)
    return steps[0]
