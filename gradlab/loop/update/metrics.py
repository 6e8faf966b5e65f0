"""Per-step metrics of the loop: record numbers on the device, sync once per rollout step.

`StepMetrics` only records what the step and the probes hand it: over the optimizer steps of
one rollout batch it keeps sums and counts (never averages of ratios), so ρ = Σ residual /
Σ mass over all the steps' nodes, and combines data-parallel ranks in `finish`.

A ratio is a sum over all optimizer steps and ranks divided by another, so data-parallel ranks
report what one process computes on the whole batch (tests/test_ddp.py holds every metric to it):
clip_frac and ratio_mean are token means over the rollout step's response tokens (Σ clipped /
Σ tokens, Σ r / Σ tokens); attr_<mechanism> = Σ(res − res_off) / Σ res over the tax steps'
full-group nodes (a residual-weighted mean: on-policy steps whose residual is float noise weigh
~0), attr_residual = Σ res. One exception, by definition: the "length" counterfactual of
attr_length sets T_i to the mean length of the rows the objective sees — under DDP a rank's own
rows — so attr_length is per rank there (`gradlab.core.losses._lengths`).

Undefined is not zero: a ratio whose denominator is 0 is NaN in the store (printed "—" with its
reason by `gradlab.viz.summary`), never 0, which means "measured and cancelled". The sums and
counts it is made of stay in the record (n_shared_prefix, scale_prefix, n_groups, ...), so a
reader can tell which case it was. Counts and sums are numbers, never NaN.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import torch
from torch import Tensor

from ...core.batch import TokenBatch
from ...core.credit import branch_tokens
from ...probes.flips import PREFIX as FLIPS
from ...probes.flips import flip_shares
from ..rollouts.layouts import layout_sums

TOKSUM = "toksum/"  # Σ over tokens of a per-token stat; `_ratios` divides by n_tokens


class StepMetrics:
    """Accumulator for one rollout step of one learner."""

    def __init__(self, D=None) -> None:
        from ..scale.dist import Dist

        self.D = D if D is not None else Dist()
        self.sums: dict[str, list[Tensor]] = defaultdict(list)  # summed at finish
        self.means: dict[str, list] = defaultdict(list)  # averaged at finish
        # means over the steps where the value is defined: name → (B,) flags beside `means`
        self.defined: dict[str, list] = defaultdict(list)
        self.maxes: dict[str, list[Tensor]] = defaultdict(list)
        self.times: dict[str, float] = defaultdict(float)

    def time(self, what: str, since: float) -> None:
        self.times[f"time_{what}"] += time.perf_counter() - since

    def add_scalar(self, name: str, v, defined=None) -> None:
        """A per-step value, averaged over the rollout step's optimizer steps in `finish`.

        defined: a 0-dim bool (tensor) when v can be undefined (a share whose denominator is
        0): the mean then runs over the steps where it is defined only, and is NaN when none
        is. A NaN of a non-finite input keeps defined=True, so it stays NaN in the mean."""
        v = v.detach() if torch.is_tensor(v) else v
        if defined is not None:
            d = torch.as_tensor(defined)
            v = torch.where(d, torch.as_tensor(v), 0)  # an undefined step adds nothing
            self.defined[name].append(d)
        self.means[name].append(v)

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

    def add_advantages(self, batch: TokenBatch) -> None:
        """Where the trained advantages sit: tokens with A ≠ 0, and |A| mass at branch tokens
        (a token whose parent trie node branches: IBPO's comparisons live there)."""
        A, m = batch.adv_tokens.detach().abs() * batch.mask, batch.mask
        branch = branch_tokens(batch.tokens, batch.mask, batch.group)
        self.sums["adv_nonzero"].append(((A > 0) & m).sum())
        self.sums["adv_abs_sum"].append(A.double().sum())
        self.sums["adv_abs_branch_sum"].append((A * branch).double().sum())

    def record(self, r) -> None:
        """A `gradlab.probes.StepReadings` of one optimizer step: sums add, maxima max."""
        for k, v in r.sums.items():
            self.sums[k].append(v)
        for k, v in r.maxes.items():
            self.maxes[k].append(v)
        for k, v in r.means.items():
            self.add_scalar(k, v)

    def add_tax(self, d: dict) -> None:
        """`learning_tax` output: overall figures and tax_share/<layer group>.

        tax_share (‖g_tax‖ / ‖g‖) is undefined on a step with g = 0 and tax_cos on a step
        with g_tax = 0 or g = 0: each is averaged over the steps where it is defined (NaN
        when there is none); the norms are means over every step."""
        for k in ("tax_norm", "total_norm"):
            self.add_scalar(k, d[k])
        self.add_scalar("tax_share", d["tax_share"], d["total_norm"] != 0)
        self.add_scalar("tax_cos", d["tax_cos"], d["tax_norm"] * d["total_norm"] != 0)
        for group, g in d["groups"].items():
            self.add_scalar(f"tax_share/{group}", g["tax_share"], g["total_norm"] != 0)

    def add_drift(self, d: dict) -> None:
        """`node_drift` output: sums and counts, turned into means over the rollout step."""
        for k, v in d.items():
            if k.endswith("_sum") or k.endswith("_count"):
                self.sums[f"drift_{k}"].append(v)

    def finish(self) -> dict:
        """One host sync: reduce everything to floats, then combine data-parallel ranks:
        sums and counts add, maxima max, then ratios of the totals (`_ratios`). Per-step
        scalars (grad_norm, tax_*: the same on every rank) pool over all ranks' optimizer
        steps; the loss adds (each rank's part of a global minibatch loss is a share of it)."""
        def f64(v):
            return torch.stack([torch.as_tensor(x, dtype=torch.float64).cpu() for x in v])

        sums = {k: f64(v).sum() for k, v in self.sums.items()}
        means = {k: torch.stack([f64(v).sum(), f64(self.defined[k]).sum() if k in self.defined
                                 else torch.tensor(float(len(v)))])
                 for k, v in self.means.items()}
        maxes = {k: f64(v).max() for k, v in self.maxes.items()}
        flat = torch.stack(list(sums.values()) + [x for v in means.values() for x in v] +
                           list(maxes.values())).tolist() if (sums or means or maxes) else []
        it = iter(flat)
        local = ({k: next(it) for k in sums}, {k: (next(it), next(it)) for k in means},
                 {k: next(it) for k in maxes})
        out: dict = {}
        parts = self.D.gather(local)
        for s_, _, _ in parts:
            for k, v in s_.items():
                out[k] = out.get(k, 0.0) + v
        pooled: dict = {}
        for _, m_, _ in parts:
            for k, (tot, n) in m_.items():
                a, b = pooled.get(k, (0.0, 0.0))
                pooled[k] = (a + (tot / n if k == "loss" else tot), b + (1 if k == "loss" else n))
        # b = 0: no step where the value is defined (`add_scalar`), so the mean is undefined
        out.update({k: (a if k == "loss" else a / b if b else math.nan)
                    for k, (a, b) in pooled.items()})
        for _, _, x_ in parts:
            for k, v in x_.items():
                old = out.get(k, -float("inf"))
                out[k] = math.nan if math.isnan(old) or math.isnan(v) else max(old, v)
        return _ratios(out)

    def add_rollout(self, task, ro, parts: list[Tensor]) -> None:
        """Reward, accuracy, length, solution forms and split groups of the rollout, as sums
        and counts (reduced over ranks in `finish`)."""
        # reward, accuracy, forms and length describe the policy's own samples: repairs
        # (`ro.repair_of` ≥ 0) are trained on but not counted here
        own = list(range(len(ro.texts))) if ro.repair_of is None else \
            (ro.repair_of < 0).nonzero().squeeze(-1).tolist()
        correct = [task.is_correct(ro.problems[i], ro.texts[i]) for i in own]
        forms = [task.solution_form(ro.problems[i], ro.texts[i]) for i in own]
        step_of = torch.empty_like(ro.group)
        for k, rows in enumerate(parts):
            step_of[rows] = k
        labels = torch.unique(ro.group)
        spread = [torch.unique(step_of[ro.group == g]).numel() > 1 for g in labels]
        zero_std = [bool((ro.rewards[ro.group == g] == ro.rewards[ro.group == g][0]).all())
                    for g in labels]
        for k, v in {"reward_sum": ro.rewards[own].sum(), "n_rows": len(correct),
                     "correct": sum(correct), "form0": forms.count(0), "form1": forms.count(1),
                     "length_sum": ro.response_mask[own].sum(), "n_groups": len(labels),
                     "split_groups": sum(spread), "zero_std_groups": sum(zero_std),
                     **layout_sums(ro)}.items():
            self.sums[k].append(v)


def div(a: float, b: float) -> float:
    """a / b, or NaN where it is undefined: b = 0 (nothing to divide by) or either side NaN
    (a metric of a non-finite W). Never 0 for "undefined": 0 means measured and cancelled."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def _ratios(s: dict) -> dict:
    """Turn accumulated sums into the reported ratios; each is NaN where its denominator is 0:

    rho_<kind> = Σ residual / Σ scale: no node of the kind (n_shared_<kind> = 0: no full-group
      token) or W ≡ 0 at its nodes (every group tied: no gradient there);
    drift_*_mean: no position of the kind (its count is 0);
    reward, accuracy, length, form*_share: no row; split_share, zero_std_share, *_per_group:
      no group; clip_frac, ratio_mean, adv_nonzero_frac, shared_frac_*, entropy: no token;
      entropy_shared: no full-group token; adv_branch_share: every advantage 0;
    attr_<mechanism>: the residual Σ|d| is 0 (nothing to attribute);
    `_layout_ratios`: per generated token, per branch point, per repair tried / kept;
    flips/<sign>/<kind>/<conf>/*_share, dlogp_mean: no token in the cell
      (`gradlab.probes.flips.flip_shares`; flipped_share of A = 0 tokens: always, no sign).
    The counts and sums they are made of stay in the record as numbers.
    """
    out = dict(s)

    for key in list(s):
        if key.endswith("residual_prefix") or key.endswith("residual_trie"):
            pre, kind = key.rsplit("residual_", 1)
            out[f"{pre}rho_{kind}"] = div(s[key], s[f"{pre}scale_{kind}"])
    for key in list(s):
        if key.startswith("drift_") and key.endswith("_sum"):
            stem = key[: -len("_sum")]
            where, _ = stem.rsplit("_", 1)  # drift_node_kl → its own count, else drift_node's
            count = s.get(f"{stem}_count", s.get(f"{where}_count", 0))
            out[f"{stem}_mean"] = div(s[key], count)
    if "n_rows" in s:
        r = s["n_rows"]
        out.update({"reward": div(s["reward_sum"], r), "accuracy": div(s["correct"], r),
                    "length": div(s["length_sum"], r), "form0_share": div(s["form0"], r),
                    "form1_share": div(s["form1"], r),
                    "split_share": div(s["split_groups"], s["n_groups"]),
                    "zero_std_share": div(s["zero_std_groups"], s["n_groups"])})
        for k in ("reward_sum", "correct", "length_sum", "form0", "form1", "split_groups",
                  "zero_std_groups"):
            out.pop(k)
    if "generated_tokens" in s:
        out.update(_layout_ratios(s, out, div))
    n = s.get("n_tokens", 0)
    for key in [k for k in s if k.startswith(TOKSUM)]:  # clip_frac, ratio_mean: token means
        out[key[len(TOKSUM):]] = div(out.pop(key), n)
    # attribution shares: Σ(res − res_off) / Σ res over the step's nodes (a residual-weighted
    # mean, so on-policy steps whose residual is float noise weigh ~0)
    for key in [k for k in s if k.startswith("attr_") and k.endswith("_sum")]:
        out[key[: -len("_sum")]] = div(out.pop(key), s["attr_residual"])
    if "adv_nonzero" in s:
        out["adv_nonzero_frac"] = div(out.pop("adv_nonzero"), n)
        out["adv_branch_share"] = div(out.pop("adv_abs_branch_sum"), out.pop("adv_abs_sum"))
    for kind in ("prefix", "trie"):
        if f"n_shared_{kind}" in s:
            out[f"shared_frac_{kind}"] = div(s[f"n_shared_{kind}"], n)
    if "entropy_sum" in s:
        out["entropy"] = div(out.pop("entropy_sum"), n)
    if "entropy_shared_sum" in s:
        out["entropy_shared"] = div(out.pop("entropy_shared_sum"), s.get("n_shared_prefix", 0))
    if any(k.startswith(FLIPS) for k in s):  # token-flip ledger (runs with flips on only)
        out.update(flip_shares(s))
    return out


def _layout_ratios(s: dict, out: dict, div) -> dict:
    """Per-group and per-token figures of the rollout layout (`gradlab.loop.rollouts.layouts`);
    NaN where the denominator is 0 (no group, no generated token, no branch point, no repair
    tried or kept: e.g. edited_per_repair of a run whose repairs all failed)."""
    g = s.get("n_groups", 0)
    out.pop("branch_depth_sum")
    return {"distinct_per_group": div(s["distinct_responses"], g),
            "duplicates_per_group": div(s["duplicate_responses"], g),
            "branch_points_per_group": div(s["branch_points"], g),
            "informative_per_group": div(s["informative_points"], g),
            "informative_per_1k": div(1000 * s["informative_points"], s["generated_tokens"]),
            "branch_depth": div(s["branch_depth_sum"], s["branch_points"]),
            "repair_success": div(s["repairs_kept"], s["repairs_tried"]),
            "edited_per_repair": div(s["edited_tokens"], s["repairs_kept"])}
