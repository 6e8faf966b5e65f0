"""The group-relative RL loop, written out: rollout → batch → loss and probes → metrics.

One `Learner` per objective (its own copy of the policy, optimizer and sampling generator),
all from the same initial weights, the same prompt stream (prompts of rollout step k are a
function of (seed, k)) and the same compute: `steps` rollout batches of prompts × G responses,
each cut into `minibatches` optimizer steps (groups stay whole unless `split_groups`).

Each optimizer step (`gradlab.loop.update.step`) measures W with a backward hook on the real (B, T) log-probs,
the cancellation residual at full-group and trie nodes, and (scheduled) the parameter-space
learning tax, mechanism attribution and drift at the step's shared contexts; per rollout step
the cumulative KL at a fixed probe set of shared contexts and the equal-solution log-odds.
"""

from __future__ import annotations

import copy
import time

import torch
from tqdm.auto import tqdm

from ..core import objectives, variants
from ..core.batch import advantages
from ..core.userloss import UserLossError
from ..instruments.manifest import write_manifest
from ..provenance import record as record_provenance
from .config import ConfigError, RunConfig
from .faults.preempt import Preempted, StopSignals
from .numerics.precision import amp_context
from .rollouts.layouts import sample_layout
from .rollouts.rollout import Rollout
from .runs.livelog import LiveLogger
from .runs.resume import resolve_resume, restore
from .runs.store import RunStore
from .runs.traces import TraceWriter
from .scale.dist import Dist, setup, unwrap
from .scale.fsdp import full_checkpoint, gathered, rebuild_optimizer
from .setup.heldout import TrainSplit, eval_problems, evaluate_heldout
from .setup.policy import load_policy
from .setup.realmodel import format_problems, prepare_run
from .setup.task import BUILTIN_TASKS, check_encodable, get_task
from .update.batches import minibatches
from .update.learner import Learner
from .update.metrics import StepMetrics
from .update.probeset import probe_metrics, probe_set
from .update.step import StepWork, optimizer_step
from .update.view import loop_instruments

EVAL_KEYS = ("eval_accuracy", "eval_accuracy_greedy", "eval_accuracy_expected", "time_eval")


def make_learners(cfg: RunConfig, model, names: list[str]) -> list[Learner]:
    """One learner per objective name, named by its label (`gradlab.core.variants.label`: a
    user loss's name= or function name); the last one trains `model` itself (no extra copy
    of the weights is kept for the whole run), the others deep copies of it."""
    out = []
    for k, name in enumerate(names):
        m = (model if k == len(names) - 1 else copy.deepcopy(model)).to(cfg.device).train()
        opt = torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)  # minibatch order
        out.append(Learner(variants.label(name), build_objective(cfg, name), m, opt, gen))
    return out


def build_objective(cfg: RunConfig, name: str) -> objectives.Objective:
    """The objective `name` (with its bracketed and config parameters). An objective that
    scales its own advantages (IBPO) takes --adv-scale unless its brackets set `scale`."""
    obj = objectives.get(name, **cfg.objective_params.get(name, {}))
    if getattr(obj, "scale", "") is None:
        obj.scale = cfg.adv_scale
    return obj


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
    with gathered(L.model), amp_context(cfg):  # FSDP: full weights while sampling (loop/scale/fsdp.py)
        ro = sample_layout(cfg, unwrap(L.model), tok, [problems[i] for i in mine], task, keys)
    L.model.train()
    ro.group = torch.tensor(mine, device=cfg.device)[ro.group]  # local → global group labels
    return ro


