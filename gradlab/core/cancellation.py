"""Does the gradient on shared tokens cancel? The residual report of docs/concepts/shared-nodes.md.

At node n with members S_n: net coefficient c_n = Σ_{S_n} W_{i,t_n}; exchangeable reference
c*_n = k_n Σ_{S_n} A_i with k_n = Σ|W| / Σ|A| (c* = 0 exactly for a full-group node, where
Σ A = 0); residual d_n = c_n − c*_n. Headline: ρ = Σ_n |d_n| / Σ_n (Σ_{S_n} |W| + |c*_n|) ∈ [0, 1].
At full-group nodes c* = 0 and this is the paper's ρ = Σ|d| / Σ|W|. At subset (trie) nodes
|d_n| can reach |c_n| + |c*_n| ≤ 2 Σ|W| (a residual opposite to the subset's credit), so docs/concepts/shared-nodes.md's
normaliser would let ρ exceed 1; adding |c*_n| keeps ρ in [0, 1] (*our* reading).
Undefined is not zero: ρ is NaN when there is no shared mass (no nodes, or W = 0 there).
Takes any W — closed form or hook-measured — and assumes nothing about the objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from .batch import TokenBatch
from .losses import MECHANISMS
from .nodes import SharedNodes, shared_nodes


@dataclass
class NodeCoefficients:
    """Per-node tensors, (N,) each: c, c_star, d, mass = Σ|W|, scale = mass + |c*| (ρ's
    normaliser), plus the node structure."""

    sn: SharedNodes
    c: Tensor
    c_star: Tensor
    d: Tensor
    mass: Tensor
    adv_sum: Tensor

    @property
    def scale(self) -> Tensor:
        return self.mass + self.c_star.abs()


def node_coefficients(W: Tensor, batch: TokenBatch, sn: SharedNodes) -> NodeCoefficients:
    """Device-side per-node sums (no host sync)."""
    dt = W.dtype if W.dtype in (torch.float32, torch.float64) else torch.float32
    W = W.detach().to(dt)
    sh = sn.node >= 0
    idx = sn.node[sh]
    z = torch.zeros(sn.n, dtype=dt, device=W.device)
    A = batch.adv_tokens.detach().to(dt)[sh]  # token advantages at the node (docs/concepts/ibpo.md)
    c = z.index_add(0, idx, W[sh])
    mass = z.index_add(0, idx, W[sh].abs())
    adv_sum = z.index_add(0, idx, A)
    abs_adv = z.index_add(0, idx, A.abs())
    k = torch.where(abs_adv > 0, mass / torch.where(abs_adv > 0, abs_adv, 1), 0)
    c_star = torch.where(sn.full, 0, k * adv_sum)
    return NodeCoefficients(sn, c, c_star, c - c_star, mass, adv_sum)


@dataclass
class Cancellation:
    """ρ (`ratio`), Σ|d| (`residual`), Σ|W| at nodes (`mass`), the share of response tokens
    that sit at a node (`shared_fraction`: NaN without a response token), node count, and
    `.nodes`, one DataFrame row per node.

    `ratio` is NaN where ρ is undefined: no node of the kind, or W ≡ 0 at its nodes (every
    group tied), so its denominator Σ (Σ|W| + |c*|) is 0. 0 means measured and cancelled.
    """

    ratio: float
    residual: float
    mass: float
    shared_fraction: float
    n_nodes: int
    kind: str
    coef: NodeCoefficients

    @property
    def nodes(self) -> pd.DataFrame:
        """Columns: group, position, members, token, c (net coefficient), c_star (exchangeable
        reference), d (residual), mass (Σ|W|), full (spans the whole group)."""
        k, sn = self.coef, self.coef.sn
        cols = {"group": sn.group, "position": sn.position, "members": sn.size,
                "token": sn.token, "c": k.c, "c_star": k.c_star, "d": k.d, "mass": k.mass,
                "full": sn.full}
        return pd.DataFrame({n: v.detach().cpu().numpy() for n, v in cols.items()})

    def summary(self) -> dict:
        return {"ratio": self.ratio, "residual": self.residual, "mass": self.mass,
                "shared_fraction": self.shared_fraction, "n_nodes": self.n_nodes}


def cancellation(
    W: Tensor, batch: TokenBatch, nodes: str = "prefix", sn: SharedNodes | None = None
) -> Cancellation:
    """Residual report for modulation W (B, T) on `batch` at "prefix" or "trie" nodes.

    Pass a precomputed `sn` (from `shared_nodes`) to reuse the structure across objectives.
    """
    if W.shape != batch.tokens.shape:
        raise ValueError(f"cancellation: W has shape {tuple(W.shape)}, batch is {tuple(batch.tokens.shape)}")
    if not bool(torch.isfinite(W.detach()[batch.mask]).all()):
        raise ValueError("cancellation: W is not finite at some masked-in position")
    sn = shared_nodes(batch, nodes) if sn is None else sn
    k = node_coefficients(W, batch, sn)
    residual, mass, scale = k.d.abs().sum(), k.mass.sum(), k.scale.sum()
    ratio = torch.where(scale > 0, residual / torch.where(scale > 0, scale, 1), torch.nan)
    n_tok = batch.mask.sum()  # no response token: the shared fraction is undefined (NaN)
    frac = torch.where(n_tok > 0, (sn.node >= 0).sum() / n_tok.clamp(min=1), torch.nan)
    r, res, m, f = torch.stack([ratio, residual, mass, frac.to(ratio.dtype)]).tolist()  # one sync
    r = r if math.isnan(r) else min(max(r, 0.0), 1.0)  # clamp round-off; undefined stays NaN
    return Cancellation(r, res, m, f, sn.n, sn.kind, k)


def attribution(objective, batch: TokenBatch, nodes: str = "prefix") -> dict[str, float]:
    """Share of the residual Σ|d| that each mechanism accounts for (docs/concepts/shared-nodes.md#attribution).

    For each of "coupling", "length", "clip": recompute the closed-form W with that mechanism
    switched off and report (res − res_off) / res (NaN when res = 0: there is no residual to
    attribute, so each share is undefined, not 0; can be negative when switching a mechanism
    off increases the residual). "residual" is Σ|d| itself (a number, 0 included). Group
    splitting is a property of the batch, not of the objective: it is measured by the loop
    (share of split groups).
    """

    s = attribution_sums(objective, batch, nodes)
    res = s["residual"]
    return {"residual": res, **{m: s[m] / res if res > 0 else math.nan for m in MECHANISMS}}


def attribution_sums(objective, batch: TokenBatch, nodes: str = "prefix") -> dict[str, float]:
    """The parts of `attribution` before dividing: "residual" Σ|d| and, per mechanism,
    res − res_off. Both add over disjoint sets of groups (data-parallel ranks, optimizer
    steps), so shares pooled over them are Σ(res − res_off) / Σ res."""
    batch = objective.prepare(batch)  # the advantages W is built from (IBPO: per token)
    sn = shared_nodes(batch, nodes)
    res = cancellation(objective.modulation(batch), batch, sn=sn).residual
    out = {"residual": res}
    for mech in MECHANISMS:
        r_off = cancellation(objective.modulation(batch, off=(mech,)), batch, sn=sn).residual
        out[mech] = res - r_off
    return out


def stepwise_residual(W: Tensor, sn: SharedNodes, step: Tensor) -> tuple[float, float]:
    """(Σ|c_{n,k}|, ratio) at full-group nodes with the net coefficient taken per step k.

    W (B, T), step (B,) long. c_{n,k} = Σ of W over the members of node n that sit in step k:
    what one optimizer step can cancel. Equals the plain residual when no group is split.
    The ratio Σ|c_{n,k}| / Σ|W| is NaN where it is undefined: no full-group token, or W ≡ 0
    at the nodes (every group tied); the residual is then 0.
    """
    sh = sn.node >= 0
    if not bool(sh.any()):
        return 0.0, math.nan
    k = step - step.min()
    n_k = int(k.max()) + 1
    key = sn.node[sh] * n_k + k.unsqueeze(-1).expand_as(sn.node)[sh]
    Wd = W.detach().double()
    c = torch.zeros(sn.n * n_k, dtype=Wd.dtype).index_add_(0, key, Wd[sh])
    res, mass = float(c.abs().sum()), float(Wd[sh].abs().sum())
    return res, (res / mass if mass > 0 else math.nan)
