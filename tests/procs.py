"""Processes of the multi-process tests: run a launcher (torchrun, a notebook kernel...) with a
hard timeout that kills its whole process tree, and fail when any process it started outlives
it. Linux /proc only (no psutil); elsewhere `run_tree` is `subprocess.run` with a timeout.

torchrun starts each worker in a session of its own, so killing the launcher's process group
does not reach the workers, and a worker whose launcher died is re-parented: the tree is
followed through /proc while the launcher runs, and each process is named by (pid, start
time) so that a recycled pid is never taken for a survivor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

PROC = Path("/proc")

Key = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of `pid`, or None when it is gone."""
    try:
        rest = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[1]), rest[0], int(rest[19])


def children_map() -> dict[int, list[int]]:
    """parent pid → pids of its living (not zombie) children."""
    out: dict[int, list[int]] = {}
    for d in PROC.iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None and st[1] not in "ZX":
                out.setdefault(st[0], []).append(int(d.name))
    return out


def descendants(pid: int, kids: dict[int, list[int]] | None = None) -> set[Key]:
    """Every living process below `pid` (children, their children...), as (pid, start time);
    kids: a `children_map()` already read."""
    kids, out, todo = kids or children_map(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            st = _stat(c)
            if st is not None:
                out.add((c, st[2]))
                todo.append(c)
    return out


def alive(key: Key) -> bool:
    """Whether the process `key` still runs (a zombie has ended)."""
    st = _stat(key[0])
    return st is not None and st[2] == key[1] and st[1] not in "ZX"


def cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def kill(keys: set[Key]) -> None:
    """SIGKILL each process of `keys` that still runs."""
    for k in keys:
        if alive(k):
            try:
                os.kill(k[0], signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_gone(keys: set[Key], grace: float) -> set[Key]:
    """The processes of `keys` still running after `grace` seconds."""
    deadline = time.monotonic() + grace
    left = {k for k in keys if alive(k)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {k for k in left if alive(k)}
    return left


def describe(keys: set[Key]) -> str:
    return "; ".join(f"pid {p}: {cmdline(p)}" for p, _ in sorted(keys))


def run_tree(cmd: list[str], timeout: float, grace: float = 10.0, together: float | None = None,
             **kw) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`, except that
    - the launcher runs in a session of its own, and every process below it is recorded while
      it runs (every 0.2 s);
    - past `timeout` seconds the launcher, its process group and every recorded process are
      killed (SIGKILL), and AssertionError says so with the output's tail;
    - when the launcher has ended, a recorded process still running after `grace` seconds is
      killed and AssertionError names it: a job must end on every rank."""
    if not PROC.exists():
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    seen: set[Key] = set()
    ranks: set[Key] = set()  # the launcher's own children
    deadline = time.monotonic() + timeout
    first_end = None  # when the first rank ended
    out = err = None
    while p.poll() is None:  # (communicate alone would wait for a survivor holding the pipes)
        kids = children_map()
        now = descendants(p.pid, kids)
        seen |= now
        ranks |= {k for k in now if k[0] in kids.get(p.pid, ())}
        try:
            out, err = p.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        running = {k for k in ranks if alive(k)}
        if together is not None and first_end is None and running != ranks:
            first_end = time.monotonic()
        late = (together is not None and first_end is not None and running
                and time.monotonic() > first_end + together)
        if not late and time.monotonic() < deadline:
            continue
        why = (f"{len(running)} rank(s) still running {together:.0f} s after another ended "
               f"({describe(running)})" if late else f"still running after {timeout:.0f} s")
        seen |= descendants(p.pid)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill(seen)
        out, err = p.communicate()
        raise AssertionError(f"{' '.join(cmd[:6])}...: {why}: killed it and the {len(seen)} "
                             f"processes below it; output:\n{out[-2000:]}\n{err[-3000:]}")
    left = wait_gone(seen, grace)
    names = describe(left)
    kill(left)
    if out is None:  # the launcher ended: its output, unless an unseen process holds the pipes
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise AssertionError(f"{' '.join(cmd[:6])}...: ended, but a process of its session "
                                 f"held its output open 60 s later (killed)") from None
    if left:
        raise AssertionError(f"{len(left)} process(es) still running {grace:.0f} s after the "
                             f"launcher ended (exit {p.returncode}), killed: {names}\n"
                             f"output:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)

# multiprocessing's helpers, started once by a process that uses it and ended with it
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def become_subreaper() -> bool:
    """Make this process the child subreaper of everything it starts (Linux prctl), so that a
    process whose parent ended is re-parented here rather than to init, where
    `leftover_children` finds it. False where that is not possible."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def leftover_children(grace: float) -> dict[Key, str]:
    """This process's children (multiprocessing's helpers aside) still running after `grace`
    seconds, with their command lines."""
    pid = os.getpid()
    kids = {k for k in descendants(pid) if (_stat(k[0]) or (0,))[0] == pid
            and not any(h in cmdline(k[0]) for h in _HELPERS)}
    return {k: cmdline(k[0]) for k in wait_gone(kids, grace)}


def reap() -> None:
    """Collect the exit status of this process's ended children (re-parented orphans)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return
