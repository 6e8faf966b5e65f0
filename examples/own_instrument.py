"""Your own instrument: the share of the gradient's |W| that sits on tokens a whole group shares.

    gradlab tandem --instruments default,examples/own_instrument.py:SharedMass@2 ...
    GradlabConfig(instruments="examples/own_instrument.py:SharedMass")     # in TRL
"""

import gradlab.instruments as gi


@gi.register
class SharedMass(gi.Instrument):
    """Σ|W| at full-group tokens / Σ|W| over all response tokens, per rollout step."""

    name = "shared_mass"
    needs = frozenset({"W", "batch"})  # the measured W (B, T) and the step's TokenBatch
    curves = (("shared_mass_share", "share of |W| on full-group tokens"),)  # gradlab view

    def measure(self, view) -> gi.Readings:
        shared = view.nodes()["prefix"].node >= 0  # (B, T) bool: at a full-group node
        mass = view.W.abs() * view.batch.mask  # (B, T) |W| on response tokens
        # sums add over optimizer steps and data-parallel ranks before the ratio is taken
        return gi.Readings(sums={"shared_mass": (mass * shared).sum(), "total_mass": mass.sum()})

    def quantities(self) -> list:
        return [gi.Ratio("shared_mass_share", "shared_mass", "total_mass",
                         undefined="W ≡ 0 on every response token (every group tied)")]
