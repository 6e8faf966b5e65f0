"""Per-step metrics of the loop: record numbers on the device, sync once per rollout step.

`StepMetrics` only records what the step and the instruments hand it (`gradlab.instruments`:
`Readings`): over the optimizer steps of one rollout batch it keeps sums and counts (never
averages of ratios), combines data-parallel ranks in `finish`, and then turns the totals into
the reported metrics by *declared* rules (`Ratio`, `Derived`: each instrument's `quantities()`,
and `gradlab.instruments.own` for what the loop itself records). So ρ = Σ residual / Σ scale over all the
steps' nodes, and data-parallel ranks report what one process computes on the whole batch
(tests/test_ddp.py holds every metric to it). One exception, by definition: the "length"
counterfactual of attr_length sets T_i to the mean length of the rows the objective sees — under
DDP a rank's own rows — so attr_length is per rank there (`gradlab.core.losses._lengths`).

Undefined is not zero: a ratio whose denominator is 0 is NaN in the store (printed "—" with its
reason by `gradlab.viz.summary`), never 0, which means "measured and cancelled". The sums and
counts it is made of stay in the record (n_shared_prefix, scale_prefix, n_groups, ...), so a
reader can tell which case it was. Counts and sums are numbers, never NaN.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import Tensor

from ...core.batch import TokenBatch
from ...core.credit import branch_tokens
from ...core.nodes import PrefixGrid
from ...instruments import resolve
from ...instruments.own import OWN_QUANTITIES, TOKSUM
from ...instruments.reduce import Reduction
from ...instruments.reduce import finalize as reduce_finalize
from ..rollouts.layouts import layout_sums


class StepMetrics(Reduction):
    """Accumulator for one rollout step of one learner: the instruments' one reduction
    (`gradlab.instruments.reduce.Reduction`) plus what the loop records itself."""

    def __init__(self, D=None, quantities: list | None = None) -> None:
        from ..scale.dist import Dist

        super().__init__(summed_means=("loss",))
        self.D = D if D is not None else Dist()
        self.quantities: list = list(OWN_QUANTITIES)  # how `finish` turns sums into metrics
        self._declared = {id(q): q for q in self.quantities}  # holds them: ids stay unique
        self.declare(quantities or [])
        self.times: dict[str, float] = defaultdict(float)

    def declare(self, quantities: list) -> None:
        """Add finalize rules (an instrument's `quantities()`); a rule declared twice counts once
        (the same objects every step: an identity check, no comparison)."""
        for q in quantities:
            if id(q) not in self._declared:
                self._declared[id(q)] = q
                if q not in self.quantities:
                    self.quantities.append(q)

    def time(self, what: str, since: float) -> None:
        self.times[f"time_{what}"] += time.perf_counter() - since

    def add_basic(self, batch: TokenBatch, ent: Tensor, loss: Tensor, stats: dict) -> None:
        """What any trainer logs: loss, clip figures, token entropy.

        stats: the objective's per-token means over `batch.mask` (clip_frac, ratio_mean), kept
        as token sums (mean × the step's token count) so that `finish` divides the sum over all
        optimizer steps and ranks by their token count: the value one process computes."""
        n = batch.mask.sum()
        self.sums["n_tokens"].append(n)
        self.sums["entropy_sum"].append((ent * batch.mask).sum())
        self.add_scalar("loss", loss)
        for k, v in stats.items():
            self.sums[f"{TOKSUM}{k}"].append(v.detach().double() * n)

    def add_advantages(self, batch: TokenBatch, grid: PrefixGrid | None = None) -> None:
        """Where the trained advantages sit: tokens with A ≠ 0, and |A| mass at branch tokens
        (a token whose parent trie node branches: IBPO's comparisons live there). grid: the
        batch's `prefix_grid` when the step has it already (the instruments' nodes share it)."""
        A, m = batch.adv_tokens.detach().abs() * batch.mask, batch.mask
        branch = branch_tokens(batch.tokens, batch.mask, batch.group, grid)
        self.sums["adv_nonzero"].append(((A > 0) & m).sum())
        self.sums["adv_abs_sum"].append(A.double().sum())
        self.sums["adv_abs_branch_sum"].append((A * branch).double().sum())

    def finish(self) -> dict:
        """One host sync: reduce everything to floats, then combine data-parallel ranks:
        sums and counts add, maxima max, then the declared rules. Per-step scalars
        (grad_norm, tax_*: the same on every rank) pool over all ranks' optimizer steps; the
        loss adds (each rank's part of a global minibatch loss is a share of it)."""
        return super().finish(self.quantities, self.D.gather)

    def add_rollout(self, task, ro, parts: list[Tensor]) -> None:
        """Reward, accuracy, length, solution forms and split groups of the rollout, as sums
        and counts (reduced over ranks in `finish`)."""
        # reward, accuracy, forms and length describe the policy's own samples: repairs
        # (`ro.repair_of` ≥ 0) are trained on but not counted here
        own = ro if ro.repair_of is None else ro.rows(ro.repair_of < 0)
        correct = [task.is_correct(p, t) for p, t in zip(own.problems, own.texts)]
        forms = [task.solution_form(p, t) for p, t in zip(own.problems, own.texts)]
        step_of = torch.empty_like(ro.group)
        for k, rows in enumerate(parts):
            step_of[rows] = k
        labels = torch.unique(ro.group)
        spread = [torch.unique(step_of[ro.group == g]).numel() > 1 for g in labels]
        zero_std = [bool((ro.rewards[ro.group == g] == ro.rewards[ro.group == g][0]).all())
                    for g in labels]
        for k, v in {"reward_sum": own.rewards.sum(), "n_rows": len(correct),
                     "correct": sum(correct), "form0": forms.count(0), "form1": forms.count(1),
                     "length_sum": own.response_mask.sum(), "n_groups": len(labels),
                     "split_groups": sum(spread), "zero_std_groups": sum(zero_std),
                     **layout_sums(ro)}.items():
            self.sums[k].append(v)


def finalize(totals: dict, quantities: list | None = None) -> dict:
    """The reported metrics of reduced sums (`gradlab.instruments.reduce.finalize`), by default
    with the loop's own rules and every built-in instrument's (`resolve("full")`)."""
    if quantities is None:
        quantities = OWN_QUANTITIES + [q for i in resolve("full,same_batch") for q in i.quantities()]
    return reduce_finalize(totals, quantities)
