"""The run store: a folder per run that a crash cannot corrupt, and the one tidy table.

    run/
      config.json            resolved configuration
      metrics.jsonl          one JSON line per (step, objective): appended, flushed and fsynced
                             as each step ends, so a crash loses at most the step in flight
      samples.jsonl          a few decoded responses per step
      checkpoints/<objective>/model.safetensors, optimizer.safetensors, state.json
      figures/, summary.md   written by `gradlab reproduce`

`load_run(path)` returns the tidy long table every figure and notebook reads:
columns  run, objective, seed, step, tokens, metric, value  (one row per step × objective ×
metric). A torn last line (a crash mid-write) is skipped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

ID_COLUMNS = ("run", "objective", "seed", "step", "tokens")
TIDY_COLUMNS = ID_COLUMNS + ("metric", "value")


class RunStore:
    """Append-only writer for one run folder."""

    def __init__(self, path: str | Path, config: dict | None = None, resume: bool = False,
                 write: bool = True) -> None:
        """write=False (data-parallel ranks other than 0): reads work, writes are no-ops."""
        self.path = Path(path)
        self.write = write
        if not write:
            return
        if not resume and (self.path / "metrics.jsonl").exists():
            raise FileExistsError(f"--out {self.path} already holds a run: pass --resume to "
                                  "continue it, or choose another --out")
        self.path.mkdir(parents=True, exist_ok=True)
        if config is not None and not (resume and (self.path / "config.json").exists()):
            _atomic_write(self.path / "config.json", json.dumps(config, indent=2, sort_keys=True))

    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def log(self, record: dict, file: str = "metrics.jsonl") -> None:
        """Append one record and make it durable before returning."""
        if not self.write:
            return
        line = json.dumps(_jsonable(record), sort_keys=True)
        with open(self.path / file, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps > step (written after the last checkpoint)."""
        if not self.write:
            return
        for file in ("metrics.jsonl", "samples.jsonl"):
            p = self.path / file
            if not p.exists():
                continue
            keep = [r for r in _read_jsonl(p) if r.get("step", -1) <= step]
            _atomic_write(p, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))

    # --- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, name: str, model, optimizer, state: dict, tensors: dict) -> None:
        """Model and optimizer in safetensors, plus JSON state and extra tensors (RNG states)."""
        if not self.write:
            return
        d = self.path / "checkpoints" / name
        tmp = d.with_name(d.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(_dedupe(sd), tmp / "model.safetensors")
        opt_t, opt_meta = _flatten_optimizer(optimizer)
        save_file({**opt_t, **{f"extra.{k}": v.cpu() for k, v in tensors.items()}},
                  tmp / "optimizer.safetensors")
        (tmp / "state.json").write_text(json.dumps({**state, "optimizer": opt_meta}, indent=1))
        if d.exists():
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        tmp.rename(d)  # a crash mid-save leaves the previous checkpoint intact

    def load_checkpoint(self, name: str, model, optimizer) -> tuple[dict, dict]:
        """Restore model and optimizer in place; returns (state, extra tensors)."""
        d = self.path / "checkpoints" / name
        if not (d / "state.json").exists():
            raise FileNotFoundError(f"no checkpoint for {name!r} in {d}")
        sd = load_file(d / "model.safetensors")
        model.load_state_dict(sd, strict=False)
        state = json.loads((d / "state.json").read_text())
        flat = load_file(d / "optimizer.safetensors")
        optimizer.load_state_dict(_unflatten_optimizer(flat, state.pop("optimizer")))
        extra = {k[len("extra."):]: v for k, v in flat.items() if k.startswith("extra.")}
        return state, extra


def _dedupe(sd: dict) -> dict:
    """Tied weights share storage: safetensors refuses duplicates, keep the first name.

    No copy is made of a tensor that owns its whole storage (every parameter of a HF model):
    only a view into a larger storage is cloned, since safetensors writes whole storages."""
    seen, out = set(), {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            whole = v.untyped_storage().nbytes() == v.numel() * v.element_size()
            out[k] = v if whole else v.clone()
    return out


def _flatten_optimizer(opt) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors, meta_state = {}, {}
    for pid, st in sd["state"].items():
        meta_state[str(pid)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{pid}.{k}"] = v.detach().contiguous().cpu()
                meta_state[str(pid)][k] = "__tensor__"
            else:
                meta_state[str(pid)][k] = v
    return tensors, {"state": meta_state, "param_groups": sd["param_groups"]}


def _unflatten_optimizer(flat: dict, meta: dict) -> dict:
    state = {}
    for pid, st in meta["state"].items():
        state[int(pid)] = {k: (flat[f"state.{pid}.{k}"] if v == "__tensor__" else v)
                           for k, v in st.items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonable(rec: dict) -> dict:
    out = {}
    for k, v in rec.items():
        if torch.is_tensor(v):
            v = v.item() if v.numel() == 1 else v.tolist()
        if isinstance(v, float) and not math.isfinite(v):
            v = None  # JSON has no NaN; a missing value reads back as NaN in pandas
        out[k] = v
    return out


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn line from a crash mid-write
    return out


def load_run(path: str | Path, wide: bool = False) -> pd.DataFrame:
    """Read a run folder (or a folder of runs) into the tidy long table.

    Columns: run, objective, seed, step, tokens, metric, value. `wide=True` pivots to one
    row per (run, objective, seed, step, tokens) with a column per metric.
    """
    path = Path(path)
    files = [path / "metrics.jsonl"] if (path / "metrics.jsonl").exists() else sorted(
        path.glob("*/metrics.jsonl"))
    if not files:
        raise FileNotFoundError(f"no metrics.jsonl in {path} or its sub-folders")
    frames = []
    for f in files:
        recs = _read_jsonl(f)
        if not recs:
            continue
        df = pd.DataFrame(recs)
        df["run"] = f.parent.name
        for c in ID_COLUMNS:
            if c not in df:
                df[c] = pd.NA
        value_cols = [c for c in df.columns if c not in ID_COLUMNS]
        long = df.melt(id_vars=list(ID_COLUMNS), value_vars=value_cols, var_name="metric",
                       value_name="value")
        long["value"] = pd.to_numeric(long["value"], errors="coerce")
        frames.append(long)
    tidy = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TIDY_COLUMNS)
    tidy = tidy[list(TIDY_COLUMNS)].sort_values(["run", "objective", "step", "metric"],
                                                kind="stable").reset_index(drop=True)
    if wide:
        wide = tidy.pivot(index=list(ID_COLUMNS), columns="metric", values="value")
        return wide.reset_index().rename_axis(columns=None)
    return tidy
