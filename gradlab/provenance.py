"""What made a run: the code, the machine and the numerics settings.

A run's numbers are bitwise reproducible only on the same CPU model with the same torch build
and thread count (floating-point reduction order differs between kernels and vectorisation
widths), and only with the same code. Every run folder therefore carries `provenance.json`:

    {"segments": [{"start_step": 0, "code_hash": "…", "commit": "…", "dirty": false,
                   "cpu_model": "…", "torch": "2.13.0+cpu", "threads": 1, …}, …]}

one segment per process that trained into the folder (a resume adds one). `code_hash` is a
SHA-256 over the installed package's source and shipped data (every file under gradlab/ except
caches), so it identifies the code even outside a git checkout; `commit` and `dirty` are added
when the package sits in a git work tree. `user_files` maps every file of the user's that the
run executes or reads as its task (a loss `file.py:fn` or `module:fn`, an instrument
`path/file.py:Class`, a `.jsonl` task, a `--model` folder's Python files under
`--trust-remote-code`) to the SHA-256 of its content. A run's code is both: the analyses and
`gradlab reproduce --check` reuse a stored run only when every segment's code hash and user files
equal the current ones (`same_code`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from . import jsonio

PACKAGE = Path(__file__).resolve().parent
FILE = "provenance.json"


@lru_cache(maxsize=4)
def code_hash(skip: Path | None = None) -> str:
    """First 16 hex digits of SHA-256 over (relative path, bytes) of every package file (but
    `skip`: package data that records the hash, such as the check baseline)."""
    skip = skip.resolve() if skip is not None else None
    h = hashlib.sha256()
    for p in sorted(PACKAGE.rglob("*")):
        if (p.is_file() and p != skip and "__pycache__" not in p.parts
                and p.suffix not in (".pyc", ".pyo")):
            h.update(p.relative_to(PACKAGE).as_posix().encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _user_targets(config: dict) -> list[str]:
    """The module parts of the user's loss and instrument specs in a run configuration
    (``my.py:fn[name=x]`` → ``my.py``; ``pkg.mod:Cls@4`` → ``pkg.mod``)."""
    out = []
    for spec in config.get("objectives") or []:
        target = str(spec).partition("[")[0].strip()
        if ":" in target:
            out.append(target.rsplit(":", 1)[0])
    for item in str(config.get("instruments") or "").split(","):
        name = item.strip().partition("@")[0]
        if ":" in name:
            out.append(name.rsplit(":", 1)[0])
    return out


def _module_file(name: str) -> Path | None:
    """The source file of an importable module `name` (the working directory first, as a
    user's loss is imported), or None when it has none."""
    import importlib.util
    import sys

    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:  # (finding "pkg.mod" imports pkg, as training the loss does anyway)
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    finally:
        if cwd in sys.path:  # that import may have changed sys.path: remove our entry by value
            sys.path.remove(cwd)
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and Path(origin).is_file() else None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def user_files(config: dict) -> dict[str, str]:
    """{file: first 16 hex digits of the SHA-256 of its content} of every file of the user's
    that a run of `config` (a RunConfig dict) executes or reads as its task: loss and
    instrument modules (`path/file.py` as written, `module` by its source file), a `.jsonl`
    task and, with trust_remote_code, the `--model` folder's Python files. A file that does not
    exist (now) is "missing"."""
    files: list[tuple[str, Path | None]] = []
    for target in _user_targets(config):
        files.append((target, Path(target)) if target.endswith(".py") else
                     (target, _module_file(target)))
    task = str(config.get("task") or "")
    if task.endswith(".jsonl"):
        files.append((task, Path(task)))
    model = config.get("model")
    if model and config.get("trust_remote_code") and Path(model).is_dir():
        files += [(str(f), f) for f in sorted(Path(model).glob("*.py"))]
    return {name: _digest(f) if f is not None and f.is_file() else "missing"
            for name, f in files}


def changed_files(segments: list[dict], now: dict[str, str]) -> list[str]:
    """'file (a → b)' for every user file whose recorded content (any of `segments`) differs
    from `now` (`user_files`); a segment that recorded none counts as recording {}."""
    out = []
    for seg in segments:
        then = seg.get("user_files") or {}
        for name in sorted(set(then) | set(now)):
            line = f"{name} ({then.get(name, 'absent')} → {now.get(name, 'absent')})"
            if then.get(name) != now.get(name) and line not in out:
                out.append(line)
    return out


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(PACKAGE.parent), *args], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


