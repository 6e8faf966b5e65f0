"""Helpers for testing RL losses against cancellation — gradlab's own tests and yours.

`random_batch` builds groups whose responses share a prefix and branch into a trie, with
log-probs that depend only on the history (as a real policy's do), so shared tokens carry
identical log-probs across the group. `measure_modulation` reads W = −∂loss/∂logps the way a
backward hook on the log-prob tensor does. `assert_cancels` / `assert_does_not_cancel` guard a
loss in CI:

    from gradlab.testing import assert_cancels
    def test_my_loss_cancels():
        assert_cancels(lambda b: my_loss(b.logps, b.old_logps, b.advantages, b.mask))
"""
from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from .check.scenarios import (
    REGIMES,
    TRAINING_DEFAULTS,
    loop_step_on,
    measure_modulation,
    measure_on_model,
    optimizer_step_on,
    random_batch,
    training_defaults,
)
from .core.batch import TokenBatch
from .core.cancellation import Cancellation, cancellation

# the assertions, and the batches, regimes and optimizer steps they are built on
# (gradlab/check/scenarios.py), for your tests
__all__ = [
    "REGIMES", "TRAINING_DEFAULTS", "assert_cancels", "assert_cancels_in_regimes",
    "assert_does_not_cancel", "assert_matches_baseline", "loop_step_on", "measure_modulation",
    "measure_on_model", "optimizer_step_on", "random_batch", "regime_report", "training_defaults",
]


def _reports(loss_fn, seeds, nodes, **batch_kw) -> list[tuple[int, Cancellation]]:
    out = []
    for s in seeds:
        b = random_batch(seed=s, **batch_kw)
        out.append((s, cancellation(measure_modulation(loss_fn, b), b, nodes)))
    return out


def assert_cancels(loss_fn: Callable[[TokenBatch], Tensor], seeds=range(5), tol: float = 1e-9,
                   nodes: str = "prefix", **batch_kw) -> None:
    """Assert the full-group shared-token gradient of `loss_fn` cancels (ρ ≤ tol).

    loss_fn(batch) → scalar loss built from batch.logps. Batches come from `random_batch`
    (float64, unequal lengths, shuffled groups; pass e.g. off_policy=0 for on-policy).
    """
    for s, rep in _reports(loss_fn, seeds, nodes, **batch_kw):
        if math.isnan(rep.ratio):  # an assertion that cannot fail proves nothing
            raise AssertionError(
                f"cancellation ratio undefined on random_batch(seed={s}): no {nodes} node or "
                "W ≡ 0 at every node (nothing to cancel); use batches with a gradient there")
        if rep.ratio > tol:
            raise AssertionError(
                f"shared-token gradient does not cancel: cancellation ratio {rep.ratio:.3g} > "
                f"{tol:g} on random_batch(seed={s}) ({rep.n_nodes} {nodes} nodes, "
                f"residual {rep.residual:.3g})"
            )


def assert_does_not_cancel(loss_fn: Callable[[TokenBatch], Tensor], seeds=range(5),
                           min_ratio: float = 1e-6, nodes: str = "prefix", **batch_kw) -> None:
    """Assert ρ > min_ratio on at least one random batch (the loss is not exchangeable)."""
    reps = _reports(loss_fn, seeds, nodes, **batch_kw)
    if not any(r.ratio > min_ratio for _, r in reps):  # an undefined ρ (NaN) is no residual
        raise AssertionError(f"expected a residual, but ρ ≤ {min_ratio:g} on every seed")



