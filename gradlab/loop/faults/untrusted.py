"""Inputs that could run code or exhaust memory are checked before they are read.

- A `--model` folder whose config.json or tokenizer_config.json has `auto_map` asks to run
  Python code shipped with the folder: refused unless `--trust-remote-code` is given
  (`check_remote_code`).
- Pickle weights (`*.bin`, `*.pt`, `*.pth`) are read with `torch.load(weights_only=True)`
  only: tensors and containers, never code. A pickle that holds anything else is refused,
  naming the file (`check_pickles`). Run checkpoints are safetensors only.
- A JSONL task larger than `MAX_TASK_BYTES` (256 MiB; environment variable
  GRADLAB_MAX_TASK_MB raises it) is refused from its size alone, before it is read
  (`check_task_size`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .errors import ConfigError

MAX_TASK_BYTES = 256 * 2**20
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def check_remote_code(folder: str | Path, trust_remote_code: bool = False) -> None:
    """ConfigError when the model folder asks for remote code and it is not trusted."""
    folder = Path(folder)
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise ConfigError(f"--model: {path} is not valid JSON ({e})") from None
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map and not trust_remote_code:
            classes = ", ".join(sorted(map(str, auto_map.values() if isinstance(auto_map, dict)
                                           else auto_map)))[:200]
            raise ConfigError(
                f"--model: {path} asks to run code shipped with the model (auto_map: {classes}); "
                "refused: pass --trust-remote-code if you trust this folder's code")


def check_pickles(folder: str | Path) -> None:
    """Read every pickle weight file of `folder` with weights_only=True (memory-mapped, no
    copy); ConfigError naming the first one that holds more than tensors."""
    import pickle

    import torch

    for path in sorted(Path(folder).iterdir()):
        if path.suffix not in PICKLE_SUFFIXES or not path.is_file():
            continue
        try:
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # the legacy (non-zip) format cannot be memory-mapped
                if "mmap" not in str(e):
                    raise
                torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"--model: {path} is a pickle that torch.load(weights_only=True) refuses "
                f"({first}); gradlab never unpickles code: convert it to safetensors with the "
                "tool that made it") from None


def task_limit_mb() -> float:
    """The JSONL task size limit in MiB: $GRADLAB_MAX_TASK_MB if set (a number > 0; anything
    else is a ConfigError naming it, never ignored), else MAX_TASK_BYTES."""
    raw = os.environ.get("GRADLAB_MAX_TASK_MB")
    if raw is None:
        return MAX_TASK_BYTES / 2**20
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0):
        raise ConfigError(f"GRADLAB_MAX_TASK_MB={raw!r}: not a size; valid: a number of MiB > 0 "
                          "(or unset it for the default)")
    return mb


def check_task_size(path: str | Path) -> None:
    """ConfigError when a JSONL task file exceeds the size limit (checked with stat only)."""
    limit = int(task_limit_mb() * 2**20)
    size = Path(path).stat().st_size
    if size > limit:
        raise ConfigError(
            f"--task: {path} is {size / 2**20:.0f} MiB, over the {limit / 2**20:.0f} MiB limit "
            "for a JSONL task (read into memory whole); split it, or raise the limit with "
            "GRADLAB_MAX_TASK_MB")
