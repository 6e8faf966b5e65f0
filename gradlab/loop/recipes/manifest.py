"""Re-make the instrument manifest (`instruments.json`) of a gradlab-loop run folder from its
`config.json`: the instruments its `--instruments` selects, and the loop's own records.

    python -m gradlab.loop.recipes.manifest RUN [RUN ...]
"""

from __future__ import annotations

from pathlib import Path

from ...core import variants
from ...instruments.manifest import write_manifest
from ..config import RunConfig
from ..train import build_objective
from ..update.view import loop_instruments


def remake(run: str | Path) -> Path:
    """Write the manifest of the loop run folder `run` from its config.json; returns its path."""
    cfg = RunConfig.from_json(Path(run) / "config.json")
    others = [] if cfg.mode == "tandem" else [
        (variants.label(n), build_objective(cfg, n)) for n in cfg.objectives[1:]]
    return write_manifest(run, list(loop_instruments(cfg, others)), loop=True)


if __name__ == "__main__":
    import sys

    for folder in sys.argv[1:]:
        print(f"wrote {remake(folder)}")
