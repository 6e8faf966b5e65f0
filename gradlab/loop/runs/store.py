"""The run store: a folder per run that a crash cannot corrupt, and the one tidy table.

    run/
      config.json            resolved configuration
      metrics.jsonl          one JSON line per (step, objective): appended, flushed and fsynced
                             as each step ends, so a crash loses at most the step in flight
      samples.jsonl          a few decoded responses per step
      instruments.json       what was measured: each metric's unit and undefined reason, the
                             curves `gradlab view` draws (gradlab.instruments.manifest)
      checkpoints/<objective>/model.safetensors, optimizer.safetensors, state.json
      figures/, summary.md   written by `gradlab reproduce`

`load_run(path)` returns the tidy long table every figure and notebook reads:
columns  run, objective, seed, step, tokens, metric, value, undefined  (one row per step ×
objective × metric). The files are strict JSON (`gradlab.jsonio`): an undefined value (a ratio
whose denominator is 0) is `null` in its record, with its reason under the record's
`"undefined"` key; `load_run` reads it back as NaN with that reason in the `undefined` column
(None beside a value, and beside a metric the step did not record). A torn last line (a
crash mid-write) is skipped and logged; a corrupt line anywhere else is an error naming the
file and line (never a silent deletion).

Durability (gradlab/atomic.py): config.json and rewrites of the JSONL files go to a temporary name,
are fsynced and renamed; metrics lines are appended whole (a failed append is cut back); a
checkpoint is written whole under checkpoints/<objective>.tmp and swapped in, the previous one
deleted only after that. A write that fails raises `WriteError` (exit code 4) naming the path.

Readers during writes: `load_run` on a run being written returns the records of the complete
lines, in order — a consistent prefix of the run (the line being appended is not read).
"""

from __future__ import annotations

import json
import logging
import math
import os
from functools import cache
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from ... import jsonio
from ...atomic import append_line, fsync_dir, fsync_file, remove, write_file, writing
from .lock import acquire
from .resume import CorruptFileError, check_resume_config, read_config

log = logging.getLogger("gradlab")
ID_COLUMNS = ("run", "objective", "seed", "step", "tokens")
VALUE_COLUMNS = ("metric", "value")
REASON = jsonio.UNDEFINED  # the tidy column holding why a value is undefined (NaN)
TIDY_COLUMNS = ID_COLUMNS + VALUE_COLUMNS + (REASON,)
_REPORTED: set = set()  # torn last lines already logged by this process


