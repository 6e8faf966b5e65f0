"""One writer per run folder: an advisory lock on RUN/.lock holding the writer's pid and host.

`acquire(folder)` takes an exclusive `fcntl.flock` on RUN/.lock (non-blocking) and writes
"pid host start-time" into it. A second process that tries to write the same folder — a
second `gradlab tandem --out RUN`, or `--resume` of a run that is still going — gets
`RunInUseError`, one line naming the holder. The kernel drops the lock when the holder exits,
however it exits (kill -9 included), so a stale .lock file never blocks anyone: its text is
only read to name the holder of a *live* lock.

Within one process the lock is re-entrant (counted): a notebook may call `train` again on
the same folder, and `gradlab reproduce` writes figures after training. flock needs a local
file system (NFS may not honour it).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunInUseError(FileExistsError):
    """Another process holds the run folder's lock (the message names pid and host)."""


class RunLock:
    """A held lock on one run folder; `release()` when done (counted within the process)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd, self.count = path, fd, 1

    def release(self) -> None:
        self.count -= 1
        if self.count > 0 or self.fd < 0:
            return
        _HELD.pop(str(self.path), None)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


_HELD: dict[str, RunLock] = {}  # resolved lock-file path → this process's lock


def holder(folder: str | Path) -> str:
    """Who wrote the lock file last: 'pid P on host H since T' (or 'an unknown process')."""
    try:
        pid, host, since = (Path(folder) / LOCK_FILE).read_text().split(maxsplit=2)
        return f"pid {pid} on host {host} since {since.strip()}"
    except (OSError, ValueError):
        return "an unknown process"


def acquire(folder: str | Path) -> RunLock:
    """Lock run folder `folder` (which must exist) for writing, or raise `RunInUseError`."""
    path = (Path(folder) / LOCK_FILE).resolve()
    held = _HELD.get(str(path))
    if held is not None:
        held.count += 1
        return held
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunInUseError(
            f"run folder {folder} is in use by {holder(folder)} (a gradlab run is writing it); "
            "wait for it to finish or stop that process, then use --resume") from None
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {stamp}\n".encode(), 0)
    os.fsync(fd)
    lock = _HELD[str(path)] = RunLock(path, fd)
    return lock
