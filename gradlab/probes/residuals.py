"""What one optimizer step's measured W says (docs/concepts/shared-nodes.md), as numbers for the metrics to record.

`measure_step` takes the hook-measured W of a step and returns `StepReadings`: residual, mass
and scale sums at full-group (prefix) and trie nodes (ρ = Σ residual / Σ scale over a rollout
step's nodes), shared-token counts, entropy at shared tokens, the deviation of W from the
objective's closed form, and on heavy steps the mechanism attribution. Nothing is synced to the
host here: sums stay tensors on the device until the metrics object reduces them once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.cancellation import attribution_sums, node_coefficients
from ..core.nodes import SharedNodes, shared_nodes


@dataclass
class StepReadings:
    """Numbers of one optimizer step: `sums` add over steps and ranks, `maxes` take the max,
    `means` average over steps. `prefix_nodes` are the step's full-group nodes (for tax/drift)."""

    sums: dict[str, Tensor] = field(default_factory=dict)
    maxes: dict[str, Tensor] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)
    prefix_nodes: SharedNodes | None = None


def residual_sums(W: Tensor, batch: TokenBatch, sns: dict[str, SharedNodes],
                  prefix: str = "") -> dict[str, Tensor]:
    """Σ|d|, Σ mass and Σ scale (the ρ normaliser) per node kind; W (B, T)."""
    out = {}
    for kind, sn in sns.items():
        k = node_coefficients(W, batch, sn)
        out[f"{prefix}residual_{kind}"] = k.d.abs().sum()
        out[f"{prefix}mass_{kind}"] = k.mass.sum()
        out[f"{prefix}scale_{kind}"] = k.scale.sum()
    return out


def defined_ratio(c) -> float:
    """ρ of a `gradlab.core.cancellation.Cancellation`, NaN where it is undefined: no node of
    the kind (no shared token) or W ≡ 0 at its nodes (Σ scale = 0: every group tied). The same
    as `c.ratio`, kept for callers that name the rule. NaN, never 0: 0 means measured and
    cancelled."""
    return c.ratio if float(c.coef.scale.sum()) > 0 else math.nan


def measure_step(obj, batch: TokenBatch, W: Tensor, ent: Tensor, heavy: bool = False,
                 others: list | tuple = ()) -> StepReadings:
    """Readings of the measured W (B, T) of one step of objective `obj` on `batch`.

    ent: (B, T) token entropy (nats). others: (name, objective) pairs whose closed-form W on this
    very batch is measured too (same-batch mode, keys `cf/<name>/...`).
    """
    trie = shared_nodes(batch, "trie")
    sns = {"prefix": trie.full_group(), "trie": trie}
    r = StepReadings(prefix_nodes=sns["prefix"])
    r.sums.update(residual_sums(W, obj.prepare(batch), sns))  # c*_n from W's own advantages
    for kind, sn in sns.items():
        r.sums[f"n_shared_{kind}"] = (sn.node >= 0).sum()
    r.sums["entropy_shared_sum"] = (ent * (sns["prefix"].node >= 0)).sum()
    r.maxes["w_dev"] = (W - obj.modulation(batch)).abs().max()
    r.maxes["w_max"] = W.abs().max()
    for name, o in others:
        r.sums.update(residual_sums(o.modulation(batch), o.prepare(batch), sns, f"cf/{name}/"))
    if heavy and not getattr(obj, "mechanisms", True):  # a user loss: nothing to switch off
        nan = torch.tensor(float("nan"), dtype=torch.float64)  # attribution undefined: NaN
        r.sums.update({"attr_residual": nan, **{f"attr_{m}_sum": nan
                                                for m in ("coupling", "length", "clip")}})
    elif heavy:  # sums, so that steps and data-parallel ranks add: attr_m = Σ num / Σ residual
        att = attribution_sums(obj, batch, "prefix")
        r.sums["attr_residual"] = torch.tensor(att.pop("residual"), dtype=torch.float64)
        r.sums.update({f"attr_{m}_sum": torch.tensor(v, dtype=torch.float64)
                       for m, v in att.items()})  # res − res_off
    return r