class RunStore:
    """Append-only writer for one run folder."""

    def __init__(self, path: str | Path, config: dict | None = None, resume: bool = False,
                 write: bool = True, check_config: bool = True) -> None:
        """write=False (data-parallel ranks other than 0): reads work, writes are no-ops.
        check_config (a RunConfig dict): on resume, refuse options that differ from the stored
        config.json and record the allowed changes; False keeps config.json as it is."""
        self.path = Path(path)
        self.write = write
        self._lock = None
        if not write:
            return
        with writing(self.path):  # a read-only or missing place: exit code 4 naming it
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = acquire(self.path)  # one writer per folder (loop/runs/lock.py)
        if not resume and (self.path / "metrics.jsonl").exists():
            self.close()
            raise FileExistsError(f"--out {self.path} already holds a run: pass --resume to "
                                  "continue it, or choose another --out")
        if resume:
            for file in ("metrics.jsonl", "samples.jsonl"):
                _cut_torn_tail(self.path / file)
        stored = self.path / "config.json"
        if config is not None and resume and stored.exists() and check_config:
            # resume: a differing option is refused (loop/runs/resume.py), an allowed change is recorded
            check_resume_config(self.path, read_config(stored), config)
        if config is not None and not (resume and stored.exists() and not check_config):
            _atomic_write(stored, jsonio.dumps(config, indent=2, sort_keys=True))

    def close(self) -> None:
        """Release the folder's writer lock (training is over); reads still work."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __del__(self) -> None:
        self.close()

    def config(self) -> dict:
        return read_config(self.path / "config.json")

    def log(self, record: dict, file: str = "metrics.jsonl") -> None:
        """Append one record and make it durable before returning. A non-finite value is
        written `null` with its reason (`_reasons`) under the record's "undefined" key."""
        if not self.write:
            return
        append_line(self.path / file, _line(record, _manifest(self.path)))

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps > step (written after the last checkpoint)."""
        if not self.write:
            return
        for file in ("metrics.jsonl", "samples.jsonl"):
            p = self.path / file
            if not p.exists():
                continue
            keep = [r for r in _read_jsonl(p) if r.get("step", -1) <= step]
            man = _manifest(self.path)
            _atomic_write(p, "".join(_line(r, man) + "\n" for r in keep))

    def drop_keys_at(self, step: int, keys: tuple[str, ...]) -> None:
        """Remove `keys` from the metrics records of `step` (an end-of-run evaluation that a
        resumed, longer run does not schedule there; see train.py)."""
        p = self.path / "metrics.jsonl"
        if not self.write or not p.exists():
            return
        rows = _read_jsonl(p)
        if not any(r.get("step") == step and any(k in r for k in keys) for r in rows):
            return
        rows = [{k: v for k, v in r.items() if r.get("step") != step or k not in keys}
                for r in rows]
        for r in rows:  # a dropped key's reason goes with it
            why = r.get(REASON)
            if isinstance(why, dict) and r.get("step") == step:
                why = {k: v for k, v in why.items() if k not in keys}
                r[REASON] = why
                if not why:
                    del r[REASON]
        man = _manifest(self.path)
        _atomic_write(p, "".join(_line(r, man) + "\n" for r in rows))

    # --- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, name: str, model, optimizer, state: dict, tensors: dict) -> None:
        """Model and optimizer in safetensors, plus JSON state and extra tensors (RNG states).

        Written whole into checkpoints/<name>.tmp (files fsynced), then swapped in: the old
        checkpoint is renamed to <name>.old, the new one to <name>, and only then is the old
        one deleted. A failed write (`WriteError`, exit code 4) leaves the old one in place."""
        if not self.write:
            return
        d = self.path / "checkpoints" / name
        tmp, old = d.with_name(d.name + ".tmp"), d.with_name(d.name + ".old")
        remove(tmp)  # a crash mid-save left it: never the last good checkpoint
        try:
            with writing(tmp):
                tmp.mkdir(parents=True)
            sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            with writing(tmp / "model.safetensors"):
                save_file(_dedupe(sd), tmp / "model.safetensors")
            opt_t, opt_meta = _flatten_optimizer(optimizer)
            with writing(tmp / "optimizer.safetensors"):
                save_file({**opt_t, **{f"extra.{k}": v.cpu() for k, v in tensors.items()}},
                          tmp / "optimizer.safetensors")
            for f in ("model.safetensors", "optimizer.safetensors"):
                fsync_file(tmp / f)
            write_file(tmp / "state.json", jsonio.dumps({**state, "optimizer": opt_meta}, indent=1))
        except BaseException:
            remove(tmp)  # free the space; the previous checkpoint is untouched
            raise
        with writing(d):
            if d.exists():
                remove(old)
                d.rename(old)
            tmp.rename(d)
        fsync_dir(d.parent)
        remove(old)

    def recover_checkpoints(self) -> None:
        """After a crash between the two renames of `save_checkpoint`: put <name>.old back."""
        if not self.write:
            return
        for old in (self.path / "checkpoints").glob("*.old"):
            d = old.with_name(old.name[: -len(".old")])
            if not (d / "state.json").exists():
                log.warning("%s: restoring the previous checkpoint %s (a crash while saving)", d, old)
                remove(d)
                old.rename(d)
            else:
                remove(old)

    def load_checkpoint(self, name: str, model, optimizer) -> tuple[dict, dict]:
        """Restore model and optimizer in place; returns (state, extra tensors).

        A truncated or corrupt file (or one from another model) raises `CorruptFileError`
        naming it and what to do; nothing is half-loaded silently."""
        d = self.path / "checkpoints" / name
        if not (d / "state.json").exists():
            raise FileNotFoundError(f"no checkpoint for {name!r} in {d}")
        what = (f"restore it from a copy, or delete {self.path / 'checkpoints'} to start the run "
                "over with --resume")
        sd = _load_tensors(d / "model.safetensors", what)
        state = _load_json(d / "state.json", what)
        flat = _load_tensors(d / "optimizer.safetensors", what)
        try:
            res = model.load_state_dict(sd, strict=False)
            _check_keys(model, res.missing_keys, res.unexpected_keys)
            optimizer.load_state_dict(_unflatten_optimizer(flat, state.pop("optimizer")))
            if not isinstance(state.get("step"), int) or not isinstance(state.get("tokens"), int):
                raise ValueError("state.json lacks an integer step and tokens")
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CorruptFileError(f"checkpoint {d} does not fit this run ({msg}); {what}") from None
        extra = {k[len("extra."):]: v for k, v in flat.items() if k.startswith("extra.")}
        return state, extra


def _load_tensors(path: Path, what: str) -> dict:
    try:
        return load_file(path)
    except FileNotFoundError:
        raise CorruptFileError(f"{path} is missing (an incomplete checkpoint); {what}") from None
    except Exception as e:  # safetensors raises its own SafetensorError (not exported in all versions)
        raise CorruptFileError(f"{path} is truncated or corrupt ({e}); {what}") from None


def _load_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptFileError(f"{path} is truncated or corrupt ({e}); {what}") from None
    if not isinstance(data, dict) or "optimizer" not in data:
        raise CorruptFileError(f"{path} is corrupt (not a checkpoint state); {what}")
    return data


def _check_keys(model, missing: list[str], unexpected: list[str]) -> None:
    """Missing keys are fine only for tied weights (saved once under their first name)."""
    sd = model.state_dict()
    ptr = lambda k: (sd[k].untyped_storage().data_ptr(), sd[k].storage_offset())  # noqa: E731
    loaded = {ptr(k) for k in sd if k not in set(missing)}
    really = [k for k in missing if ptr(k) not in loaded]
    if really or unexpected:
        raise ValueError(f"missing {really[:3]}, unexpected {unexpected[:3]}")


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
    write_file(path, text)  # temp name, fsync, rename (gradlab/atomic.py)


def _jsonable(rec: dict) -> dict:
    """`rec` with tensors as Python values (a 1-element tensor as a number); non-finite floats
    stay (`_line` writes them null with their reasons)."""
    out = {}
    for k, v in rec.items():
        if torch.is_tensor(v):
            v = v.detach().cpu()
            v = v.item() if v.numel() == 1 else v.tolist()
        out[k] = v
    return out


@cache
def _declared():
    """The reasons of gradlab's loop and the built-in instruments' rules (a `Manifest`), for a
    record of a folder without its own `instruments.json`."""
    from ...instruments.manifest import builtin_manifest

    return builtin_manifest()


def _manifest(folder: Path):
    """The folder's `instruments.json` read (a `Manifest`), else the built-in one."""
    from ...instruments.manifest import Manifest

    return Manifest.of(folder) or _declared()


