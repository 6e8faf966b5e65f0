"""Prop. 3.1 on real optimizer steps of the tandem (docs/concepts/drift.md; the math is in
`gradlab.probes.fisher`).

`prop31_tandem(cfg)` runs the tandem loop (the learners, prompts, rollouts and minibatches of
`gradlab.loop.train`) and takes each optimizer step with the loop's own `optimizer_step`. Around
each step it records, at every full-group shared node (h*, a*) of the step's minibatch:

- kl        measured KL(π_θ(·|h*) ‖ π_θ+(·|h*)), θ+ the parameters after the real step;
- half_delta      ½ δᵀF(h*)δ, δ = θ+ − θ the step actually taken (Adam, clipping included);
- half_res_adam   ½ δ_resᵀFδ_res, δ_res = the part of δ due to this step's clipped g_tax
                  through Adam's preconditioner at that step (`adam_step_parts`; ours);
- half_res_sgd    the first-order reading δ_res = −lr · c · g_tax (c the grad-clip factor),
                  i.e. the step a plain SGD update along the residual would take;
- half_cur        the part of δ due to this step's whole clipped gradient (Adam reading).

Measurement is in float64 (`float64_meter`: a float64 copy of the policy evaluated at the
float32 θ and θ+), so the KL of a ~1e-8-nat step is not rounding noise. Before the step the loss gradient is
recomputed (one extra forward/backward) to get W, g and g_tax; `grad_match` checks that the
recomputed clipped gradient equals the one the optimizer used, and `adam_match` that the Adam
update rebuilt from the optimizer state equals θ+ − θ.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import torch

from ...core.batch import advantages
from ...core.nodes import shared_nodes
from ...probes.fisher import adam_step_parts, float64_meter, kl_and_fisher
from ...probes.tax import learning_tax
from ..config import RunConfig
from ..numerics.logprobs import context_logprobs_fn, token_logps
from ..numerics.precision import amp_context
from ..scale.dist import Dist, unwrap
from ..setup.policy import load_policy
from ..setup.task import get_task
from ..train import Learner, make_learners, sample
from ..update.batches import minibatches
from ..update.metrics import StepMetrics
from ..update.step import StepWork, optimizer_step
from ..update.view import loop_instruments


def _norm(d: dict[str, torch.Tensor]) -> float:
    return float(sum((v.double() ** 2).sum() for v in d.values()) ** 0.5)


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum((a[n].double() * b[n].double()).sum() for n in a))


def _ratio(a: float, b: float) -> float:
    """a / b; NaN (undefined, not 0) where b = 0, e.g. no update (every group tied)."""
    return a / b if b > 0 else math.nan


def _gradients(L: Learner, cfg: RunConfig, ro, adv: torch.Tensor, rows: torch.Tensor):
    """(batch, nodes, g (loss gradient, unclipped), g_tax, tax_share) at the current θ."""
    raw = unwrap(L.model)
    params = dict(raw.named_parameters())
    with amp_context(cfg):  # the optimizer step's own forward (loop/numerics/precision.py)
        s = ro.rows(rows)
        logps = token_logps(raw, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                            cfg.temperature)
    batch = ro.token_batch(logps, adv, rows, validate=False)
    loss, _ = L.objective(batch)
    names = list(params)
    out = torch.autograd.grad(loss, [logps] + [params[n] for n in names], retain_graph=True,
                              allow_unused=True)
    W = -out[0]
    g = {n: torch.zeros_like(params[n]) if x is None else x for n, x in zip(names, out[1:])}
    sn = shared_nodes(batch.replace(logps=logps.detach()), "prefix")
    tax = learning_tax(logps, W, batch, params, sn=sn, g_total=g)
    return batch, sn, g, tax["g_tax"], float(tax["tax_share"])


def measured_step(L: Learner, cfg: RunConfig, ro, adv: torch.Tensor, rows: torch.Tensor,
                  *, meter: torch.nn.Module, D: Dist) -> list[dict]:
    """Take one real optimizer step of L on `rows` and return one record per full-group node."""
    raw = unwrap(L.model)
    params = dict(raw.named_parameters())
    theta = {n: p.detach().clone() for n, p in params.items()}
    _, sn, g, g_tax, share = _gradients(L, cfg, ro, adv, rows)
    c = min(1.0, cfg.grad_clip / (_norm(g) + 1e-6))  # torch's clip_grad_norm_ factor
    seen: dict[str, torch.Tensor] = {}
    hook = L.opt.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.detach().clone() for n, p in params.items()}))
    try:
        light = loop_instruments(replace(cfg, tax_every=0))  # no tax, attribution, flips
        optimizer_step(L, cfg, StepWork(ro, adv, rows, 0), StepMetrics(D), light, D)
    finally:
        hook.remove()
    after = {n: p.detach().clone() for n, p in params.items()}
    delta = {n: after[n] - theta[n] for n in params}
    gc = {n: c * g[n] for n in params}
    parts = adam_step_parts(L.opt, params, {"res": {n: c * g_tax[n] for n in params}, "cur": gc})
    lr = L.opt.param_groups[0]["lr"]
    dirs = {"delta": delta, "res_adam": parts["res"], "cur": parts["cur"],
            "res_sgd": {n: -lr * c * g_tax[n] for n in params}}
    diff = {n: seen[n] - gc[n] for n in params}
    step_info = dict(
        tax_share=share, clip=c, grad_norm=_norm(g), delta_norm=_norm(delta),
        grad_match=_ratio(_norm(diff), _norm(seen)),
        adam_match=_ratio(_norm({n: parts["adam"][n] - delta[n] for n in params}), _norm(delta)),
        cos_delta_grad=_ratio(-_dot(delta, g), _norm(delta) * _norm(g)),
        res_frac=_ratio(_norm(parts["res"]), _norm(delta)), n_nodes=sn.n)
    if sn.n == 0:
        return []
    reps = torch.unique(sn.rep)
    t_max = int(sn.position.max()) + 1
    s = ro.rows(rows[reps], t=t_max)
    f = context_logprobs_fn(meter, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                            row=torch.searchsorted(reps, sn.rep),
                            pos=sn.position, temperature=cfg.temperature)
    dbl = lambda d: {n: v.double() for n, v in d.items()}  # noqa: E731
    res = kl_and_fisher(f, dbl(theta), dbl(after), {k: dbl(v) for k, v in dirs.items()})
    cols = ["kl"] + [f"half_{k}" for k in dirs]
    vals = {k: res[k].tolist() for k in cols}
    return [dict(step_info, node=i, position=int(sn.position[i]),
                 **{k: vals[k][i] for k in cols}) for i in range(sn.n)]


def prop31_tandem(cfg: RunConfig, progress: bool = False) -> list[dict]:
    """Run the tandem of cfg (one process, probes off: only this measurement) and return one
    record per (rollout step, optimizer step, objective, full-group node); see the module doc."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # refused before joining any process group
        raise RuntimeError("prop31_tandem runs in one process")
    D = Dist()
    torch.manual_seed(cfg.seed)
    builtin = cfg.task == "arithmetic"
    task = get_task(cfg.task, difficulty=cfg.difficulty) if builtin else get_task(cfg.task)
    model, tok = load_policy(cfg.model, task=task if builtin else None, device=cfg.device,
                             trust_remote_code=cfg.trust_remote_code)
    learners = make_learners(cfg, model, cfg.objectives)
    meter = float64_meter(model)
    records = []
    for step in range(cfg.steps):
        for L in learners:
            ro = sample(L, cfg, task, tok, step, D)
            adv = advantages(ro.rewards, ro.group, scale=cfg.adv_scale)
            parts = minibatches(ro.group, cfg.minibatches, L.gen, cfg.split_groups, cfg.prompts)
            for k, rows in enumerate(parts):
                recs = measured_step(L, cfg, ro, adv, rows, meter=meter, D=D)
                records += [dict(r, objective=L.name, step=step, opt_step=step * len(parts) + k)
                            for r in recs]
            if progress:
                print(f"step {step} {L.name}: {len(records)} records", flush=True)
    return records
