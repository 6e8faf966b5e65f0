"""The scenarios gradlab's checks measure a loss on: synthetic groups and one real step.

`random_batch` builds groups whose responses share a prefix and branch into a trie, with
log-probs that depend only on the history (as a real policy's do), so shared tokens carry
identical log-probs across the group; `REGIMES` names the settings of it that each expose one
way a loss can break cancellation. `measure_modulation` reads W = −∂loss/∂logps the way a
backward hook on the log-prob tensor does; `measure_on_model`, `optimizer_step_on` and
`loop_step_on` do the same on a real model's rollout. `gradlab check` (gradlab/check/run.py) and
the assertions of `gradlab.testing`, which re-exports every name here, are built on them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..core.batch import TokenBatch, advantages


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
    n_groups: int = 3, G: int = 4, T: int = 12, *, prefix: int = 3, vocab: int = 3,
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
    return TokenBatch(tokens, mask, logps, old, adv, group, rewards=rewards.to(dtype)).rows(perm)


def measure_modulation(loss_fn: Callable[[TokenBatch], Tensor], batch: TokenBatch) -> Tensor:
    """W = −∂loss/∂logps on a fresh leaf copy of batch.logps, (B, T) — what a hook receives."""
    lp = batch.logps.detach().clone().requires_grad_(True)
    b = batch.replace(logps=lp)
    (grad,) = torch.autograd.grad(loss_fn(b), lp, allow_unused=True)
    return torch.zeros_like(lp) if grad is None else -grad



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



# --------------------------------------------------------------------------- real models
def _rows_logps(model, rollout, rows: Tensor, temperature: float) -> Tensor:
    """(R, T) log-probs of the rollout's responses on `rows` (R,) under `model` at temperature."""
    from ..loop.numerics.logprobs import token_logps

    s = rollout.rows(rows)
    return token_logps(model, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                       temperature)


def measure_on_model(model, rollout, rows: Tensor, adv: Tensor,
                     loss_fn: Callable[[TokenBatch], Tensor],
                     temperature: float = 1.0) -> tuple[Tensor, TokenBatch]:
    """W measured by a `ModulationProbe` hook on a real forward/backward of `model`.

    rollout: a `gradlab.loop.rollouts.rollout.Rollout` (its old_logps are the behaviour log-probs);
    rows (R,) long: the rows of the step; adv (N,) advantages of all rollout rows.
    Runs token_logps → loss_fn(batch) → backward, so parameter .grad is touched (zeroed after).
    Returns (W (R, T) float32, the TokenBatch with detached logps).
    """
    from ..probes import ModulationProbe

    logps = _rows_logps(model, rollout, rows, temperature)  # (R, T)
    batch = rollout.token_batch(logps, adv, rows)
    with ModulationProbe() as probe:
        loss_fn(batch.replace(logps=probe.watch(logps))).backward()
    model.zero_grad(set_to_none=True)
    return probe.W, batch.replace(logps=logps.detach())


def optimizer_step_on(model, rollout, rows: Tensor, adv: Tensor,
                      loss_fn: Callable[[TokenBatch], Tensor], *, lr: float = 2e-4,
                      temperature: float = 1.0) -> None:
    """One AdamW step (lr, as the loop's default) of `model` on `rows`: makes later minibatches
    of the same rollout off-policy, exactly as the training loop's 2nd+ minibatches are."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    logps = _rows_logps(model, rollout, rows, temperature)  # (R, T)
    batch = rollout.token_batch(logps, adv, rows)
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
    from ..loop import config

    cfg = config.RunConfig()
    return {k: getattr(cfg, k) for k in TRAINING_DEFAULTS}


def loop_step_on(model, rollout, rows: Tensor, adv: Tensor,
                 loss_fn: Callable[[TokenBatch], Tensor], training: dict | None = None) -> None:
    """One optimizer step of `model` on `rows` as the training loop takes it: AdamW (lr, weight
    decay), log-probs at the temperature, the gradient norm clipped to grad_clip.

    training: `training_defaults()` unless given; adv (N,) advantages of all rollout rows
    (the loop scales them with training["adv_scale"]); rows (R,) long."""
    tr = training or training_defaults()
    opt = torch.optim.AdamW(model.parameters(), lr=tr["lr"], weight_decay=tr["weight_decay"])
    model.train()
    logps = _rows_logps(model, rollout, rows, tr["temperature"])  # (R, T)
    batch = rollout.token_batch(logps, adv, rows)
    loss_fn(batch).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tr["grad_clip"])
    opt.step()
    model.zero_grad(set_to_none=True)
    model.eval()