def regime_report(loss_fn: Callable[[TokenBatch], Tensor], regimes=tuple(REGIMES),
                  seeds=range(3), nodes: str = "prefix", **batch_kw) -> list[dict]:
    """ρ of `loss_fn` (W measured by autograd) on random batches of each regime and seed.

    Returns one dict per (regime, seed): regime, seed, ratio (ρ ∈ [0, 1], NaN where undefined:
    no node or W ≡ 0 at the nodes), residual (Σ|d|), n_nodes. `batch_kw` go to `random_batch` (they override the regime's settings).
    """
    rows = []
    for regime in regimes:
        if regime not in REGIMES:
            raise ValueError(f"regime_report: unknown regime {regime!r}; valid: {list(REGIMES)}")
        for s, rep in _reports(loss_fn, seeds, nodes, **{**REGIMES[regime], **batch_kw}):
            rows.append({"regime": regime, "seed": s, "ratio": rep.ratio,
                         "residual": rep.residual, "n_nodes": rep.n_nodes})
    return rows


def assert_cancels_in_regimes(loss_fn: Callable[[TokenBatch], Tensor], regimes=tuple(REGIMES),
                              seeds=range(3), tol: float = 1e-9, nodes: str = "prefix",
                              **batch_kw) -> None:
    """`assert_cancels` in every regime of `REGIMES` (on, near, far off-policy, equal lengths).

    Stricter than `assert_cancels` alone: the "far" regime makes a PPO clip fire at shared
    tokens, so asymmetric clipping is caught; "on" catches per-sequence 1/|o_i| normalisation.
    The message names the failing regime and seed.
    """
    bad = [r for r in regime_report(loss_fn, regimes, seeds, nodes, **batch_kw)
           if not r["ratio"] <= tol]  # NaN (undefined: nothing to cancel) fails too
    if bad:
        lines = [f"  regime {r['regime']!r} ({REGIMES[r['regime']]}), seed {r['seed']}: "
                 + (f"ρ = {r['ratio']:.3g}" if r["ratio"] == r["ratio"] else
                    "ρ undefined (no node or W ≡ 0 there: nothing to cancel)")
                 + f", residual {r['residual']:.3g}" for r in bad]
        raise AssertionError("shared-token gradient does not cancel:\n" + "\n".join(lines))


# --------------------------------------------------------------------------- a saved baseline
def assert_matches_baseline(loss_fn: Callable[[TokenBatch], Tensor], path,
                            expect: str = "cancels", model: bool = True,
                            update: bool = False, name: str | None = None) -> None:
    """`gradlab check` for `loss_fn` against the baseline file `path` (ρ and W per scenario).

    Fails (AssertionError with the check's findings) on an invariant violation (expect:
    "cancels" needs ρ ≈ 0 everywhere; "residual" or "none": baseline only) or any change
    against the baseline: to round-off (16 ulps of float64 synthetic, float32 model W) on the
    machine that wrote it, within tolerances on another. update=True writes the baseline instead (record it once, commit it);
    a missing file (or scenario) is an error, so that CI never compares against nothing.
    model=False: the synthetic scenarios only (well under a second; the model ones take a few
    seconds). Scenarios are named `<source>/loss:<name>/<regime>`, name = loss_fn.__name__
    unless given.
    """
    import contextlib
    import io
    from pathlib import Path

    from .check import baseline as check_baseline
    from .check import run as check

    path = Path(path)
    if not update and not path.is_file():
        raise AssertionError(f"no baseline at {path}: record one with assert_matches_baseline("
                             "..., update=True) and commit it")
    label = "loss:" + (name or getattr(loss_fn, "__name__", "loss"))
    scen = [s for s in check.loss_scenarios(loss_fn, label, expect)
            if model or s.source == "synthetic"]
    base = check_baseline.read_baseline(path, update)
    missing = [s.key for s in scen if s.key not in base.get("scenarios", {})]
    if missing and not update:
        raise AssertionError(f"baseline {path} has no scenario {missing[0]} (of {len(missing)} "
                             "missing): record it with update=True")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = check.check_scenarios(scen, base, path if update else None, partial=False,
                                     residual=label if expect == "residual" else None)
    if code:
        found = [ln for ln in buf.getvalue().splitlines()
                 if ln.startswith(("FAIL", "note", "gradlab check"))]
        raise AssertionError(f"{label} against {path}:\n" + "\n".join(found))
