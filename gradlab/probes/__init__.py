"""Probes on real backward passes (docs/concepts/).

- `ModulationProbe`, `Schedule`: measure W = −∂loss/∂logps with a hook, for any loss.
- `learning_tax`, `layer_groups`: the parameter-space residual g_tax, overall and per group.
- `DFPOGradientTransform`: DFPO as a hook that turns any base loss's W into W̃.
- `defined_ratio`: ρ of a cancellation report, NaN where it is undefined (never 0). What a
  training step measures with these, and when, is `gradlab.instruments`.
- `node_drift`, `kl_rows`, `entropy`, `equal_solution_logodds`: drift and collapse figures.
"""

from ..instruments.schedule import Schedule
from .drift import entropy, equal_solution_logodds, kl_rows, node_drift, shared_drift
from .modulation import ModulationProbe
from .residuals import defined_ratio
from .tax import group_of, layer_groups, learning_tax
from .transform import DFPOGradientTransform

__all__ = [
    "DFPOGradientTransform", "ModulationProbe", "Schedule", "defined_ratio", "entropy",
    "equal_solution_logodds", "group_of", "kl_rows", "layer_groups", "learning_tax", "node_drift",
    "shared_drift",
]
