"""What gradlab's loop records itself, as declared rules like an instrument's quantities:
rollout (reward, accuracy, length, solution forms), groups (split, tied), tokens (entropy,
advantages, an objective's per-token stats) and the rollout layout. The loop's step metrics
turn its sums into these metrics (`gradlab.loop.update.metrics.finalize`). With the loop's
other records (`OWN_RECORDS`) and curves (`OWN_CURVES`) they make the entry "loop" of the
run's `instruments.json` (`gradlab.instruments.manifest`): each metric's unit and the reason
beside a null, as the run store and `gradlab view` read them.
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
_TOKENS = "no response token"
# what the loop records itself (not an instrument): rollout, tokens, advantages, layout
OWN_QUANTITIES: list = [
    *(Ratio(name, num, "n_rows", _ROWS, drop_num=True, unit=unit) for name, num, unit in (
        ("reward", "reward_sum", "reward"), ("accuracy", "correct", "share"),
        ("length", "length_sum", "tokens"), ("form0_share", "form0", "share"),
        ("form1_share", "form1", "share"))),
    Ratio("split_share", "split_groups", "n_groups", "no group", drop_num=True, unit="share"),
    Ratio("zero_std_share", "zero_std_groups", "n_groups", "no group", drop_num=True, unit="share"),
    Ratio("entropy", "entropy_sum", "n_tokens", _TOKENS, drop_num=True, unit="nats"),
    Ratio("adv_nonzero_frac", "adv_nonzero", "n_tokens", _TOKENS, drop_num=True, unit="share"),
    Ratio("adv_branch_share", "adv_abs_branch_sum", "adv_abs_sum", "every advantage 0",
          drop_num=True, drop_den=True, unit="share"),
    Derived(TOKSUM, _token_means, _TOKENS, drop_family=True, unit="per token"),
    Derived("generated_tokens", _layout_ratios, "no group, token, branch point or repair",
            drop=("branch_depth_sum",), unit="per group or token"),
]

# the objective's per-token stats every built-in objective reports (the `toksum/` rule's
# metrics; a user objective's other stats are named at run time)
TOKEN_STATS = {"clip_frac": "share", "ratio_mean": "ratio"}
# what else the loop writes into each step's record: metric (or family, ending "_" or "/")
# → (unit, when it is undefined; "" where it always has a value)
OWN_RECORDS: dict[str, tuple[str, str]] = {
    "loss": ("loss", ""), "grad_norm": ("norm", ""), "nonfinite_steps": ("count", ""),
    "n_rows": ("count", ""), "n_groups": ("count", ""), "n_tokens": ("count", ""),
    "trained_tokens": ("count", ""), "generated_tokens": ("count", ""),
    "distinct_responses": ("count", ""), "duplicate_responses": ("count", ""),
    "branch_points": ("count", ""), "informative_points": ("count", ""),
    "repairs_tried": ("count", ""), "repairs_kept": ("count", ""), "edited_tokens": ("count", ""),
    "probe_kl": ("nats", "no probe context"), "logodds": ("nats", "no probe pair"),
    "logodds_abs": ("nats", "no probe pair"), "forms_entropy": ("nats", "no probe pair"),
    "eval_": ("share", "no held-out problem"), "time_": ("s", ""),
}
# (metric, title) of the curves `gradlab view` draws of the loop's own records
OWN_CURVES: tuple[tuple[str, str], ...] = (
    ("accuracy", "training accuracy"),
    ("reward", "reward"),
    ("probe_kl", "cumulative KL at shared probe contexts"),
    ("entropy", "token entropy"),
    ("logodds", "equal-solution log-odds log π(a)/π(b)"),
)
