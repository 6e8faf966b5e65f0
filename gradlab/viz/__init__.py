"""Drawing: functions from gradlab's tidy tables to matplotlib/seaborn figures.

A quantity is computed elsewhere (gradlab.core, gradlab.probes, the run store, the token
traces); here it is only drawn. `gradlab view RUN` (gradlab.viz.html) writes the interactive page.
"""

from .curves import CURVES, save, training_curves
from .drift import DRIFT, drift_curves
from .prop31 import prop31_figure, prop31_scatter
from .residuals import node_residuals, residual_distribution
from .runs import first_run, notebook_run, resolve_run, run_title, tiny_run
from .seeds import align_tokens
from .strips import CAPTION, group_sums, strip_table, token_strips

__all__ = ["CURVES", "save", "training_curves", "DRIFT", "drift_curves", "prop31_figure", "prop31_scatter",
           "node_residuals", "residual_distribution", "first_run", "notebook_run", "resolve_run",
           "run_title", "tiny_run", "align_tokens", "CAPTION", "group_sums", "strip_table", "token_strips"]
