"""IBPO: a token-level base objective trained on implicit process-level advantages.

The objective reads the batch's terminal `rewards` (and, for the repair form, `repair_of`),
builds token advantages with `gradlab.core.credit` and hands them to its base: token-level GRPO
(default) or GSPO-token, so W_{i,t} = A_{i,t} w_{i,t} (docs/concepts/ibpo.md). Every form is *our reading*:
the authors describe comparing paths of one input and crediting the tokens a correction edited;
the formulas are not public. `batch.advantages` is ignored: `prepare(batch)` replaces it with
the token advantages, and that is what the probes read (c*_n, traces).
"""

from __future__ import annotations

import math

from torch import Tensor

from .batch import ADVANTAGE_SCALES, TokenBatch
from .credit import FORMS, REWEIGHTS, process_advantages, repair_advantages, reward_scale
from .losses import GRPO, NORMS, GSPOToken, Objective


class IBPO(Objective):
    """IBPO over a token-level base (*ours*, docs/concepts/ibpo.md).

    form: "ga", "la", "ga+la" (default), "togo" — trie readings (6a); "repair" — the repair
      reading (6b), which needs `batch.repair_of` (repair rollouts, `--rollout repair`).
    reweight: "none" | "sqrt" (trie forms). lam: the repair mix λ ∈ [0, 1] (default 0.5).
    la_weight: form "ga+la" only, A = ga + la_weight · la (default 1; 0 gives "ga", i.e. GRPO's
      advantage on every token): the dose of the local term, for asking whether it carries a gain.
    base: "grpo" (token ratio, PPO clip, `norm` and `max_len` as GRPO) or "gspo" (GSPO-token:
      sequence ratio, per-token credit kept). eps: the base's clip range (its default if None).
    scale: advantages divided like `gradlab.advantages` — "group" (the default), "batch",
      "none"; None = "group" for direct use, and the loop's --adv-scale in a run.
    """

    name = "ibpo"

    def __init__(self, form: str = "ga+la", reweight: str = "none", *, lam: float = 0.5,
                 base: str = "grpo", eps=None, norm: str = "token", max_len: int | None = None,
                 scale: str | None = None, beta: float = 0.0, la_weight: float = 1.0) -> None:
        super().__init__(beta)
        for arg, val, valid in (("form", form, FORMS + ("repair",)),
                                ("reweight", reweight, REWEIGHTS), ("base", base, ("grpo", "gspo")),
                                ("norm", norm, NORMS)):
            if val not in valid:
                raise ValueError(f"ibpo: unknown {arg}={val!r}; valid: {valid}")
        if scale is not None and scale not in ADVANTAGE_SCALES:
            raise ValueError(f"ibpo: unknown scale={scale!r}; valid: {ADVANTAGE_SCALES}")
        if not 0.0 <= float(lam) <= 1.0:
            raise ValueError(f"ibpo: lam must be in [0, 1], got {lam}")
        if not (math.isfinite(float(la_weight)) and float(la_weight) >= 0):
            raise ValueError(f"ibpo: la_weight must be a finite number ≥ 0, got {la_weight}")
        if float(la_weight) != 1.0 and form != "ga+la":
            raise ValueError(f"ibpo: la_weight weighs the la term of form 'ga+la'; form={form!r}")
        if base == "gspo" and (norm != "token" or max_len is not None):
            raise ValueError("ibpo: norm and max_len belong to base='grpo' (GSPO-token "
                             "normalises per sequence)")
        kw = {} if eps is None else {"eps": eps}
        self.base = GRPO(norm=norm, max_len=max_len, **kw) if base == "grpo" else GSPOToken(**kw)
        self.form, self.reweight, self.lam, self.scale = form, reweight, float(lam), scale
        self.la_weight = float(la_weight)
        self._cache = None  # (key, the tensors it was made from, A (B, T))

    def token_advantages(self, batch: TokenBatch) -> Tensor:
        """(B, T) A_{i,t}: the form's raw advantages ÷ the reward scale, 0 where masked."""
        if batch.rewards is None:
            raise ValueError("ibpo: the batch has no rewards; IBPO builds its token advantages "
                             "from TokenBatch.rewards (B,)")
        args = (batch.tokens, batch.mask, batch.group, batch.rewards)
        if self.form == "repair":
            if batch.repair_of is None:
                raise ValueError("ibpo[form=repair] reads TokenBatch.repair_of, and this batch "
                                 "has none: train on repair rollouts (--rollout repair)")
            A = repair_advantages(*args, batch.repair_of, self.lam)
        else:
            A = process_advantages(*args, form=self.form, reweight=self.reweight,
                                   la_weight=self.la_weight)
        div = reward_scale(batch.rewards, batch.group, self.scale or "group").to(A.dtype)
        return A / div.unsqueeze(-1)

    def prepare(self, batch: TokenBatch) -> TokenBatch:
        # One-entry cache: a step calls prepare for the loss, W, the residuals and the stats on
        # batches that differ only in logps; A depends on tokens, mask, group, rewards, repair_of.
        parts = (batch.tokens, batch.mask, batch.group, batch.rewards, batch.repair_of)
        key = (tuple(None if x is None else x._version for x in parts),
               self.form, self.reweight, self.lam, self.scale, self.la_weight)
        if self._cache is None or self._cache[0] != key or any(
                a is not b for a, b in zip(self._cache[1], parts)):
            self._cache = (key, parts, self.token_advantages(batch))
        return batch.replace(advantages=self._cache[2], validate=False)

    def norm(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        return self.base.norm(batch, off)

    def weight(self, batch: TokenBatch, off: tuple = (), grad: bool = False) -> Tensor:
        return self.base.weight(self.prepare(batch), off, grad)

    def policy_loss(self, batch: TokenBatch) -> Tensor:
        return self.base.policy_loss(self.prepare(batch))

    def policy_modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        return self.base.policy_modulation(self.prepare(batch), off)

    def stats(self, batch: TokenBatch) -> dict:
        return self.base.stats(self.prepare(batch))
