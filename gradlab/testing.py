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

from collections.abc import Callable

import torch
from torch import Tensor

from .core.batch import TokenBatch, advantages
from .core.cancellation import Cancellation, cancellation


def _history_values(tokens: Tensor, mask: Tensor, gen: torch.Generator, scale: float,
                    dtype) -> Tensor:
    """(B, T) values that are a function of (row's group prompt, prefix) only."""
    table: dict = {}
    out = torch.zeros(tokens.shape, dtype=dtype)
    for i in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            if not mask[i, t]:
                continue
            key = tuple(tokens[i, : t + 1].tolist())
            if key not in table:
                table[key] = float(torch.rand((), generator=gen, dtype=torch.float64)) * scale
            out[i, t] = table[key]
    return out


def random_batch(
    n_groups: int = 3, G: int = 4, T: int = 12, prefix: int = 3, vocab: int = 3,
    seed: int = 0, off_policy: float = 0.3, dtype=torch.float64, contiguous: bool = False,
    equal_lengths: bool = False, rewards: Tensor | None = None, min_len: int | None = None,
) -> TokenBatch:
    """Random groups with a shared prefix of `prefix` tokens, then a small-vocabulary trie.

    Lengths vary in [min_len, T] (right padding) unless `equal_lengths`; rows of a group are
    shuffled through the batch unless `contiguous`; `off_policy` scales the noise between
    old and current log-probs (0: on-policy, all ratios 1). Log-probs are functions of the
    prefix (the group's prompt is part of it). Rewards are Bernoulli(½), not all equal.
    """
    gen = torch.Generator().manual_seed(seed)
    prefix = min(prefix, T)
    B = n_groups * G
    group = torch.arange(n_groups).repeat_interleave(G)
    tokens = torch.randint(0, vocab, (B, T), generator=gen)
    pre = torch.randint(0, vocab, (n_groups, prefix), generator=gen)
    tokens[:, :prefix] = pre[group]
    tokens += 1 + vocab * group.unsqueeze(-1)  # the prompt, folded into the token id
    lo = min(prefix + 1 if min_len is None else min_len, T)
    lengths = torch.full((B,), T) if equal_lengths else torch.randint(lo, T + 1, (B,), generator=gen)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(-1)
    tokens = torch.where(mask, tokens, 0)
    logps = -_history_values(tokens, mask, gen, 3.0, dtype)
    noise = _history_values(tokens, mask, gen, 1.0, dtype) - 0.5
    old = logps + off_policy * noise
    if rewards is None:
        rewards = (torch.rand(B, generator=gen) < 0.5).to(dtype)
        rewards[::G] = 1.0  # no group with all-equal rewards
        rewards[1::G] = 0.0
    perm = torch.arange(B) if contiguous else torch.randperm(B, generator=gen)
    adv = advantages(rewards.to(dtype), group)
    return TokenBatch(tokens[perm], mask[perm], logps[perm], old[perm], adv[perm], group[perm],
                      rewards=rewards.to(dtype)[perm])


def measure_modulation(loss_fn: Callable[[TokenBatch], Tensor], batch: TokenBatch) -> Tensor:
    """W = −∂loss/∂logps on a fresh leaf copy of batch.logps, (B, T) — what a hook receives."""
    lp = batch.logps.detach().clone().requires_grad_(True)
    b = batch.replace(logps=lp)
    (grad,) = torch.autograd.grad(loss_fn(b), lp, allow_unused=True)
    return torch.zeros_like(lp) if grad is None else -grad


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
    if max(r.ratio for _, r in reps) <= min_ratio:
        raise AssertionError(f"expected a residual, but ρ ≤ {min_ratio:g} on every seed")


# --------------------------------------------------------------------------- regimes
# Added for `gradlab check` and for users' CI. Each regime turns on one way a loss can break
# cancellation on `random_batch` groups (unequal lengths are the default there):
#   on     on-policy (every ratio 1), unequal lengths      → catches 1/|o_i| normalisation
#   near   off_policy=0.3: ratios in ~[0.86, 1.16]         → catches sequence coupling (GSPO)
#   far    off_policy=1.0: ratios in ~[0.6, 1.65], so a     → catches asymmetric clipping
#          PPO clip at eps = 0.2 fires at shared tokens
#   on-eq  on-policy, equal lengths: the regime where GSPO = GRPO and even 1/|o_i| cancels
REGIMES: dict[str, dict] = {
    "on": {"off_policy": 0.0},
    "near": {"off_policy": 0.3},
    "far": {"off_policy": 1.0},
    "on-eq": {"off_policy": 0.0, "equal_lengths": True},
}


