"""Test-wide settings: one intra-op thread (the tiny models here run faster on one thread, and
parallel subprocess tests would otherwise oversubscribe the 2-core machine).

No test leaves a process behind: pytest is made the subreaper of every process its tests start
(Linux), so a process whose parent has ended (a torchrun worker whose launcher was killed, a
browser's helper) stays its child; at the session's end a child still running 10 s later is
killed and named, and the session fails. Multi-process tests launch through
`procs.run_tree`, whose hard timeout kills the launcher's whole process tree."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the subprocess tests

import procs  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
if procs.PROC.exists():
    procs.become_subreaper()


def pytest_sessionfinish(session, exitstatus):
    if not procs.PROC.exists():
        return
    left = procs.leftover_children(grace=10)
    if left:
        procs.kill(set(left))
        session.exitstatus = 1
        lines = "\n".join(f"  pid {p}: {cmd}" for (p, _), cmd in sorted(left.items()))
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = f"processes left running by the tests (killed):\n{lines}"
        if tr is not None:
            tr.write_sep("=", "processes left behind", red=True)
            tr.write_line(msg)
        else:
            print(msg)
    procs.reap()