def _reasons(rec: dict, manifest=None) -> dict[str, str]:
    """Why each non-finite float of one record is undefined: the cause read from the record's
    sums and counts (`gradlab.viz.undefined.step_reason`: no node, every group tied, ...), else
    the reason the run's manifest (`instruments.json`) gives, else the built-in rules';
    a value neither explains keeps jsonio's ("not a number")."""
    from ...viz.undefined import NOT_MEASURED, step_reason

    manifest = manifest or _declared()
    out = {}
    for k, v in rec.items():
        if isinstance(v, float) and math.isnan(v):  # ±inf: jsonio's "infinite"
            why = step_reason(rec, k)
            if why in (None, NOT_MEASURED):
                why = manifest.undefined(k) or _declared().undefined(k)
            if why:
                out[k] = why
    return out


def _line(rec: dict, manifest=None) -> str:
    """One strict-JSON line of a record (keys sorted; undefined values null with reasons)."""
    rec = _jsonable(rec)
    return jsonio.dumps(rec, reasons=_reasons(rec, manifest), sort_keys=True)


def _cut_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a crash mid-write) before appending; logged."""
    if not path.exists():
        return
    raw = path.read_bytes()
    if not raw or raw.endswith(b"\n"):
        return
    keep = raw[: raw.rfind(b"\n") + 1]
    log.warning("%s: torn last line cut (a crash mid-write): %r", path, raw[len(keep):][:80])
    with writing(path), open(path, "r+b") as f:
        f.truncate(len(keep))
        os.fsync(f.fileno())


def _read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL run file. A torn *last* line (a crash mid-write) is cut and
    logged; a corrupt line anywhere else raises `CorruptFileError` naming file and line."""
    lines = path.read_bytes().split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if i == len(lines):  # a line being written, or torn by a crash: not read
                if (str(path), i, line) not in _REPORTED:  # reported once per torn line
                    _REPORTED.add((str(path), i, line))
                    log.warning("%s:%d: incomplete last line not read (being written, or torn "
                                "by a crash; --resume cuts it): %r", path, i, line[:80])
                continue
            raise CorruptFileError(
                f"{path}:{i}: corrupt line ({e}) before the end of the file: restore the file "
                f"or remove line {i} by hand; gradlab deletes nothing it cannot read") from None
        out.append(rec)
    return out


