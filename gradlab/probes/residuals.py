"""ρ of a cancellation report with its undefined case named (docs/concepts/shared-nodes.md).

What one optimizer step's measured W says — residual, mass and scale sums at full-group and
trie nodes — is the `residual` instrument (`gradlab.instruments.Residual`).
"""

from __future__ import annotations


def defined_ratio(c) -> float:
    """ρ of a `gradlab.core.cancellation.Cancellation`, NaN where it is undefined: no node of
    the kind (no shared token) or W ≡ 0 at its nodes (Σ scale = 0: every group tied). The same
    as `c.ratio`, kept for callers that name the rule. NaN, never 0: 0 means measured and
    cancelled."""
    return c.ratio
