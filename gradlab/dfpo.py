"""DFPO: within-group transforms of the token modulation, with stop-gradient (MATH.md §5).

Write the base objective's modulation as W_{i,t} = A_i w_{i,t}. At each shared node n with
members S_n, replace w by w̃:
  Min-Replace  w̃_i = min_{j∈S_n} w_j
  Orth-Proj    w̃ = w − (aᵀw / aᵀa) a,  a = A_S − mean(A_S)   (w̃ = w when all A_S are equal)
  scale        w̃ = factor · w   (the paper's "scale by 0.5" ablation)
and train on L = −Σ sg(A_i w̃_{i,t}) l_{i,t}. `transform_weights` is the pure function; the
`DFPO` objective and the gradient-transform hook (gradlab.probes) both call it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batch import TokenBatch, group_index
from .nodes import NODE_KINDS, shared_nodes
from .objectives import GRPO, GSPO, GSPOToken, Objective, _f

TRANSFORMS = ("min", "orth", "scale")
SCOPES = ("shared", "all")
BASES = {"gspo": GSPO, "gspo-token": GSPOToken, "grpo": GRPO}


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
    gradient to the single selected member), adv (B,) A_i, node (B, T) long with −1 where w is
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
    """(N,) flat index (into the K shared entries) of each node's smallest w (first on ties)."""
    mn = torch.full((n,), float("inf"), dtype=wv.dtype, device=wv.device)
    mn = mn.scatter_reduce(0, idx, wv, reduce="amin")
    k = torch.arange(wv.numel(), device=wv.device)
    is_min = wv == mn[idx]
    src = torch.full((n,), wv.numel(), dtype=torch.long, device=wv.device)
    return src.scatter_reduce(0, idx[is_min], k[is_min], reduce="amin")


def _centred_advantages(adv: Tensor, sh: Tensor, idx: Tensor, n: int, dtype) -> Tensor:
    """(K,) a = A − mean_S(A) per node; exactly 0 where all members' A are equal.

    The all-equal test is exact (max == min) so that rounding in the mean can never produce a
    tiny aᵀa that blows up the projection.
    """
    av = _f(adv).to(dtype).unsqueeze(-1).expand(sh.shape)[sh]  # (K,)
    cnt = torch.zeros(n, dtype=dtype, device=av.device).index_add_(0, idx, torch.ones_like(av))
    mean = torch.zeros_like(cnt).index_add_(0, idx, av) / cnt
    hi = torch.full_like(cnt, -float("inf")).scatter_reduce(0, idx, av, reduce="amax")
    lo = torch.full_like(cnt, float("inf")).scatter_reduce(0, idx, av, reduce="amin")
    return torch.where((hi == lo)[idx], 0, av - mean[idx])


