"""The exit codes of `gradlab run | tandem | reproduce` (and of each torchrun worker).

| code | meaning                                                | what is left on disk                 |
|------|--------------------------------------------------------|--------------------------------------|
| 0    | the run finished                                       | every step, last checkpoint          |
| 2    | bad arguments or input (option, task file, model       | nothing of the run is changed        |
|      | folder, corrupt run file, run folder in use)           |                                      |
| 3    | a non-finite loss, gradient or parameter (loop/guard)  | last checkpoint = last good state    |
| 4    | a run file could not be written (full disk, file-size  | the previous checkpoint, intact;     |
|      | limit, read-only or missing folder; gradlab/atomic)    | `--resume` continues from it         |
| 130  | stopped by SIGINT (Ctrl-C) after checkpointing         | a checkpoint at the stopping step    |
| 143  | stopped by SIGTERM or SIGUSR1 (a scheduler's           | a checkpoint at the stopping step    |
|      | pre-emption warning) after checkpointing (loop/preempt)|                                      |

Every non-zero exit prints one line on stderr naming what is at fault (and, after a signal, the
checkpoint and the exact command that resumes). 130 and 143 are the shell's 128 + signal
number, so schedulers and `torchrun` read them as "terminated by a signal".
"""

from ...atomic import EXIT_WRITE
from .guard import EXIT_NONFINITE

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

__all__ = ["EXIT_OK", "EXIT_USAGE", "EXIT_NONFINITE", "EXIT_WRITE", "EXIT_SIGINT", "EXIT_SIGTERM"]