def rollout_step(L: Learner, cfg: RunConfig, task, tok, step: int, *, probes,
                 instruments, D: Dist) -> tuple[dict, Rollout]:
    """Sample one rollout batch and make `minibatches` optimizer steps, measured by
    `instruments` (`loop_instruments`); returns (metrics, rollout)."""
    acc = StepMetrics(D, instruments.quantities())
    L.step = step
    t0 = time.perf_counter()
    ro = sample(L, cfg, task, tok, step, D)
    acc.time("rollout", t0)
    adv = advantages(ro.rewards, ro.group, scale=cfg.adv_scale)
    L.tokens += int(D.sum(ro.response_mask.sum()))
    parts = minibatches(ro.group, cfg.minibatches, L.gen, cfg.split_groups, cfg.prompts,
                        polarity=adv if cfg.balance_polarity else None)
    try:
        for rows in parts:
            optimizer_step(L, cfg, StepWork(ro, adv, rows, step), acc, instruments, D)
    except UserLossError as e:  # a user loss's fault: one line naming it and the step (exit 3)
        raise UserLossError(f"{e} at step {step}") from e.__cause__
    acc.add_rollout(task, ro, parts)
    rec = acc.finish()
    t1 = time.perf_counter()
    if probes is not None:
        with gathered(L.model):
            rec.update(probe_metrics(unwrap(L.model), probes, cfg))
    acc.time("probes", t1)
    rec.update(acc.times)
    rec.update({"step": step, "objective": L.name, "seed": cfg.seed, "tokens": L.tokens})
    return rec, ro


def train(cfg: RunConfig, resume: bool | str = False) -> RunStore:
    """Run the tandem (or same-batch) loop; returns the run store.

    Under torchrun (WORLD_SIZE > 1) every rank runs this function on its shard of the prompts
    (gradlab.loop.scale.dist); rank 0 alone writes the store and checkpoints. resume: True, False
    or "auto" (resume when `cfg.out` holds a run; what a torchrun restart does, loop/runs/resume.py).
    SIGTERM, SIGUSR1 or SIGINT: the step in flight is finished and checkpointed, then
    `Preempted` is raised (loop/faults/preempt.py). The run sets torch's thread count to
    `cfg.threads` (1 unless set, from Python as from the CLI; it stays set afterwards).
    Every rank leaves the process group in one order, on success, error or signal: a barrier,
    the learners and their DDP / FSDP wrappers released (they live only in `_train`'s frame,
    which has ended), then the group destroyed (`Dist.teardown`).
    """
    with StopSignals() as signals, setup(cfg.device, cfg.fsdp) as D:
        return _train(cfg, resume, signals, D)


