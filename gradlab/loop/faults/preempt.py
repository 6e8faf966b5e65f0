"""Pre-emption: SIGTERM, SIGUSR1 (a scheduler's warning) or SIGINT stop a run cleanly.

While `train` runs, `StopSignals` replaces the handlers of these signals by one that only
records the first signal. At the end of each rollout step the loop asks `requested(D)`; the
step in flight (all its optimizer steps, every objective) is finished, then the run writes its
metrics and a checkpoint at that step, and `train` raises `Preempted`. The `gradlab` command
prints one line naming the checkpoint and the command that resumes, and exits with 143 after
SIGTERM or SIGUSR1, 130 after SIGINT (gradlab/loop/faults/exitcodes.py). `--resume` then continues
exactly as if the run had not stopped (same metrics at a fixed thread count).

- A signal while the run starts (loading the model, restoring a checkpoint) is recorded the
  same way: the run stops after its first step.
- A second signal while the run finishes its step or saves is recorded and reported, never
  acted on: the save completes (SIGKILL still stops at once; the previous checkpoint survives,
  gradlab/atomic.py).
- Under torchrun every rank joins one all-reduce (max) of its stop flag per rollout step, so
  all ranks stop after the same step, whichever of them got the signal, and none hangs.
- Handlers are installed only from the main thread and put back when `train` returns; the
  `gradlab` command (`ignore_after_stop`) ignores these signals once it has stopped, so a late
  signal cannot turn exit code 143 into a kill while it prints and exits.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch

from .exitcodes import EXIT_SIGINT, EXIT_SIGTERM

SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, n))


class Preempted(Exception):
    """The run stopped on a signal after checkpointing `step` rollout steps (exit 143 / 130)."""

    def __init__(self, signum: int, step: int, steps: int, out: Path, main: bool = True) -> None:
        self.signum, self.step, self.steps, self.out, self.main = signum, step, steps, Path(out), main
        super().__init__(self.describe("train(cfg, resume=True)"))

    @property
    def exit_code(self) -> int:
        return EXIT_SIGINT if self.signum == signal.SIGINT else EXIT_SIGTERM

    def describe(self, resume: str) -> str:
        """The one line: signal, checkpoint, and `resume` (the command that continues)."""
        name = signal.Signals(self.signum).name
        return (f"stopped by {name} after {self.step} of {self.steps} steps; checkpoint "
                f"{self.out / 'checkpoints'} (step {self.step}); resume with: {resume}")


class StopSignals:
    """Record SIGTERM / SIGINT / SIGUSR1 instead of dying (a context manager around training)."""

    ignore_after_stop = False  # set by the `gradlab` command (a process that is about to exit)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, signal.SIG_IGN if self.signum and self.ignore_after_stop else h)
        self._old = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            msg = f"gradlab: {name}: finishing the step in flight, then checkpointing\n"
        else:  # os.write: print() is not safe to re-enter from a signal handler
            msg = (f"gradlab: {name} again: still saving, the checkpoint will be complete "
                   "(SIGKILL stops at once; the previous checkpoint survives)\n")
        os.write(2, msg.encode())

    def requested(self, D, device: str = "cpu") -> int:
        """The signal every rank agrees to stop on (0: go on). A collective under torchrun:
        every rank calls it once per rollout step."""
        flag = self.signum or 0
        if D.enabled:
            flag = int(D.max(torch.tensor(flag, device=device)))
        return flag
