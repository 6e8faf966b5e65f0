"""IBPO token advantages for TRL's `GRPOTrainer` (trie reading, *ours*: docs/concepts/ibpo.md#reading-1-values-on-the-groups-prefix-trie).

`GradlabConfig(loss="ibpo[form=togo,reweight=sqrt]")`: after TRL scores a generation batch, its
(B,) GRPO advantages are replaced by (B, T) IBPO token advantages computed from the same
rewards (Σ_k weight_k · reward_k, the rewards TRL logs) and the completion token ids, per group;
TRL's `_compute_loss` takes (B, T) advantages as they are, so the loss that runs is TRL's own
`loss_type` / `importance_sampling_level` on A_{i,t}. Parameters: form ga | la | ga+la (default)
| togo, reweight none | sqrt, scale group | batch | none (default: TRL's `scale_rewards`, whose
divisor is gradlab's `reward_scale` with TRL's eps 1e-4). The repair form needs repair rollouts,
which TRL does not make; base, eps and norm belong to TRL's loss (`loss_type`, `epsilon`).
Under several processes a group's completions may sit on different processes: the advantages are
computed on the generation batch gathered from all of them, and each keeps its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...core import variants
from ...core.batch import ADVANTAGE_SCALES
from ...core.credit import FORMS, REWEIGHTS, process_advantages, reward_scale
from .window import reconstruct_groups

TRL_EPS = 1e-4  # TRL's (R − mean) / (std + 1e-4)


@dataclass(frozen=True)
class IBPOLoss:
    """A parsed `ibpo[...]` loss: trie form, reweight, scale (None = TRL's scale_rewards)."""

    form: str = "ga+la"
    reweight: str = "none"
    scale: str | None = None

    def token_advantages(self, tokens: Tensor, mask: Tensor, group: Tensor, rewards: Tensor,
                         scale_rewards: str) -> Tensor:
        """(B, T) A_{i,t} = process_advantages ÷ reward_scale, 0 where mask is False.

        tokens (B, T) long completion ids, mask (B, T) bool, group (B,) long, rewards (B,)."""
        A = process_advantages(tokens, mask, group, rewards, self.form, self.reweight)
        div = reward_scale(rewards, group, self.scale or scale_rewards, eps=TRL_EPS)
        return A / div.to(A.dtype).unsqueeze(-1)


def parse_loss(spec: str) -> IBPOLoss:
    """'ibpo' or 'ibpo[form=togo, reweight=sqrt, scale=none]' → IBPOLoss; ValueError naming the
    fault otherwise."""
    name, params = variants.parse(spec)
    if name != "ibpo":
        raise ValueError(f"GradlabConfig: loss={spec!r}; valid: None (TRL's own advantages) or "
                         "'ibpo[form=..., reweight=..., scale=...]'")
    valid = {"form": FORMS, "reweight": REWEIGHTS, "scale": ADVANTAGE_SCALES}
    for key, val in params.items():
        if key not in valid:
            why = ("TRL makes no repair rollouts" if key == "lam" else
                   "the loss is TRL's own (loss_type, importance_sampling_level, epsilon)")
            raise ValueError(f"GradlabConfig: loss={spec!r}: parameter {key!r} not valid here "
                             f"({why}); valid: {sorted(valid)}")
        if val not in valid[key]:
            extra = " (repair needs repair rollouts, which TRL does not make)" if val == "repair" else ""
            raise ValueError(f"GradlabConfig: loss={spec!r}: {key}={val!r}; valid: "
                             f"{valid[key]}{extra}")
    return IBPOLoss(**params)


def check_trainer(trainer, loss: str) -> None:
    """Refuse trainer settings IBPO cannot serve (one-line errors naming them)."""
    if trainer.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(f"gradlab loss={loss!r}: multi_objective_aggregation="
                         f"{trainer.multi_objective_aggregation!r}; IBPO reads the summed "
                         "rewards: use 'sum_then_normalize'")


def local_advantages(trainer, per_func: Tensor, out: dict, mask: Tensor, group: Tensor) -> Tensor:
    """(B, T) IBPO token advantages of this process's rows of a generation batch.

    per_func (B_all, n_funcs): TRL's rewards of every process's rows (rank-major, as TRL gathers
    them); out: TRL's batch of this process (completion_ids (B, T), prompt_ids / prompt_mask,
    left-padded); mask (B, T) bool; group (B,) local labels. With several processes the trie of
    a group needs all its completions: ids, masks and prompts are gathered (padded to the
    longest), the advantages computed on the whole batch, and this process's block returned."""
    acc, tok = trainer.accelerator, out["completion_ids"]
    if acc.num_processes == 1:
        return trainer_advantages(trainer, per_func, tok, mask, group)

    def g(v: Tensor, left: bool = False) -> Tensor:
        return acc.gather(acc.pad_across_processes(v.long(), dim=1, pad_first=left))

    groups = reconstruct_groups(g(out["prompt_ids"], True), g(out["prompt_mask"], True),
                                trainer.num_generations)
    A = trainer_advantages(trainer, per_func, g(tok), g(mask).bool(), groups)
    B, T = tok.shape
    r = acc.process_index
    return A[r * B:(r + 1) * B, :T]  # columns past T: this process's padding (A = 0 there)


def trainer_advantages(trainer, per_func: Tensor, tokens: Tensor, mask: Tensor,
                       group: Tensor) -> Tensor:
    """(B, T) IBPO token advantages of a generation batch from TRL's rewards per function
    (B, n_funcs) (R = Σ_k weight_k · reward_k, as TRL sums them), with `trainer.gradlab.loss`."""
    R = (per_func * trainer.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
    bad = torch.isnan(per_func).all(dim=1).nonzero()
    if bad.numel():
        raise ValueError(f"gradlab loss={trainer.gradlab.loss!r}: completion {int(bad[0])} has "
                         "no reward (every reward function returned None); IBPO needs one")
    return trainer.gradlab.ibpo.token_advantages(tokens, mask, group.to(R.device), R,
                                                 trainer.scale_rewards)
