"""Test-wide settings: one intra-op thread (the tiny models here run faster on one thread, and
parallel subprocess tests would otherwise oversubscribe the 2-core machine)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the subprocess tests

import torch  # noqa: E402

torch.set_num_threads(1)
