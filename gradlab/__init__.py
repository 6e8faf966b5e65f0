"""gradlab: what does each token's gradient get in group-relative RL, and does the shared part cancel?

Core (docs/concepts/): `TokenBatch`, `advantages`, `objectives.get(name)` (loss and
closed-form modulation W), `shared_nodes`, `cancellation`, `attribution`; IBPO's token
advantages (docs/concepts/ibpo.md): `process_advantages`, `repair_advantages`, `edited_tokens`.
Loop: `gradlab.loop.train`, run store read by `load_run`, token traces by `load_traces`; probes: `gradlab.probes`.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # editors and type checkers see the names; at run time they load on first use
    from .core import objectives
    from .core.batch import TokenBatch, advantages
    from .core.cancellation import Cancellation, attribution, cancellation
    from .core.credit import edited_tokens, process_advantages, repair_advantages
    from .core.nodes import SharedNodes, shared_nodes
    from .loop.runs.store import load_run
    from .loop.runs.traces import load_traces

# Names load on first use (PEP 562), so `gradlab --help` and argument errors never import torch.
_LAZY = {
    "objectives": "gradlab.core.objectives", "TokenBatch": "gradlab.core.batch",
    "advantages": "gradlab.core.batch", "Cancellation": "gradlab.core.cancellation",
    "attribution": "gradlab.core.cancellation", "cancellation": "gradlab.core.cancellation",
    "edited_tokens": "gradlab.core.credit", "process_advantages": "gradlab.core.credit",
    "repair_advantages": "gradlab.core.credit", "SharedNodes": "gradlab.core.nodes",
    "shared_nodes": "gradlab.core.nodes", "load_run": "gradlab.loop.runs.store",
    "load_traces": "gradlab.loop.runs.traces",
}

__version__ = "0.1.0"

__all__ = [
    "TokenBatch", "advantages", "objectives", "shared_nodes", "SharedNodes", "cancellation",
    "Cancellation", "attribution", "load_run", "load_traces", "process_advantages",
    "repair_advantages", "edited_tokens",
]


def __getattr__(name: str):
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'gradlab' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if name == "objectives" else getattr(module, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