def regime_report(loss_fn: Callable[[TokenBatch], Tensor], regimes=tuple(REGIMES),
                  seeds=range(3), nodes: str = "prefix", **batch_kw) -> list[dict]:
    """ρ of `loss_fn` (W measured by autograd) on random batches of each regime and seed.

    Returns one dict per (regime, seed): regime, seed, ratio (ρ ∈ [0, 1]), residual (Σ|d|),
    n_nodes. `batch_kw` go to `random_batch` (they override the regime's settings).
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
    bad = [r for r in regime_report(loss_fn, regimes, seeds, nodes, **batch_kw) if r["ratio"] > tol]
    if bad:
        lines = [f"  regime {r['regime']!r} ({REGIMES[r['regime']]}), seed {r['seed']}: "
                 f"ρ = {r['ratio']:.3g}, residual {r['residual']:.3g}" for r in bad]
        raise AssertionError("shared-token gradient does not cancel:\n" + "\n".join(lines))


# --------------------------------------------------------------------------- real models
def measure_on_model(model, rollout, rows: Tensor, adv: Tensor,
                     loss_fn: Callable[[TokenBatch], Tensor],
                     temperature: float = 1.0) -> tuple[Tensor, TokenBatch]:
    """W measured by a `ModulationProbe` hook on a real forward/backward of `model`.

    rollout: a `gradlab.loop.rollouts.rollout.Rollout` (its old_logps are the behaviour log-probs);
    rows (R,) long: the rows of the step; adv (N,) advantages of all rollout rows.
    Runs token_logps → loss_fn(batch) → backward, so parameter .grad is touched (zeroed after).
    Returns (W (R, T) float32, the TokenBatch with detached logps).
    """
    from .loop.numerics.logprobs import token_logps
    from .probes import ModulationProbe

    ro = rollout
    logps = token_logps(model, ro.prompt_ids[rows], ro.prompt_mask[rows], ro.response_ids[rows],
                        ro.response_mask[rows], temperature)
    batch = TokenBatch(ro.response_ids[rows], ro.response_mask[rows], logps, ro.old_logps[rows],
                       adv[rows], ro.group[rows])
    with ModulationProbe() as probe:
        loss_fn(batch.replace(logps=probe.watch(logps))).backward()
    model.zero_grad(set_to_none=True)
    return probe.W, batch.replace(logps=logps.detach())


def optimizer_step_on(model, rollout, rows: Tensor, adv: Tensor,
                      loss_fn: Callable[[TokenBatch], Tensor], lr: float = 2e-4,
                      temperature: float = 1.0) -> None:
    """One AdamW step (lr, as the loop's default) of `model` on `rows`: makes later minibatches
    of the same rollout off-policy, exactly as the training loop's 2nd+ minibatches are."""
    from .loop.numerics.logprobs import token_logps

    ro = rollout
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    logps = token_logps(model, ro.prompt_ids[rows], ro.prompt_mask[rows], ro.response_ids[rows],
                        ro.response_mask[rows], temperature)
    batch = TokenBatch(ro.response_ids[rows], ro.response_mask[rows], logps, ro.old_logps[rows],
                       adv[rows], ro.group[rows])
    loss_fn(batch).backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    model.eval()


# --------------------------------------------------------------------------- the loop's step
# The settings of `gradlab.loop.config.RunConfig` that one optimizer step of the training loop
# depends on (loop/train.py, loop/update/step.py).
TRAINING_DEFAULTS = ("lr", "weight_decay", "grad_clip", "temperature", "adv_scale")


def training_defaults() -> dict:
    """{lr, weight_decay, grad_clip, temperature, adv_scale} of `RunConfig()`, read at call time
    (so a changed default, or a monkeypatched `gradlab.loop.config.RunConfig`, shows)."""
    from .loop import config

    cfg = config.RunConfig()
    return {k: getattr(cfg, k) for k in TRAINING_DEFAULTS}


def loop_step_on(model, rollout, rows: Tensor, adv: Tensor,
                 loss_fn: Callable[[TokenBatch], Tensor], training: dict | None = None) -> None:
    """One optimizer step of `model` on `rows` as the training loop takes it: AdamW (lr, weight
    decay), log-probs at the temperature, the gradient norm clipped to grad_clip.

    training: `training_defaults()` unless given; adv (N,) advantages of all rollout rows
    (the loop scales them with training["adv_scale"]); rows (R,) long."""
    from .loop.numerics.logprobs import token_logps

    tr = training or training_defaults()
    ro = rollout
    opt = torch.optim.AdamW(model.parameters(), lr=tr["lr"], weight_decay=tr["weight_decay"])
    model.train()
    logps = token_logps(model, ro.prompt_ids[rows], ro.prompt_mask[rows], ro.response_ids[rows],
                        ro.response_mask[rows], tr["temperature"])
    batch = TokenBatch(ro.response_ids[rows], ro.response_mask[rows], logps, ro.old_logps[rows],
                       adv[rows], ro.group[rows])
    loss_fn(batch).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tr["grad_clip"])
    opt.step()
    model.zero_grad(set_to_none=True)
    model.eval()


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

    from . import check, check_baseline

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
