"""Durable writes: a file is whole or absent, and a failed write is one line naming its path.

- `write_file(path, data)`: write `path.tmp`, fsync it, rename it over `path`, fsync the folder.
  A crash (or power loss) leaves the old file or the new one, never a mix.
- `append_line(path, line)`: append one JSONL line and fsync. A write that fails part-way
  (a full disk, a file-size limit) is cut back, so the file never ends in a half line.
- `writing(path)`: a block whose OS errors (ENOSPC, EFBIG, EACCES, EROFS, ...) become
  `WriteError("cannot write PATH: <OS error>")`; safetensors' and Arrow's wrapped I/O errors too.

`gradlab` exits with code 4 (`EXIT_WRITE`) on a `WriteError` (gradlab/loop/faults/exitcodes.py).
Imports nothing from gradlab: the run store, the instruments' manifest, provenance, the viewer
and the CLI all write through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

EXIT_WRITE = 4
# safetensors (Rust) and Arrow report OS errors inside their own exception text
_WRAPPED = re.compile(r"os error (\d+)|\[errno (\d+)\]", re.IGNORECASE)


class WriteError(OSError):
    """A run file could not be written (exit code 4): the message names the path and the OS
    error; the last complete checkpoint is untouched."""

    def __init__(self, path: str | Path, err: int | None, detail: str) -> None:
        super().__init__(err, detail, str(path))
        self.path = Path(path)
        self.detail = detail

    def __str__(self) -> str:
        code = f" [{errno.errorcode.get(self.errno, self.errno)}]" if self.errno else ""
        return f"cannot write {self.path}: {self.detail}{code}"


def _as_write_error(path: Path, e: BaseException) -> WriteError | None:
    if isinstance(e, WriteError):
        return e
    if type(e).__module__.startswith("gradlab"):  # gradlab's own errors (a run in use) stay
        return None
    if isinstance(e, OSError):
        err = e.errno
        m = None if e.strerror and err else _WRAPPED.search(str(e))
        if m:
            err = int(m.group(1) or m.group(2))
        return WriteError(path, err, os.strerror(err) if err else str(e))
    m = _WRAPPED.search(str(e))
    if m:  # e.g. SafetensorError('... I/O error: File too large (os error 27)')
        err = int(m.group(1) or m.group(2))
        return WriteError(path, err, os.strerror(err))
    return None


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an I/O failure inside the block into `WriteError` naming `path`."""
    try:
        yield
    except Exception as e:
        w = _as_write_error(Path(path), e)
        if w is None:
            raise
        raise w from None


def fsync_file(path: str | Path) -> None:
    """Make a file's content durable (it was written by a library that does not fsync)."""
    with writing(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside folder `path` durable (best effort: not every file system can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: str | Path, data: str | bytes) -> None:
    """Atomically replace `path` with `data` (temp name, fsync, rename, fsync the folder)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(path.name + ".tmp")
    with writing(path):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(raw)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            remove(tmp)
            raise
    fsync_dir(path.parent)


def append_line(path: str | Path, line: str) -> None:
    """Append `line` + newline and fsync; on failure the file is cut back to its old length."""
    path = Path(path)
    raw = (line + "\n").encode("utf-8")
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(raw)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)  # no half line left behind
                raise
        finally:
            os.close(fd)


def remove(path: str | Path) -> None:
    """Delete a file or folder if it exists (cleanup after a failed write: never raises)."""
    p = Path(path)
    with contextlib.suppress(OSError):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
