"""The fixed probe set of a run (docs/concepts/drift.md): shared contexts drawn once from the initial
policy, whose cumulative KL from that policy is tracked, and two-solution problems whose
equal-solution log-odds are tracked. Same probe set for every objective of a tandem.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.nodes import shared_nodes
from ...probes import equal_solution_logodds, kl_rows
from ..numerics.logprobs import token_logps
from ..numerics.precision import amp_context
from ..rollouts.rollout import generate


@torch.no_grad()
def probe_set(model, tok, task, cfg) -> dict:
    """Fixed probe contexts drawn once from the initial policy (same for every objective).

    contexts: the full-group shared nodes of a rollout of `probe_contexts` prompts; their
    initial next-token log-probs are the reference of the cumulative drift KL.
    forms: for the built-in task, prompts and their two solutions (form 0, form 1).
    """
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 12345)
    problems = task.problems(cfg.probe_contexts, seed=10**9 + cfg.seed)
    max_new = cfg.max_new_tokens or task.max_new_tokens
    ro = generate(model, tok, problems, cfg.G, max_new, cfg.temperature, generator=g, amp=cfg.amp)
    zeros = torch.zeros(ro.response_ids.shape, device=ro.response_ids.device)
    b = ro.token_batch(zeros, zeros[:, 0], old_logps=zeros, validate=False)
    sn = shared_nodes(b, "prefix")
    # keep one representative row per group, cut after the last shared position: the probe
    # forward then costs a few tokens per prompt
    reps = torch.unique(sn.rep)
    t_max = int(sn.position.max()) + 1 if sn.n else 1
    s = ro.rows(reps, t=t_max)
    rows = (s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask)
    probes = {"rows": rows, "rep": torch.searchsorted(reps, sn.rep), "pos": sn.position}
    probes["ref"] = _context_logprobs(model, probes, cfg) if sn.n else None
    sols = [task.solutions(p) for p in problems]
    if all(len(s) >= 2 for s in sols):
        from ..rollouts.rollout import encode_pairs

        prompts = [p.prompt for p in problems]
        probes["forms"] = [encode_pairs(tok, prompts, [s[k] for s in sols], device=cfg.device)
                           for k in (0, 1)]
    return probes


def _context_logprobs(model, probes: dict, cfg) -> Tensor:
    """(K, V) next-token log-probs at the probe contexts."""
    with amp_context(cfg):
        _, logprobs = token_logps(model, *probes["rows"], cfg.temperature, return_logprobs=True)
    return logprobs[probes["rep"], probes["pos"]]


@torch.no_grad()
def probe_metrics(model, probes: dict, cfg) -> dict:
    """Cumulative KL from the initial policy at the probe contexts; equal-solution log-odds."""
    was = model.training
    model.eval()
    out = {}
    if probes["rep"].numel():
        now = _context_logprobs(model, probes, cfg)
        out["probe_kl"] = float(kl_rows(probes["ref"], now).mean())
    if "forms" in probes:
        with amp_context(cfg):
            seq = [token_logps(model, *enc, cfg.temperature).sum(-1) for enc in probes["forms"]]
        lo, h = equal_solution_logodds(seq[0], seq[1])
        out.update({"logodds": float(lo.mean()), "logodds_abs": float(lo.abs().mean()),
                    "forms_entropy": float(h.mean())})
    model.train(was)
    return out
