"""gradlab: what does each token's gradient get in group-relative RL, and does the shared part cancel?

Core (MATH.md §1–3, §5): `TokenBatch`, `advantages`, `objectives.get(name)` (loss and
closed-form modulation W), `shared_nodes`, `cancellation`, `attribution`; IBPO's token
advantages (MATH.md §6): `process_advantages`, `repair_advantages`, `edited_tokens`.
Loop: `gradlab.loop.train`, run store read by `load_run`, token traces by `load_traces`; probes: `gradlab.probes`.
"""

from .core import objectives
from .core.batch import TokenBatch, advantages
from .core.cancellation import Cancellation, attribution, cancellation
from .core.credit import edited_tokens, process_advantages, repair_advantages
from .core.nodes import SharedNodes, shared_nodes
from .loop.store import load_run
from .loop.traces import load_traces

__version__ = "0.1.0"

__all__ = [
    "TokenBatch", "advantages", "objectives", "shared_nodes", "SharedNodes", "cancellation",
    "Cancellation", "attribution", "load_run", "load_traces", "process_advantages",
    "repair_advantages", "edited_tokens",
]