def load_run(path: str | Path, wide: bool = False) -> pd.DataFrame:
    """Read a run folder (or a folder of runs) into the tidy long table.

    Columns: run, objective, seed, step, tokens, metric, value, undefined. `value` is NaN where
    the metric is undefined at that step (a 0 denominator) and `undefined` then holds the
    reason (e.g. "no gradient: every group tied"); `undefined` is None beside a value and where
    the step did not record the metric. A null stored without a reason, or with only jsonio's
    "not a number", gets its cause from the record's sums (`gradlab.viz.undefined.step_reason`)
    or else the reason the run's `instruments.json` gives its metric. `wide=True` pivots the values to one row per (run,
    objective, seed, step, tokens) with a column per metric (no reasons: see
    `gradlab.viz.undefined`).
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
        man = _manifest(f.parent)  # the run's reasons (instruments.json)
        whys = [_stored_reasons(r, man) for r in recs]
        df = pd.DataFrame(recs)
        df["run"] = f.parent.name
        for c in ID_COLUMNS:
            if c not in df:
                df[c] = pd.NA
        value_cols = [c for c in df.columns if c not in ID_COLUMNS]
        long = df.melt(id_vars=list(ID_COLUMNS), value_vars=value_cols, var_name="metric",
                       value_name="value")  # metric by metric, each over the records in order
        long["value"] = pd.to_numeric(long["value"], errors="coerce")
        why = [w.get(m) for m in value_cols for w in whys]
        long[REASON] = pd.Series(why, index=long.index, dtype=object).where(
            long["value"].isna(), None)
        frames.append(long)
    tidy = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TIDY_COLUMNS)
    tidy = tidy[list(TIDY_COLUMNS)].sort_values(["run", "objective", "step", "metric"],
                                                kind="stable").reset_index(drop=True)
    if wide:
        wide = tidy.pivot(index=list(ID_COLUMNS), columns="metric", values="value")
        return wide.reset_index().rename_axis(columns=None)
    return tidy


def _stored_reasons(rec: dict, manifest=None) -> dict[str, str]:
    """Pop a record's "undefined" entry: metric → reason for its null values. Where the record
    holds only jsonio's "not a number", or no reason at all (a run written without them), the
    reason is the record's cause (`_reasons`) or the run's manifest's."""
    why = rec.pop(REASON, None)
    nulls = {k: math.nan for k, v in rec.items() if v is None}
    stored = {k: str(v) for k, v in why.items() if rec.get(k) is None} if isinstance(why, dict) else {}
    generic = [k for k in nulls if stored.get(k, jsonio.NOT_A_NUMBER) == jsonio.NOT_A_NUMBER]
    derived = _reasons({**rec, **nulls}, manifest) if generic else {}
    if isinstance(why, dict):
        return {**stored, **{k: derived[k] for k in generic if k in derived}}
    return {k: derived.get(k, jsonio.NOT_A_NUMBER) for k in nulls}
