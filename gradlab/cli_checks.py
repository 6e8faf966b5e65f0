"""Argument checks of the `gradlab` sub-commands that need the file system or torch.

Each raises `ConfigError` with one line naming the option and its valid values; the CLI prints
it and exits 2. They run before any work (no model is loaded, nothing is written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .core.variants import split_top
from .loop.config import ConfigError


def require(option: str, value: object, ok: bool, valid: str) -> None:
    """`--option: value is invalid; must be valid` unless ok."""
    if not ok:
        raise ConfigError(f"--{option}: {value!r} is invalid; must be {valid}")


def check_device(device: str) -> None:
    """A CUDA device must exist here (the name itself is checked by RunConfig)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--device: {device!r}, but torch {torch.__version__} sees no CUDA GPU "
                          "on this machine; valid here: cpu")
    index = device.partition(":")[2]
    n = torch.cuda.device_count()
    if index and (not index.isdigit() or int(index) >= n):
        raise ConfigError(f"--device: {device!r}; valid here: cpu, cuda, "
                          + ", ".join(f"cuda:{i}" for i in range(n)))


def _model_config(path: str, option: str) -> dict:
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{option}: no Hugging Face model folder (config.json) at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{option}: {path}/config.json is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{option}: {path}/config.json is not a JSON object")
    return data


def check_model(path: str | None, trust_remote_code: bool = False, option: str = "--model") -> None:
    """A model folder whose config.json names a model_type this transformers knows (or code
    it is allowed to run: `--trust-remote-code` with an auto_map)."""
    if path is None:
        return
    data = _model_config(path, option)
    if trust_remote_code and "auto_map" in data:
        return
    import transformers
    from transformers import CONFIG_MAPPING

    kind = data.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ConfigError(f"{option}: {path}/config.json names model_type {kind!r}, which "
                          f"transformers {transformers.__version__} does not know (e.g. qwen3, "
                          "llama, qwen2; a newer transformers may)")


def check_run_folder(run: str, need_metrics: bool = True) -> None:
    """A run folder with a readable config.json and (unless watching) some metrics."""
    from .loop.resume import read_config

    path = Path(run)
    if not path.is_dir():
        raise ConfigError(f"run folder {run!r} does not exist (give the --out of a run)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{run} is not a run folder (no config.json)")
    read_config(path / "config.json")  # a corrupt file: one line naming it
    metrics = [path / "metrics.jsonl", *path.glob("*/metrics.jsonl")]
    if need_metrics and not any(m.is_file() and m.stat().st_size > 0 for m in metrics):
        raise ConfigError(f"{run} has no metrics yet (metrics.jsonl is missing or empty): nothing "
                          "to show; use --watch SECONDS while it trains")


def check_task(task: str) -> None:
    if task not in ("arithmetic", "scaffold") and not (task.endswith(".jsonl") and Path(task).is_file()):
        raise ConfigError(f"--task: {task!r}; valid: arithmetic, scaffold or a path to an "
                          "existing .jsonl file")


def check_variance_args(a: argparse.Namespace) -> list[str]:
    """The options of `gradlab variance`; returns the objective names (each one built once)."""
    check_task(a.task)
    for opt, value, ok, valid in (
            ("K", a.K, a.K >= 2, "≥ 2 (the interval is a bootstrap over K batches)"),
            ("reference-batches", a.reference_batches, a.reference_batches >= 2, "≥ 2"),
            ("prompts", a.prompts, a.prompts >= 1, "≥ 1"),
            ("G", a.G, a.G >= 2, "≥ 2 (a group needs two responses to compare)"),
            ("seed", a.seed, a.seed >= 0, "≥ 0"),
            ("threads", a.threads, a.threads >= 0, "≥ 0 (0 = torch's current count)")):
        require(opt, value, ok, valid)
    ckpt = Path(a.checkpoint) if a.checkpoint is not None else None
    if ckpt is not None and (ckpt / "config.json").is_file():  # a Hugging Face model folder
        check_model(a.checkpoint, option="--checkpoint")
    elif ckpt is not None and not ((ckpt / "model.safetensors").is_file()
                                   and (ckpt.parent.parent / "config.json").is_file()):
        raise ConfigError(f"--checkpoint: {a.checkpoint!r} is neither a Hugging Face model "
                          "folder (config.json) nor a run's checkpoints/<objective> folder")
    try:
        names = split_top(a.objectives)
    except ValueError as e:
        raise ConfigError(f"--objectives: {e}") from None
    if not names:
        raise ConfigError("--objectives: give at least one objective")
    from .core import objectives

    for name in names:
        try:
            objectives.get(name)
        except ValueError as e:
            raise ConfigError(f"--objectives: {e}") from None
    return names
