"""The group-relative policy objectives and their closed-form token modulation W.

Every objective is a loss L that depends on θ only through the per-token log-probs l_{i,t},
so ∇θL = −Σ W_{i,t} ∇θ l_{i,t} with W := −∂L/∂l (MATH.md §2). Each objective gives
  .loss(batch)        — the loss written the way a trainer writes it (differentiable in logps),
  .modulation(batch)  — W from the closed form, (B, T), zero at masked positions,
and the tests hold one against the autograd gradient of the other.

Names: "grpo", "grpo-fix", "gspo", "gspo-token", "dfpo" (+ aliases "dfpo-min", "dfpo-orth"),
"ibpo" (gradlab.core.ibpo: token advantages from counterfactual paths over a token-level base).
Advantages may be per sequence (B,) or per token (B, T) (MATH.md §6, "Token advantages in any
objective"); (B,) advantages take the original code path bit for bit.
`.modulation(batch, off=...)` can switch mechanisms off for attribution (MATH.md §3):
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
from .nodes import NODE_KINDS, shared_nodes

NORMS = ("seq", "token", "const")
MECHANISMS = ("coupling", "length", "clip")
CLIPS = ("base", "free")  # DFPO clip readings (MATH.md §5)


def _f(x: Tensor) -> Tensor:
    """Compute in float32 at least (bf16/fp16 inputs), float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _lengths(batch: TokenBatch, off: tuple = ()) -> Tensor:
    """(B,) float — T_i (≥ 1 so an empty row contributes 0, not NaN), or the mean length."""
    T_i = batch.mask.sum(-1).to(_f(batch.logps).dtype)
    if "length" in off:
        pos = T_i[T_i > 0]
        return torch.full_like(T_i, float(pos.mean()) if pos.numel() else 1.0)
    return T_i.clamp(min=1)


def _adv(batch: TokenBatch) -> Tensor:
    """Advantages shaped to broadcast against (B, T): (B, 1) per sequence, (B, T) per token."""
    a = batch.advantages
    return a if a.dim() == 2 else a.unsqueeze(-1)


def _active(adv: Tensor, ratio: Tensor, eps: tuple[float, float]) -> Tensor:
    """PPO clip indicator: False where the clipped branch of min(rA, clip(r)A) is taken."""
    lo, hi = eps
    return ~(((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - lo)))


def _ppo(ratio: Tensor, adv: Tensor, eps: tuple[float, float]) -> Tensor:
    """Per-element PPO surrogate loss −min(rA, clip(r, 1−lo, 1+hi)A)."""
    lo, hi = eps
    return -torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)