def _train(cfg: RunConfig, resume: bool | str, signals: StopSignals, D: Dist) -> RunStore:
    resume = resolve_resume(resume, cfg.out, D)
    if D.enabled and (cfg.split_groups or cfg.prompts % D.world or cfg.adv_scale == "batch"
                      or cfg.balance_polarity):
        raise ConfigError(f"--prompts must be a multiple of the {D.world} ranks, and split_groups, "
                          "balance_polarity and adv_scale='batch' need one process")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)  # bitwise-identical results hold at a fixed thread count
    store = RunStore(cfg.out, cfg.to_json(), resume=resume, write=D.main)
    builtin = cfg.task in BUILTIN_TASKS
    task = get_task(cfg.task, **({"difficulty": cfg.difficulty} if cfg.task == "arithmetic" else {}))
    # A JSONL task without --model uses the default tiny policy (its tokenizer covers ASCII).
    model, tok = load_policy(cfg.model, task=task if builtin else None, device=cfg.device,
                             trust_remote_code=cfg.trust_remote_code)
    check_encodable(task, tok)  # characters the tokenizer cannot encode: refused (loop/setup/task.py)
    # training never draws a held-out problem; evaluation uses only those (loop/setup/heldout.py)
    evalset = eval_problems(task, cfg.eval_size) if cfg.eval_every else []
    # chat template, prompt limit, grad checkpointing, verifier (loop/setup/realmodel.py); the split
    # stays on the raw prompts, the template wraps what the model sees
    task = prepare_run(cfg, model, tok, TrainSplit(task))
    evalset = format_problems(task, evalset)
    trained = cfg.objectives if cfg.mode == "tandem" else cfg.objectives[:1]
    others = [] if cfg.mode == "tandem" else [  # (label, objective) pairs
        (variants.label(n), build_objective(cfg, n)) for n in cfg.objectives[1:]]
    try:  # what every optimizer step measures (gradlab/instruments)
        instruments = loop_instruments(cfg, others)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--instruments: {e}") from None
    # the probe set is drawn from the initial weights before the last learner takes them over
    # the probe contexts and token traces go with the instruments that measure W
    watched = any("W" in i.needs and i.schedule.enabled for i in instruments)
    probes = probe_set(model.to(cfg.device), tok, task, cfg) if watched else None
    learners = make_learners(cfg, model, trained)
    del model
    start = restore(store, learners, D) if resume else 0  # loop/runs/resume.py
    if D.main:  # the code, machine and thread count of this segment (gradlab/provenance.py)
        record_provenance(store.path, start)
        write_manifest(store.path, list(instruments), loop=True)  # what is measured: names, units, reasons, curves
    if 0 < start < cfg.steps and cfg.eval_every and start % cfg.eval_every and D.main:
        # the shorter run evaluated at its end (step start-1); an uninterrupted run of this
        # length does not evaluate there, so neither does the resumed one: resume stays exact
        store.drop_keys_at(start - 1, EVAL_KEYS)
    tracer = TraceWriter(store.path, cfg.trace_every, cfg.trace_groups, tok, D.main and watched, start)
    live = LiveLogger(cfg.log, store.path, cfg.to_json(), D.main, start)
    for L in learners:
        plain = list(L.model.parameters())
        L.model = D.wrap(L.model, cfg.amp)
        if D.fsdp:  # sharding replaced the parameters: a new optimizer, same state (resume)
            L.opt = rebuild_optimizer(L.model, L.opt, plain)
        L.tracer = tracer
    bar = tqdm(range(start, cfg.steps), desc="train", disable=not (cfg.progress and D.main),
               initial=start, total=cfg.steps)
    stop = 0
    for step in bar:
        post = {}
        for L in learners:
            t0 = time.perf_counter()
            tracer.begin(L.name, step)
            rec, ro = rollout_step(L, cfg, task, tok, step, probes=probes, instruments=instruments,
                                   D=D)
            tracer.end()
            rec["time_step"] = time.perf_counter() - t0
            if evalset and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                t1 = time.perf_counter()
                with gathered(L.model):
                    rec.update(evaluate_heldout(unwrap(L.model), tok, task, evalset,
                                                temperature=cfg.temperature,
                                                max_new_tokens=(cfg.max_new_tokens
                                                                or task.max_new_tokens),
                                                seed=cfg.seed, amp=cfg.amp))
                rec["time_eval"] = time.perf_counter() - t1
            store.log(rec)
            live.log(rec)
            first = ro.rows(ro.group == ro.group[0])  # the first group's rows
            store.log({"step": step, "objective": L.name, "prompt": ro.problems[0].prompt,
                       "responses": first.texts,
                       "rewards": first.rewards.tolist()}, "samples.jsonl")
            post[L.name] = f"r={rec['reward']:.2f}" + (
                f" ρ={rec['rho_prefix']:.2f}".replace("nan", "—")  # NaN: undefined
                if "rho_prefix" in rec else "")
        bar.set_postfix_str(" | ".join(f"{k}: {v}" for k, v in post.items()))
        stop = signals.requested(D, cfg.device)  # a signal: every rank stops after this step
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps or stop:
            for L in learners:  # FSDP: full tensors gathered, one process's layout
                m, o = (full_checkpoint(L.model, L.opt, D.main) if D.fsdp
                        else (unwrap(L.model), L.opt))
                store.save_checkpoint(L.name, m, o,
                                      {"step": step + 1, "tokens": L.tokens},
                                      {"gen": L.gen.get_state()})
            D.barrier()
        if stop:
            break
    live.close()
    store.close()  # release the run folder's writer lock (loop/runs/lock.py)
    if stop:
        raise Preempted(stop, step + 1, cfg.steps, store.path, D.main)
    return store

