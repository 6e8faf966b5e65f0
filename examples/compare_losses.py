"""Compare two losses: does the gradient on tokens a whole group shares cancel?

Two ways to average the importance-weighted policy-gradient loss −r·A over tokens. `token_mean`
divides by the batch's token count (as DAPO does): every token of a group gets the same weight,
so at a shared token the advantages, which sum to zero over the group, cancel. `seq_mean`
averages each response over its own length first (as the original GRPO does): a shared token of
a short response weighs more than the same token of a long one, so they do not cancel. (Add
PPO's clip, min(r·A, clip(r, 1 ± 0.2)·A), to `token_mean` and the "far" regime, where ratios
reach ±60 %, catches the clip's dependence on the sign of A.) `gradlab.testing.regime_report` measures
W = −∂loss/∂log π by autograd on random groups with shared prefixes, in four regimes, and
reports ρ (0 = cancels, 1 = none). The same check from the command line:

    gradlab check --no-model --loss examples/compare_losses.py:token_mean      # exit 0: cancels
    gradlab check --no-model --loss examples/compare_losses.py:seq_mean --expect residual

    python examples/compare_losses.py
"""

import argparse

import torch

from gradlab import TokenBatch
from gradlab.testing import regime_report


def _ratio_terms(b: TokenBatch) -> torch.Tensor:
    """(B, T) importance-weighted advantage r·A per token, zero outside the mask."""
    r = torch.exp(b.logps - b.old_logps)
    return r * b.advantages[:, None] * b.mask


def token_mean(b: TokenBatch) -> torch.Tensor:
    """−r·A averaged over all tokens of the batch (cancels at shared tokens)."""
    return -_ratio_terms(b).sum() / b.mask.sum()


def seq_mean(b: TokenBatch) -> torch.Tensor:
    """−r·A averaged per response, then over responses (1/|o_i|: does not cancel)."""
    per_seq = _ratio_terms(b).sum(1) / b.mask.sum(1).clamp(min=1)
    return -per_seq.mean()


def main(seeds: int) -> None:
    print(f"{'loss':<11} {'regime':<7} {'max rho over seeds':>18}")
    for name, loss in (("token_mean", token_mean), ("seq_mean", seq_mean)):
        rows = regime_report(loss, seeds=range(seeds))
        for regime in dict.fromkeys(r["regime"] for r in rows):
            worst = max(r["ratio"] for r in rows if r["regime"] == regime)
            print(f"{name:<11} {regime:<7} {worst:>18.3g}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="random batches per regime")
    main(p.parse_args().seeds)