class Objective:
    """Base: holds parameters, the KL term and the (loss, stats) call."""

    name = "base"

    def __init__(self, beta: float = 0.0) -> None:
        if beta < 0:
            raise ValueError(f"{self.name}: beta must be ≥ 0, got {beta}")
        self.beta = float(beta)

    # --- to implement --------------------------------------------------------------------
    def norm(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        """(B, T) aggregation weight of each token's loss (0 at masked positions)."""
        raise NotImplementedError

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        raise NotImplementedError

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------
    def prepare(self, batch: TokenBatch) -> TokenBatch:
        """The batch this objective trains on: the identity here; IBPO puts its token
        advantages in. Probes read W's advantages from `prepare(batch)` (c*_n, traces)."""
        return batch

    def loss(self, batch: TokenBatch) -> Tensor:
        """Scalar loss, differentiable w.r.t. batch.logps (values outside the mask are inert)."""
        batch = batch.inert()
        return self.policy_loss(batch) + self._kl_loss(batch)

    def modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        """Closed-form W = −∂loss/∂logps, (B, T) float (≥ float32), 0 at masked positions."""
        bad = set(off) - set(MECHANISMS)
        if bad:
            raise ValueError(f"{self.name}: unknown mechanism(s) {sorted(bad)}; valid: {MECHANISMS}")
        batch = batch.inert()  # NaN/±inf at padded positions change nothing
        with torch.no_grad():
            return self.policy_modulation(batch, tuple(off)) + self._kl_modulation(batch)

    def __call__(self, batch: TokenBatch) -> tuple[Tensor, dict]:
        """(loss, stats) — stats are detached tensors: clip_frac, mean ratio."""
        loss = self.loss(batch)
        with torch.no_grad():
            stats = self.stats(batch)
        return loss, stats

    def stats(self, batch: TokenBatch) -> dict:
        batch = batch.inert()
        m = batch.mask
        r = torch.exp(_f(batch.logps.detach()) - _f(batch.old_logps))
        w = self.policy_modulation(batch)
        w_noclip = self.policy_modulation(batch, ("clip",))
        clipped = (w == 0) & (w_noclip != 0) & m
        n = m.sum().clamp(min=1)
        return {"clip_frac": clipped.sum() / n, "ratio_mean": (r * m).sum() / n}

    def _kl(self, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        if batch.ref_logps is None:
            raise ValueError(f"{self.name}: beta={self.beta} > 0 needs batch.ref_logps")
        return _f(batch.ref_logps) - _f(batch.logps), batch.mask

    def _kl_loss(self, batch: TokenBatch) -> Tensor:
        if self.beta == 0:
            return _f(batch.logps).new_zeros(())
        d, m = self._kl(batch)
        k3 = torch.exp(d) - d - 1  # (B, T) k3 estimator of KL(π_θ ‖ π_ref)
        return self.beta * (k3 * self.norm(batch) * m).sum()

    def _kl_modulation(self, batch: TokenBatch) -> Tensor:
        if self.beta == 0:
            return 0.0
        d, m = self._kl(batch)
        return self.beta * self.norm(batch) * (torch.exp(d) - 1) * m

    def __repr__(self) -> str:
        ps = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{self.name}({ps})"


def _check_eps(name: str, eps) -> tuple[float, float]:
    if isinstance(eps, (int, float)):
        eps = (eps, eps)
    if len(eps) != 2 or min(eps) < 0:
        raise ValueError(f"{name}: eps must be a pair (lo, hi) of non-negative floats, got {eps!r}")
    return float(eps[0]), float(eps[1])


class GRPO(Objective):
    """Token-ratio PPO-clip surrogate with group advantages (MATH.md §2 table).

    norm: "seq" (original GRPO, per-sequence mean then batch mean: 1/(B T_i)),
          "token" (DAPO token mean: 1/Σ_j T_j), "const" (Dr. GRPO: 1/(B T_max), T_max = max_len
          or the batch's T).
    """

    name = "grpo"

    def __init__(self, eps=(0.2, 0.2), norm: str = "token", max_len: int | None = None,
                 beta: float = 0.0) -> None:
        super().__init__(beta)
        self.eps = _check_eps(self.name, eps)
        if norm not in NORMS:
            raise ValueError(f"{self.name}: unknown norm={norm!r}; valid: {NORMS}")
        self.norm_kind, self.max_len = norm, max_len

    def norm(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        m = batch.mask.to(_f(batch.logps).dtype)
        if self.norm_kind == "seq":
            return m / (batch.norm_seqs * _lengths(batch, off)).unsqueeze(-1)
        if self.norm_kind == "token":
            return m / batch.norm_tokens()
        return m / (batch.norm_seqs * (self.max_len or batch.norm_width))

    def ratio(self, batch: TokenBatch) -> Tensor:
        return torch.exp(_f(batch.logps) - _f(batch.old_logps))  # (B, T)

    def active(self, batch: TokenBatch, ratio: Tensor) -> Tensor:
        return _active(_adv(batch), ratio, self.eps)

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        per_token = _ppo(self.ratio(batch), _f(_adv(batch)), self.eps)  # (B, T)
        return (per_token * self.norm(batch)).sum()

    def weight(self, batch: TokenBatch, off: tuple = (), grad: bool = False) -> Tensor:
        """w with W = A·w (MATH.md §5): (B, T) = norm · r · 1[active]."""
        r = self.ratio(batch) if grad else self.ratio(batch).detach()
        act = self.active(batch, r.detach())
        if "clip" in off:
            act = torch.ones_like(act)
        return self.norm(batch, off) * r * act

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        return _f(_adv(batch)) * self.weight(batch, off)


class GRPOFix(GRPO):
    """GRPO-fix — *our reading* (MATH.md §5; the paper does not define it).

    Token-level GRPO with constant length normalisation (1/(B T_max)) and clip decisions made
    per shared node: at a node the ratio is the members' mean, and all members are kept when it
    lies inside [1−lo, 1+hi], all dropped otherwise. Elsewhere the ordinary PPO clip.
    This makes W at a shared token the same multiple of A_i for every member: exchangeable.
    """

    name = "grpo-fix"

    def __init__(self, eps=(0.2, 0.2), nodes: str = "trie", max_len: int | None = None,
                 beta: float = 0.0) -> None:
        super().__init__(eps=eps, norm="const", max_len=max_len, beta=beta)

        if nodes not in NODE_KINDS:
            raise ValueError(f"{self.name}: unknown nodes={nodes!r}; valid: {NODE_KINDS}")
        self.nodes = nodes

    def active(self, batch: TokenBatch, ratio: Tensor) -> Tensor:
        act = super().active(batch, ratio)
        sn = shared_nodes(batch, self.nodes)
        sh = sn.node >= 0
        if sn.n == 0:
            return act
        idx = sn.node[sh]
        r_sum = torch.zeros(sn.n, dtype=ratio.dtype, device=ratio.device).index_add_(0, idx, ratio[sh])
        r_node = r_sum / sn.size.to(ratio.dtype)  # (N,)
        lo, hi = self.eps
        keep = (r_node >= 1 - lo) & (r_node <= 1 + hi)
        return act.masked_scatter(sh, keep[idx])

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        r = self.ratio(batch)
        adv = _f(_adv(batch))
        act = self.active(batch, r.detach())
        lo, hi = self.eps
        per_token = -torch.where(act, r * adv, (r.clamp(1 - lo, 1 + hi) * adv).detach())
        return (per_token * self.norm(batch)).sum()


class GSPO(Objective):
    """GSPO: sequence ratio s_i = exp(mean_t(l − l_old)), sequence clip, mean over sequences.

    W_{i,t} = (1/B)(s_i/T_i) A_i 1[active_i]. Default eps = (3e-4, 4e-4) (GSPO paper).

    Token advantages (B, T), *our reading*: the sequence term becomes the mean over the row's
    tokens of the PPO term with A_{i,t}, (1/T_i) Σ_t −min(s_i A_{i,t}, clip(s_i) A_{i,t}) — the
    value of GSPO-token. The ratio couples the row, so W_{i,u} = (1/B)(s_i/T_i²) Σ_t A_{i,t}
    1[active_{i,t}] is the same on every token of the row: the token credit is averaged away.
    GSPO-token keeps it (W = A_{i,t} w_{i,t}); DFPO over "gspo" uses GSPO-token's w then.
    """

    name = "gspo"

    def __init__(self, eps=(3e-4, 4e-4), beta: float = 0.0) -> None:
        super().__init__(beta)
        self.eps = _check_eps(self.name, eps)

    def norm(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        m = batch.mask.to(_f(batch.logps).dtype)
        return m / (batch.norm_seqs * _lengths(batch, off)).unsqueeze(-1)

    def seq_ratio(self, batch: TokenBatch) -> Tensor:
        """(B,) s_i; with gradient."""
        d = (_f(batch.logps) - _f(batch.old_logps)) * batch.mask
        return torch.exp(d.sum(-1) / _lengths(batch))

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        if batch.advantages.dim() == 2:  # token advantages: the mean of the token terms
            per_tok = _ppo(self.seq_ratio(batch).unsqueeze(-1), _f(batch.advantages), self.eps)
            return (per_tok * self.norm(batch)).sum()
        per_seq = _ppo(self.seq_ratio(batch), _f(batch.advantages), self.eps)  # (B,)
        return per_seq.sum() / batch.norm_seqs

    def weight(self, batch: TokenBatch, off: tuple = (), grad: bool = False) -> Tensor:
        """w with W = A·w: (B, T) = (1/B)(s_i/T_i) 1[active_i] on masked-in positions
        (with token advantages the clip indicator is per token, 1[active_{i,t}])."""
        s = self.seq_ratio(batch) if grad else self.seq_ratio(batch).detach()
        if "coupling" in off:
            s = torch.ones_like(s)
        if batch.advantages.dim() == 2:
            act = _active(batch.advantages, s.detach().unsqueeze(-1), self.eps)  # (B, T)
            if "clip" in off:
                act = torch.ones_like(act)
            return self.norm(batch, off) * s.unsqueeze(-1) * act
        act = _active(batch.advantages, s.detach(), self.eps)
        if "clip" in off:
            act = torch.ones_like(act)
        return self.norm(batch, off) * (s * act).unsqueeze(-1)

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        if batch.advantages.dim() == 2:  # the ratio spreads Σ_t A_t w_t over the row's tokens
            per_row = (_f(batch.advantages) * self.weight(batch, off)).sum(-1, keepdim=True)
            return per_row * batch.mask / _lengths(batch, off).unsqueeze(-1)
        return _f(batch.advantages).unsqueeze(-1) * self.weight(batch, off)


class GSPOToken(GSPO):
    """GSPO-token: s_{i,t} = sg(s_i) · π(y_t)/sg(π(y_t)), token loss, per-sequence mean.

    Same value and the same W as GSPO when advantages are per sequence.
    """

    name = "gspo-token"

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        lp = _f(batch.logps)
        s = self.seq_ratio(batch).detach().unsqueeze(-1)
        s_tok = s * torch.exp(lp - lp.detach())  # (B, T), value s_i
        per_token = _ppo(s_tok, _f(_adv(batch)), self.eps)
        return (per_token * self.norm(batch)).sum()

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        """W_{i,t} = A_{i,t} (1/B)(s_i/T_i) 1[active_{i,t}]: token credit is kept."""
        return _f(_adv(batch)) * self.weight(batch, off)


class DFPO(Objective):
    """DFPO over a base objective (default GSPO).

    transform "min" | "orth" | "scale" (factor), scope "shared" | "all", nodes "prefix" | "trie",
    stop_grad=False is the paper's "no stop-grad" ablation: the literal loss
    L = −Σ A_i w̃_{i,t}(θ) l_{i,t} with gradients flowing through w̃ (through s_i and the min);
    supported for base "gspo" only. The loss value with stop_grad=True equals the base
    objective's loss value (the surrogate only changes the gradient).

    clip (our reading, MATH.md §5; the paper calls DFPO "clip-free" without a formula):
      "base" (default): w carries the base objective's clip indicator (for GSPO w_i = 0 once s_i
          leaves [1−lo, 1+hi]); Min-Replace then zeroes a whole node when one member is clipped.
      "free": no clip indicator anywhere, shared or not: w = the base w with the indicator set
          to 1, so the trust region rests on the stop-gradient weights and the step size alone.
    At full-group nodes both readings give the same parameter gradient (the node adds
    (Σ_i A_i w̃_i)·∇l = 0 whatever w̃ is; tests/test_fair.py); they differ outside shared
    positions and at trie nodes. With clip="free", stats report clip_frac = 0.
    """

    name = "dfpo"

    def __init__(self, base: str = "gspo", transform: str = "min", scope: str = "shared",
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
        adj = transform_vjp(v, batch.advantages, node, n, w, self.transform, self.factor)  # (B, T) = Σ over w̃ of v·∂w̃/∂w
        T_i = batch.mask.sum(-1).clamp(min=1).to(W.dtype)
        w_row = (w * batch.mask).sum(-1) / T_i  # (B,) the row's constant w_j
        per_row = adj.sum(-1) * w_row / T_i  # (B,)
        return W + per_row.unsqueeze(-1) * batch.mask


def _registry() -> dict[str, Callable[..., Objective]]:
    from .ibpo import IBPO  # ibpo builds on the classes above

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
    raise ValueError naming them and listing the valid ones.
    """
    base, inline = variants.parse(name)
    both = sorted(set(inline) & set(params))
    if both:
        raise ValueError(f"objective {name!r}: parameter(s) {both} given in brackets and as keywords")
    params = {**inline, **params}
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
