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

import copy
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from . import objectives
from .batch import TokenBatch, advantages
from .config import RunConfig
from .metrics import StepMetrics, probe_set, probe_metrics
from .policy import load_policy
from .probes import ModulationProbe, learning_tax, layer_groups, node_drift
from .rollout import Rollout, generate, token_logps
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
    on = cfg.amp and cfg.device.startswith("cuda")
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=on)


def make_learners(cfg: RunConfig, model, names: list[str]) -> list[Learner]:
    out = []
    for name in names:
        m = copy.deepcopy(model).to(cfg.device).train()
        opt = torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)  # same samples at step 0
        obj = objectives.get(name, **cfg.objective_params.get(name, {}))
        out.append(Learner(name, obj, m, opt, gen))
    return out


def minibatches(group: torch.Tensor, k: int, gen: torch.Generator, split: bool) -> list[torch.Tensor]:
    """Row indices of k optimizer steps. Whole groups per step unless `split` (then rows are
    shuffled and cut like TRL's generation batch, so a group is spread over steps)."""
    dev = group.device
    if split:
        perm = torch.randperm(group.numel(), generator=gen, device=dev)
        return list(perm.chunk(k))
    labels = torch.unique(group)
    order = labels[torch.randperm(labels.numel(), generator=gen, device=dev)]
    return [torch.isin(group, part).nonzero().squeeze(-1) for part in order.chunk(k)]


def optimizer_step(L: Learner, cfg: RunConfig, ro: Rollout, adv: torch.Tensor,
                   rows: torch.Tensor, acc: StepMetrics, heavy: bool,
                   others: list[objectives.Objective]) -> None:
    """One optimizer step of learner L on rows of the rollout, with the probes."""
    t0 = time.perf_counter()
    with amp_context(cfg):
        logps, ent, logprobs = token_logps(
            L.model, ro.prompt_ids[rows], ro.prompt_mask[rows], ro.response_ids[rows],
            ro.response_mask[rows], cfg.temperature, return_entropy=True, return_logprobs=True)
    batch = TokenBatch(ro.response_ids[rows], ro.response_mask[rows], logps, ro.old_logps[rows],
                       adv[rows], ro.group[rows], validate=False)
    with ModulationProbe() as probe:
        watched = probe.watch(logps)
        loss, stats = L.objective(batch.replace(logps=watched))
        loss.backward(retain_graph=heavy)
    acc.time("update", t0)
    t1 = time.perf_counter()
    W = probe.W
    acc.add_step(L.objective, batch, W, ent.detach(), loss.detach(), stats, heavy, others)
    if heavy:
        params = dict(L.model.named_parameters())
        acc.add_tax(learning_tax(logps, W, batch, params, "prefix", layer_groups(L.model)))
    acc.time("probes", t1)
    t2 = time.perf_counter()
    acc.add_scalar("grad_norm", torch.nn.utils.clip_grad_norm_(L.model.parameters(), cfg.grad_clip))
    L.opt.step()
    L.opt.zero_grad(set_to_none=True)
    acc.time("update", t2)
    if cfg.drift:
        t3 = time.perf_counter()
        with torch.no_grad(), amp_context(cfg):
            _, after = token_logps(L.model, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                      ro.response_ids[rows], ro.response_mask[rows],
                                      cfg.temperature, return_logprobs=True)
        acc.add_drift(node_drift(logprobs.detach(), after, batch, acc.last_prefix_nodes))
        acc.time("probes", t3)


def rollout_step(L: Learner, cfg: RunConfig, task, tok, step: int, probes,
                 others) -> tuple[dict, Rollout]:
    """Sample one rollout batch and make `minibatches` optimizer steps; returns (metrics, rollout)."""
    acc = StepMetrics()
    t0 = time.perf_counter()
    problems = task.problems(cfg.prompts, seed=cfg.seed * 1_000_003 + step)
    max_new = cfg.max_new_tokens or task.max_new_tokens
    with amp_context(cfg):
        ro = generate(L.model, tok, problems, cfg.G, max_new, cfg.temperature, L.gen,
                      amp=cfg.amp, task=task)
    L.model.train()
    acc.time("rollout", t0)
    adv = advantages(ro.rewards, ro.group, scale=cfg.adv_scale)
    L.tokens += int(ro.response_mask.sum())
    heavy = cfg.tax_every > 0 and step % cfg.tax_every == 0
    parts = minibatches(ro.group, cfg.minibatches, L.gen, cfg.split_groups)
    for rows in parts:
        optimizer_step(L, cfg, ro, adv, rows, acc, heavy, others)
    rec = acc.finish()
    rec.update(acc.rollout_metrics(task, ro, parts))
    t1 = time.perf_counter()
    rec.update(probe_metrics(L.model, probes, cfg))
    acc.time("probes", t1)
    rec.update(acc.times)
    rec.update({"step": step, "objective": L.name, "seed": cfg.seed, "tokens": L.tokens})
    return rec, ro


def train(cfg: RunConfig, resume: bool = False) -> RunStore:
    """Run the tandem (or same-batch) loop; returns the run store."""
    torch.manual_seed(cfg.seed)
    store = RunStore(cfg.out, cfg.to_json(), resume=resume)
    builtin = cfg.task == "arithmetic"
    task = get_task(cfg.task, difficulty=cfg.difficulty) if builtin else get_task(cfg.task)
    # A JSONL task without --model uses the default tiny policy (its tokenizer covers ASCII).
    model, tok = load_policy(cfg.model, task=task if builtin else None, device=cfg.device)
    trained = cfg.objectives if cfg.mode == "tandem" else cfg.objectives[:1]
    others = [] if cfg.mode == "tandem" else [
        objectives.get(n, **cfg.objective_params.get(n, {})) for n in cfg.objectives[1:]]
    learners = make_learners(cfg, model, trained)
    probes = probe_set(model.to(cfg.device), tok, task, cfg, store)
    start = _resume(store, learners) if resume else 0
    bar = tqdm(range(start, cfg.steps), desc="train", disable=not cfg.progress,
               initial=start, total=cfg.steps)
    for step in bar:
        post = {}
        for L in learners:
            t0 = time.perf_counter()
            rec, ro = rollout_step(L, cfg, task, tok, step, probes, others)
            rec["time_step"] = time.perf_counter() - t0
            store.log(rec)
            store.log({"step": step, "objective": L.name, "prompt": ro.problems[0].prompt,
                       "responses": ro.texts[: cfg.G], "rewards": ro.rewards[: cfg.G].tolist()},
                      "samples.jsonl")
            post[L.name] = f"r={rec['reward']:.2f} ρ={rec['rho_prefix']:.2f}"
        bar.set_postfix_str(" | ".join(f"{k}: {v}" for k, v in post.items()))
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps:
            for L in learners:
                store.save_checkpoint(L.name, L.model, L.opt, {"step": step + 1, "tokens": L.tokens},
                                      {"gen": L.gen.get_state()})
    return store


def _resume(store: RunStore, learners: list[Learner]) -> int:
    """Restore every learner from its checkpoint; drop metrics written after it."""
    steps = []
    for L in learners:
        state, extra = store.load_checkpoint(L.name, L.model, L.opt)
        L.gen.set_state(extra["gen"])
        L.tokens = state["tokens"]
        steps.append(state["step"])
    if len(set(steps)) != 1:
        raise RuntimeError(f"checkpoints of {store.path} are at different steps: {steps}")
    store.truncate_after(steps[0] - 1)
    return steps[0]