@lru_cache(maxsize=1)
def git_state() -> dict:
    """{"commit", "dirty"} of the checkout the package sits in (None, None outside git)."""
    if _git("rev-parse", "--show-toplevel") is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--", "gradlab")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else the platform's word for it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """CPU model and kernels, cores, OS, Python, torch (and its intra-op threads), transformers."""
    import torch
    import transformers

    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            # the kernels torch picked (AVX512, AVX2, DEFAULT…): a CPU model name can be generic
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "transformers": transformers.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None}


def current() -> dict:
    """The code hash, git state and machine of this process, with a UTC time stamp."""
    from . import __version__

    return {"code_hash": code_hash(), **git_state(), "gradlab": __version__, **machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def in_process_row(prov: dict, what: str = "<in-process>") -> dict:
    """The run row of a figure measured in the measuring process itself (no run folder): the
    code hash, commit, dirty flag and machine of `prov` (`current()`), reused false."""
    keys = ("code_hash", "commit", "dirty", "cpu_model", "torch", "threads")
    return {"run": what, **{k: prov.get(k) for k in keys}, "reused": False}


def write_in_process(path: str | Path, command: str, seconds: float) -> dict:
    """Write {command, seconds, provenance, runs} as JSON for a table measured in this process:
    one run row "<in-process>" with its code hash, commit, dirty flag, CPU, torch, threads and
    reused false. Returns the document."""
    prov = current()
    doc = {"command": command, "seconds": round(seconds, 1), "provenance": prov,
           "runs": [in_process_row(prov)]}
    Path(path).write_text(jsonio.dumps(doc, indent=1) + "\n")
    return doc


def record(run: str | Path, start_step: int) -> dict:
    """Append this process's segment (training from `start_step`) to run/provenance.json."""
    from .atomic import write_file

    seg = {"start_step": int(start_step), **current(), "user_files": user_files(_config(run))}
    old = read(run) or {"segments": []}
    old["segments"] = [s for s in old["segments"] if s.get("start_step", 0) < start_step] + [seg]
    write_file(Path(run) / FILE, jsonio.dumps(old, indent=1) + "\n")
    return seg


def read(run: str | Path) -> dict | None:
    """run/provenance.json, or None for a run made before runs recorded it."""
    f = Path(run) / FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f}: corrupt provenance ({e})") from None


def _config(run: str | Path) -> dict:
    """run/config.json ({} when absent or unreadable)."""
    try:
        data = json.loads((Path(run) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def same_code(run: str | Path) -> bool:
    """True iff every segment of the run was trained by the current package source and the
    current content of the user's files its configuration names (`user_files`)."""
    p = read(run)
    if not (p and p["segments"]):
        return False
    now = user_files(_config(run))
    return all(s.get("code_hash") == code_hash() for s in p["segments"]) and \
        not changed_files(p["segments"], now)


def summary(run: str | Path, reused: bool) -> dict:
    """One row for a figure's provenance list: run, code hashes, commit, machine, reused."""
    segs = (read(run) or {}).get("segments", [])
    last = segs[-1] if segs else {}
    return {"run": str(run), "code_hash": ",".join(dict.fromkeys(s.get("code_hash", "?") for s in segs)) or None,
            "commit": last.get("commit"), "dirty": last.get("dirty"),
            "cpu_model": last.get("cpu_model"), "torch": last.get("torch"),
            "threads": last.get("threads"), "reused": reused}
