"""What gradlab's loop records itself, as declared rules like an instrument's quantities:
rollout (reward, accuracy, length, solution forms), groups (split, tied), tokens (entropy,
advantages, an objective's per-token stats) and the rollout layout. The loop's step metrics
turn its sums into these metrics (`gradlab.loop.update.metrics.finalize`), and the run store
reads each rule's `undefined` text as the reason beside a null.
"""

from __future__ import annotations

from .base import Derived, Ratio, div

TOKSUM = "toksum/"  # Σ over tokens of an objective's per-token stat (names known at run time)


def _token_means(s: dict) -> dict:
    """An objective's per-token stats (clip_frac, ratio_mean): Σ over tokens / n_tokens."""
    return {k[len(TOKSUM):]: div(v, s.get("n_tokens", 0)) for k, v in s.items() if k.startswith(TOKSUM)}


def _layout_ratios(s: dict) -> dict:
    """Per-group and per-token figures of the rollout layout (`gradlab.loop.rollouts.layouts`);
    NaN where the denominator is 0 (no group, no generated token, no branch point, no repair
    tried or kept: e.g. edited_per_repair of a run whose repairs all failed)."""
    g = s.get("n_groups", 0)
    return {"distinct_per_group": div(s["distinct_responses"], g),
            "duplicates_per_group": div(s["duplicate_responses"], g),
            "branch_points_per_group": div(s["branch_points"], g),
            "informative_per_group": div(s["informative_points"], g),
            "informative_per_1k": div(1000 * s["informative_points"], s["generated_tokens"]),
            "branch_depth": div(s["branch_depth_sum"], s["branch_points"]),
            "repair_success": div(s["repairs_kept"], s["repairs_tried"]),
            "edited_per_repair": div(s["edited_tokens"], s["repairs_kept"])}


_ROWS = "no row"
# what the loop records itself (not an instrument): rollout, tokens, advantages, layout
OWN_QUANTITIES: list = [
    *(Ratio(name, num, "n_rows", _ROWS, drop_num=True) for name, num in (
        ("reward", "reward_sum"), ("accuracy", "correct"), ("length", "length_sum"),
        ("form0_share", "form0"), ("form1_share", "form1"))),
    Ratio("split_share", "split_groups", "n_groups", "no group", drop_num=True),
    Ratio("zero_std_share", "zero_std_groups", "n_groups", "no group", drop_num=True),
    Ratio("entropy", "entropy_sum", "n_tokens", "no response token", drop_num=True),
    Ratio("adv_nonzero_frac", "adv_nonzero", "n_tokens", "no response token", drop_num=True),
    Ratio("adv_branch_share", "adv_abs_branch_sum", "adv_abs_sum", "every advantage 0",
          drop_num=True, drop_den=True),
    Derived(TOKSUM, _token_means, "no response token", drop_family=True),
    Derived("generated_tokens", _layout_ratios, "no group, token, branch point or repair",
            drop=("branch_depth_sum",)),
]
