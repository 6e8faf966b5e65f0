"""The ratio-based group-relative losses: the `Objective` interface, GRPO (and its
length-fixed variant) and GSPO (sequence- and token-level), each with its closed-form W.

The registry, DFPO and IBPO build on these (gradlab.core.objectives, .dfpo, .ibpo); see
gradlab.core.objectives for the contract every objective keeps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batch import TokenBatch
from .nodes import NODE_KINDS, shared_nodes

NORMS = ("seq", "token", "const")
MECHANISMS = ("coupling", "length", "clip")
CLIPS = ("base", "free")  # DFPO clip readings (docs/concepts/dfpo.md)


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
    """Token-ratio PPO-clip surrogate with group advantages (docs/concepts/modulation.md#closed-forms).

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
        """w with W = A·w (docs/concepts/dfpo.md): (B, T) = norm · r · 1[active]."""
        r = self.ratio(batch) if grad else self.ratio(batch).detach()
        act = self.active(batch, r.detach())
        if "clip" in off:
            act = torch.ones_like(act)
        return self.norm(batch, off) * r * act

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        return _f(_adv(batch)) * self.weight(batch, off)


class GRPOFix(GRPO):
    """GRPO-fix — *our reading* (docs/concepts/modulation.md#objectives-and-their-parameters; the paper does not define it).

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
        s_real = s.detach()  # the clip indicator reads the real s_i whatever is switched off
        if "coupling" in off:
            s = torch.ones_like(s)
        if batch.advantages.dim() == 2:
            act = _active(batch.advantages, s_real.unsqueeze(-1), self.eps)  # (B, T)
            if "clip" in off:
                act = torch.ones_like(act)
            return self.norm(batch, off) * s.unsqueeze(-1) * act
        act = _active(batch.advantages, s_real, self.eps)
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
