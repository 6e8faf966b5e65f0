"""Drawing: functions from gradlab's tidy tables to matplotlib/seaborn figures.

A quantity is computed elsewhere (gradlab.core, gradlab.probes); here it is only drawn.
"""

from .curves import CURVES, save, training_curves

__all__ = ["CURVES", "save", "training_curves"]
