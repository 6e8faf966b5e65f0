"""DFPO: within-group transforms of the token modulation, with stop-gradient (docs/concepts/dfpo.md).

Write the base objective's modulation as W_{i,t} = A_i w_{i,t}. At each shared node n with
members S_n, replace w by w̃:
  Min-Replace  w̃_i = min_{j∈S_n} w_j
  Orth-Proj    w̃ = w − (aᵀw / aᵀa) a,  a = A_S − mean(A_S)   (w̃ = w when all A_S are equal)
  scale        w̃ = factor · w   (the paper's "scale by 0.5" ablation)
and train on L = −Σ sg(A_i w̃_{i,t}) l_{i,t}. `transform_weights` is the pure function; the
`DFPO` objective (gradlab.core.objectives) and the gradient-transform hook (gradlab.probes)
both call it; this module imports no objective.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batch import TokenBatch, group_index
from .nodes import shared_nodes

TRANSFORMS = ("min", "orth", "scale")
SCOPES = ("shared", "all")


def node_map(batch: TokenBatch, scope: str = "shared", nodes: str = "prefix") -> tuple[Tensor, int]:
    """(B, T) long node index (−1 = untouched) and the node count for a DFPO scope.

    scope="shared": the shared nodes of kind `nodes`; scope="all": every (group, position)
    over the rows that are masked in there (the paper's W_{t*} vector at every t).
    """
    if scope == "shared":
        sn = shared_nodes(batch, nodes)
        return sn.node, sn.n
    gid, _ = group_index(batch.group)
    key = gid.unsqueeze(-1) * batch.T + torch.arange(batch.T, device=gid.device)  # (B, T)
    node = torch.full_like(key, -1)
    if not bool(batch.mask.any()):
        return node, 0
    uniq, inv = torch.unique(key[batch.mask], return_inverse=True)
    node[batch.mask] = inv
    return node, int(uniq.numel())


def transform_weights(
    w: Tensor, adv: Tensor, node: Tensor, n_nodes: int, transform: str, factor: float = 0.5
) -> Tensor:
    """Apply a DFPO transform to w at the positions of `node`.

    w (B, T) float (may carry a graph: the result is differentiable in w, the min sends its
    gradient to the single selected member), adv (B,) A_i or (B, T) A_{i,t}, node (B, T) long with −1 where w is
    left alone. Returns w̃ (B, T).
    """
    if transform not in TRANSFORMS:
        raise ValueError(f"dfpo: unknown transform={transform!r}; valid: {TRANSFORMS}")
    sh = node >= 0
    if n_nodes == 0 or not bool(sh.any()):
        return w
    idx = node[sh]  # (K,) node of each shared (row, position), row-major
    wv = w[sh]  # (K,)
    if transform == "scale":
        return w.masked_scatter(sh, factor * wv)
    if transform == "min":
        return w.masked_scatter(sh, wv[_argmin_per_node(wv.detach(), idx, n_nodes)[idx]])
    a = _centred_advantages(adv, sh, idx, n_nodes, wv.dtype)
    aa = torch.zeros(n_nodes, dtype=wv.dtype, device=w.device).index_add_(0, idx, a * a)
    aw = torch.zeros_like(aa).index_add_(0, idx, a * wv)
    coef = torch.where(aa > 0, aw / torch.where(aa > 0, aa, 1), 0)
    return w.masked_scatter(sh, wv - coef[idx] * a)


def _argmin_per_node(wv: Tensor, idx: Tensor, n: int) -> Tensor:
    """(N,) flat index (into the K shared entries) of each node's smallest w (first on ties).

    A node whose w holds a NaN has no member equal to its min (amin propagates NaN): it takes
    its first NaN member, so w̃ is NaN there (NaN in → NaN out, never an IndexError)."""
    mn = torch.full((n,), float("inf"), dtype=wv.dtype, device=wv.device)
    mn = mn.scatter_reduce(0, idx, wv, reduce="amin")
    k = torch.arange(wv.numel(), device=wv.device)
    is_min = (wv == mn[idx]) | (torch.isnan(wv) & torch.isnan(mn[idx]))
    src = torch.full((n,), wv.numel(), dtype=torch.long, device=wv.device)
    return src.scatter_reduce(0, idx[is_min], k[is_min], reduce="amin")


def _centred_advantages(adv: Tensor, sh: Tensor, idx: Tensor, n: int, dtype) -> Tensor:
    """(K,) a = A − mean_S(A) per node; exactly 0 where all members' A are equal.

    The all-equal test is exact (max == min) so that rounding in the mean can never produce a
    tiny aᵀa that blows up the projection.
    """
    adv = adv if adv.dim() == 2 else adv.unsqueeze(-1).expand(sh.shape)  # (B, T)
    av = adv.to(dtype)[sh]  # (K,)
    cnt = torch.zeros(n, dtype=dtype, device=av.device).index_add_(0, idx, torch.ones_like(av))
    mean = torch.zeros_like(cnt).index_add_(0, idx, av) / cnt
    hi = torch.full_like(cnt, -float("inf")).scatter_reduce(0, idx, av, reduce="amax")
    lo = torch.full_like(cnt, float("inf")).scatter_reduce(0, idx, av, reduce="amin")
    return torch.where((hi == lo)[idx], 0, av - mean[idx])


def transform_vjp(v: Tensor, adv: Tensor, node: Tensor, n: int, *, w: Tensor, transform: str,
              factor: float = 0.5) -> Tensor:
    """Closed-form vector–Jacobian product of `transform_weights` w.r.t. w (independent of
    autograd): (B, T) = Σ over w̃ of v · ∂w̃/∂w, for the no-stop-grad ablation's W."""
    sh = node >= 0
    if n == 0 or not bool(sh.any()):
        return v
    idx, vv = node[sh], v[sh]
    if transform == "scale":
        return v.masked_scatter(sh, factor * vv)
    if transform == "min":
        src = _argmin_per_node(w[sh], idx, n)  # (N,) the member whose w is copied
        tot = torch.zeros(n, dtype=vv.dtype, device=v.device).index_add_(0, idx, vv)
        out = torch.zeros_like(vv).index_add_(0, src, tot)
        return v.masked_scatter(sh, out)
    a = _centred_advantages(adv, sh, idx, n, vv.dtype)  # P = I − a aᵀ/aᵀa is symmetric
    aa = torch.zeros(n, dtype=vv.dtype, device=v.device).index_add_(0, idx, a * a)
    av = torch.zeros_like(aa).index_add_(0, idx, a * vv)
    coef = torch.where(aa > 0, av / torch.where(aa > 0, aa, 1), 0)
    return v.masked_scatter(sh, vv - coef[idx] * a)
