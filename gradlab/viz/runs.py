"""Finding the run a notebook or viewer shows: paths, a tiny fallback run, a title.

`resolve_run(path)`: an absolute path, or one relative to the current folder or to the
repository root (the first parent holding pyproject.toml) — a notebook's kernel runs in
notebooks/, so `GRADLAB_RUN=runs/x` must still work there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def resolve_run(path: str | Path) -> Path:
    """The existing folder `path` names (see module docstring); FileNotFoundError otherwise."""
    p = Path(path).expanduser()
    tried = [p] if p.is_absolute() else [Path.cwd() / p] + [
        q / p for q in Path.cwd().parents if (q / "pyproject.toml").exists()]
    for q in tried:
        if q.is_dir():
            return q.resolve()
    raise FileNotFoundError(f"run folder {path!s} not found (tried {', '.join(map(str, tried))})")


def first_run(path: str | Path) -> Path:
    """`path` if it is a run folder, else its first sub-folder that is one (a seeds folder)."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    runs = sorted(p.parent for p in path.glob("*/config.json"))
    if not runs:
        raise FileNotFoundError(f"no run folder (config.json) at or under {path}")
    return runs[0]


def tiny_run(path: str | Path, objectives=("grpo", "gspo", "dfpo-min", "dfpo-orth"),
             steps: int = 3) -> Path:
    """A tiny tandem run (seconds, every step traced) at `path`; reused if it holds one."""
    from ..loop.config import RunConfig
    from ..loop.train import train

    path = Path(path)
    if not (path / "metrics.jsonl").exists():
        train(RunConfig(out=str(path), objectives=list(objectives), steps=steps, prompts=2, G=4,
                        minibatches=2, probe_contexts=2, tax_every=1, ckpt_every=steps,
                        trace_every=1, progress=False))
    return path


def notebook_run(default: str | Path = "runs/notebook-tiny") -> Path:
    """$GRADLAB_RUN resolved (absolute or relative to the repository), else a tiny run made at
    `default` (relative to the repository root when one is found)."""
    env = os.environ.get("GRADLAB_RUN")
    if env:
        return resolve_run(env)
    roots = [q for q in [Path.cwd(), *Path.cwd().parents] if (q / "pyproject.toml").exists()]
    return tiny_run((roots[0] if roots else Path.cwd()) / default)


def run_title(run: str | Path) -> str:
    """'<run name>: task, objectives, steps × prompts × G, minibatches, lr, seed' from config.json."""
    run = first_run(Path(run))
    c = json.loads((run / "config.json").read_text())
    if "objectives" not in c:  # a TRL run store
        return f"{run.name}: {c.get('objective', 'TRL run')}"
    return (f"{run.name}: {c['task']} (difficulty {c['difficulty']}), {', '.join(c['objectives'])}"
            f" ({c['mode']}); {c['steps']} steps × {c['prompts']} prompts × G={c['G']}, "
            f"{c['minibatches']} minibatches, lr {c['lr']:g}, seed {c['seed']}")