class DFPO(Objective):
    """DFPO over a base objective (default GSPO).

    transform "min" | "orth" | "scale" (factor), scope "shared" | "all", nodes "prefix" | "trie",
    stop_grad=False is the paper's "no stop-grad" ablation: the literal loss
    L = −Σ A_i w̃_{i,t}(θ) l_{i,t} with gradients flowing through w̃ (through s_i and the min);
    supported for base "gspo" only. The loss value with stop_grad=True equals the base
    objective's loss value (the surrogate only changes the gradient).
    """

    name = "dfpo"

    def __init__(self, base: str = "gspo", transform: str = "min", scope: str = "shared",
                 nodes: str = "prefix", stop_grad: bool = True, factor: float = 0.5,
                 eps=None, beta: float = 0.0) -> None:
        super().__init__(beta)
        if base not in BASES:
            raise ValueError(f"dfpo: unknown base={base!r}; valid: {tuple(BASES)}")
        for arg, val, valid in (("transform", transform, TRANSFORMS), ("scope", scope, SCOPES),
                                ("nodes", nodes, NODE_KINDS)):
            if val not in valid:
                raise ValueError(f"dfpo: unknown {arg}={val!r}; valid: {valid}")
        if not stop_grad and base != "gspo":
            raise ValueError("dfpo: stop_grad=False (the no-stop-grad ablation) needs base='gspo'")
        self.base = BASES[base](**({} if eps is None else {"eps": eps}))
        self.transform, self.scope, self.nodes = transform, scope, nodes
        self.stop_grad, self.factor = bool(stop_grad), float(factor)

    def norm(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        return self.base.norm(batch, off)

    def stats(self, batch: TokenBatch) -> dict:
        """The base objective's clip figures (a Min-Replace zero is not a clip)."""
        return self.base.stats(batch)

    def tilde(self, batch: TokenBatch, off: tuple = (), grad: bool = False) -> tuple[Tensor, Tensor]:
        """(w, w̃), both (B, T); with a graph through w when grad."""
        w = self.base.weight(batch, off, grad=grad)
        node, n = node_map(batch, self.scope, self.nodes)
        return w, transform_weights(w, batch.advantages, node, n, self.transform, self.factor)

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        lp = _f(batch.logps)
        adv = _f(batch.advantages).unsqueeze(-1)
        if not self.stop_grad:
            _, wt = self.tilde(batch, grad=True)
            return -(adv * wt * lp * batch.mask).sum()
        with torch.no_grad():
            _, wt = self.tilde(batch)
            value = self.base.policy_loss(batch)
        # gradient −A w̃ on every token, value = the base loss (lp − sg(lp) is 0 in value)
        return -(adv * wt * (lp - lp.detach())).sum() + value

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        adv = _f(batch.advantages).unsqueeze(-1)
        w, wt = self.tilde(batch, off)
        W = adv * wt
        if self.stop_grad:
            return W
        # No stop-grad: W_{j,u} += (w_j/T_j) · Σ_{i,t} A_i l_{i,t} ∂w̃_{i,t}/∂w_j on j's tokens
        # (w_j = (1/B) s_j/T_j 1[active] is constant in t, ∂s_j/∂l_{j,u} = s_j/T_j).
        v = adv * _f(batch.logps) * batch.mask  # cotangent of w̃
        node, n = node_map(batch, self.scope, self.nodes)
        adj = self._vjp(v, batch.advantages, node, n, w)  # (B, T) = Σ over w̃ of v·∂w̃/∂w
        T_i = batch.mask.sum(-1).clamp(min=1).to(W.dtype)
        w_row = (w * batch.mask).sum(-1) / T_i  # (B,) the row's constant w_j
        per_row = adj.sum(-1) * w_row / T_i  # (B,)
        return W + per_row.unsqueeze(-1) * batch.mask

    def _vjp(self, v: Tensor, adv: Tensor, node: Tensor, n: int, w: Tensor) -> Tensor:
        """Closed-form vector–Jacobian product of `transform_weights` (independent of autograd)."""
        sh = node >= 0
        if n == 0 or not bool(sh.any()):
            return v
        idx, vv = node[sh], v[sh]
        if self.transform == "scale":
            return v.masked_scatter(sh, self.factor * vv)
        if self.transform == "min":
            src = _argmin_per_node(w[sh], idx, n)  # (N,) the member whose w is copied
            tot = torch.zeros(n, dtype=vv.dtype, device=v.device).index_add_(0, idx, vv)
            out = torch.zeros_like(vv).index_add_(0, src, tot)
            return v.masked_scatter(sh, out)
        a = _centred_advantages(adv, sh, idx, n, vv.dtype)  # P = I − a aᵀ/aᵀa is symmetric
        aa = torch.zeros(n, dtype=vv.dtype, device=v.device).index_add_(0, idx, a * a)
        av = torch.zeros_like(aa).index_add_(0, idx, a * vv)
        coef = torch.where(aa > 0, av / torch.where(aa > 0, aa, 1), 0)
        return v.masked_scatter(sh, vv - coef[idx] * a)
