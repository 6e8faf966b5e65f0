"""The group-relative policy objectives and their closed-form token modulation W.

Every objective is a loss L that depends on θ only through the per-token log-probs l_{i,t},
so ∇θL = −Σ W_{i,t} ∇θ l_{i,t} with W := −∂L/∂l (docs/concepts/modulation.md). Each objective gives
  .loss(batch)        — the loss written the way a trainer writes it (differentiable in logps),
  .modulation(batch)  — W from the closed form, (B, T), zero at masked positions,
and the tests hold one against the autograd gradient of the other.

Names: "grpo", "grpo-fix", "gspo", "gspo-token", "dfpo" (+ aliases "dfpo-min", "dfpo-orth"),
"ibpo" (gradlab.core.ibpo: token advantages from counterfactual paths over a token-level base),
and a user's own loss "path/file.py:fn" or "module:fn" (gradlab.core.userobjective).
Advantages may be per sequence (B,) or per token (B, T) (docs/concepts/ibpo.md, "Token advantages in any
objective"); (B,) advantages take the original code path bit for bit.
`.modulation(batch, off=...)` can switch mechanisms off for attribution (docs/concepts/shared-nodes.md#attribution):
"coupling" (s_i → 1), "length" (T_i → the batch's mean length), "clip" (indicators → 1).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from . import variants
from .batch import TokenBatch
from .dfpo import SCOPES, TRANSFORMS, node_map, transform_vjp, transform_weights
from .ibpo import IBPO
from .losses import (
    CLIPS,
    GRPO,
    GSPO,
    GRPOFix,
    GSPOToken,
    Objective,
    _adv,
    _f,
)
from .nodes import NODE_KINDS


class DFPO(Objective):
    """DFPO over a base objective (default GSPO).

    transform "min" | "orth" | "scale" (factor), scope "shared" | "all", nodes "prefix" | "trie",
    stop_grad=False is the paper's "no stop-grad" ablation: the literal loss
    L = −Σ A_i w̃_{i,t}(θ) l_{i,t} with gradients flowing through w̃ (through s_i and the min);
    supported for base "gspo" only. The loss value with stop_grad=True equals the base
    objective's loss value (the surrogate only changes the gradient).

    clip (our reading, docs/concepts/dfpo.md; the paper calls DFPO "clip-free" without a formula):
      "base" (default): w carries the base objective's clip indicator (for GSPO w_i = 0 once s_i
          leaves [1−lo, 1+hi]); Min-Replace then zeroes a whole node when one member is clipped.
      "free": no clip indicator anywhere, shared or not: w = the base w with the indicator set
          to 1, so the trust region rests on the stop-gradient weights and the step size alone.
    At full-group nodes both readings give the same parameter gradient (the node adds
    (Σ_i A_i w̃_i)·∇l = 0 whatever w̃ is; tests/test_fair.py); they differ outside shared
    positions and at trie nodes. With clip="free", stats report clip_frac = 0.
    """

    name = "dfpo"

    def __init__(self, base: str = "gspo", transform: str = "min", *, scope: str = "shared",
                 nodes: str = "prefix", stop_grad: bool = True, factor: float = 0.5,
                 eps=None, beta: float = 0.0, clip: str = "base") -> None:
        super().__init__(beta)
        bases = {"gspo": GSPO, "gspo-token": GSPOToken, "grpo": GRPO}
        if base not in bases:
            raise ValueError(f"dfpo: unknown base={base!r}; valid: {tuple(bases)}")
        for arg, val, valid in (("transform", transform, TRANSFORMS), ("scope", scope, SCOPES),
                                ("nodes", nodes, NODE_KINDS), ("clip", clip, CLIPS)):
            if val not in valid:
                raise ValueError(f"dfpo: unknown {arg}={val!r}; valid: {valid}")
        if not stop_grad and base != "gspo":
            raise ValueError("dfpo: stop_grad=False (the no-stop-grad ablation) needs base='gspo'")
        self._tilde_check = not stop_grad  # per-sequence advantages only (see policy_loss)
        self.base = bases[base](**({} if eps is None else {"eps": eps}))
        self.transform, self.scope, self.nodes = transform, scope, nodes
        self.stop_grad, self.factor = bool(stop_grad), float(factor)
        self.clip = clip

    def norm(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        return self.base.norm(batch, off)

    def stats(self, batch: TokenBatch) -> dict:
        """The base objective's clip figures (a Min-Replace zero is not a clip); clip_frac = 0
        with clip="free" (nothing is clipped)."""
        st = self.base.stats(batch)
        if self.clip == "free":
            st["clip_frac"] = torch.zeros_like(st["clip_frac"])
        return st

    def tilde(self, batch: TokenBatch, off: tuple = (), grad: bool = False) -> tuple[Tensor, Tensor]:
        """(w, w̃), both (B, T); with a graph through w when grad."""
        if self.clip == "free":  # no clip indicator anywhere (the "clip" mechanism switched off)
            off = tuple(off) + ("clip",)
        w = self.base.weight(batch, off, grad=grad)
        node, n = node_map(batch, self.scope, self.nodes)
        return w, transform_weights(w, batch.advantages, node, n, self.transform, self.factor)

    def _check_adv(self, batch: TokenBatch) -> None:
        if self._tilde_check and batch.advantages.dim() == 2:
            raise ValueError("dfpo: stop_grad=False (the no-stop-grad ablation) needs per-sequence "
                             "advantages (B,); got token advantages (B, T)")

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        self._check_adv(batch)
        lp = _f(batch.logps)
        adv = _f(_adv(batch))
        if not self.stop_grad:
            _, wt = self.tilde(batch, grad=True)
            return -(adv * wt * lp * batch.mask).sum()
        with torch.no_grad():
            _, wt = self.tilde(batch)
            value = self.base.policy_loss(batch)
        # gradient −A w̃ on every token, value = the base loss (lp − sg(lp) is 0 in value)
        return -(adv * wt * (lp - lp.detach())).sum() + value

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        self._check_adv(batch)
        adv = _f(_adv(batch))
        w, wt = self.tilde(batch, off)
        W = adv * wt
        if self.stop_grad:
            return W
        # No stop-grad: W_{j,u} += (w_j/T_j) · Σ_{i,t} A_i l_{i,t} ∂w̃_{i,t}/∂w_j on j's tokens
        # (w_j = (1/B) s_j/T_j 1[active] is constant in t, ∂s_j/∂l_{j,u} = s_j/T_j).
        v = adv * _f(batch.logps) * batch.mask  # cotangent of w̃
        node, n = node_map(batch, self.scope, self.nodes)
        adj = transform_vjp(v, batch.advantages, node, n, w=w, transform=self.transform,
                            factor=self.factor)  # (B, T) = Σ over w̃ of v·∂w̃/∂w
        T_i = batch.mask.sum(-1).clamp(min=1).to(W.dtype)
        w_row = (w * batch.mask).sum(-1) / T_i  # (B,) the row's constant w_j
        per_row = adj.sum(-1) * w_row / T_i  # (B,)
        return W + per_row.unsqueeze(-1) * batch.mask


def _registry() -> dict[str, Callable[..., Objective]]:
    return {
        "grpo": GRPO,
        "grpo-fix": GRPOFix,
        "gspo": GSPO,
        "gspo-token": GSPOToken,
        "dfpo": DFPO,
        "dfpo-min": lambda **kw: DFPO(**{"transform": "min", **kw}),
        "dfpo-orth": lambda **kw: DFPO(**{"transform": "orth", **kw}),
        "dfpo-scale": lambda **kw: DFPO(**{"transform": "scale", **kw}),
        "ibpo": IBPO,
    }


def names() -> list[str]:
    """The valid objective names (each also takes bracketed parameters, `gradlab.core.variants`)."""
    return list(_registry())


def get(name: str, **params) -> Objective:
    """Build an objective by name, e.g. get("grpo", norm="seq"), get("dfpo", transform="orth").

    `name` may carry bracketed parameters, get("dfpo-orth[nodes=trie]") (gradlab.core.variants);
    they merge with `params` (a key given both ways is an error). Unknown names and parameters
    raise ValueError naming them and listing the valid ones. A user's loss,
    get("my_losses.py:dr_grpo[name=drgrpo]") or get("pkg.losses:dr_grpo"), is loaded
    (`gradlab.core.userobjective.UserObjective`); a missing file or function raises ValueError.
    """
    base, inline = variants.parse(name)
    both = sorted(set(inline) & set(params))
    if both:
        raise ValueError(f"objective {name!r}: parameter(s) {both} given in brackets and as keywords")
    params = {**inline, **params}
    if variants.is_user(name):  # path/file.py:fn or module:fn (gradlab.core.userobjective)
        from .userobjective import UserObjective

        bad = sorted(set(params) - {"name"})
        if bad:
            raise ValueError(f"objective {name!r}: a user loss takes only name=, not {bad}")
        return UserObjective(base, **params)
    reg = _registry()
    if base not in reg:
        raise ValueError(f"unknown objective {name!r}; valid: {', '.join(reg)}"
                         " (each optionally with [key=value, ...])")
    cls = {"dfpo-min": "dfpo", "dfpo-orth": "dfpo", "dfpo-scale": "dfpo"}.get(base, base)
    valid = [p for p in inspect.signature(reg[cls]).parameters if p != "self"]
    bad = [p for p in params if p not in valid]
    if bad:
        raise ValueError(f"objective {name!r}: unknown parameter(s) {bad}; valid: {valid}")
    return reg[base](**params)
