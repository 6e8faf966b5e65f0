"""The job of tests/test_teardown.py: `torchrun --nproc_per_node=2 tests/teardown_child.py OUT N`.

Each rank calls `gradlab.train` N times in one process on a tiny run (1 rollout step,
2 prompts × G = 2, no probes), each call joining and leaving its own process group: rounds
alternate DDP and FSDP; the second-to-last round's loss raises on every rank (the error path),
the last one sends SIGTERM to rank 1 during its step (the signal path: every rank stops after
the step and raises `Preempted`). After each call the rank sleeps a rank-dependent moment and
collects garbage, so a wrapper left over from the call would be freed while the other rank is
already in the next round (or gone).

`torch.distributed.destroy_process_group` is observed (the real one still runs): each call
records how many DDP / FSDP wrappers are alive at that moment, garbage not yet collected
included. Rank r writes OUT/rank{r}.json: {"rounds": [how each round ended], "alive": [the
count at each destroy]}.

The file is also the module of the run's own losses (`teardown_child.py:boom`, `:term`).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch


def boom(batch):
    """A loss that raises on every rank (the run ends with UserLossError, exit code 3)."""
    raise RuntimeError("deliberate failure")


def term(batch):
    """GRPO's sequence-mean surrogate at ratio 1; rank 1 sends itself SIGTERM first."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    m = batch.mask.float()  # (B, T)
    per_seq = (batch.logps * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    return -(batch.advantages * per_seq).sum() / batch.norm_seqs


def _wrappers() -> int:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    kinds = (DistributedDataParallel, FSDPModule)
    return sum(issubclass(type(o), kinds) for o in gc.get_objects())


def main(out: Path, rounds: int) -> None:
    import torch.distributed as dist

    from gradlab.core.userloss import UserLossError
    from gradlab.loop.config import RunConfig
    from gradlab.loop.faults.preempt import Preempted
    from gradlab.loop.train import train

    alive: list[int] = []
    destroy = dist.destroy_process_group

    def observed(*a, **k):
        alive.append(_wrappers())
        return destroy(*a, **k)

    dist.destroy_process_group = observed
    here = Path(__file__).resolve()
    ended = []
    for i in range(rounds):
        obj = ("grpo" if i < rounds - 2 else f"{here}:boom" if i == rounds - 2 else f"{here}:term")
        cfg = RunConfig(out=str(out / f"round{i}"), objectives=[obj], steps=1, prompts=2, G=2,
                        minibatches=1, max_new_tokens=4, instruments="off", tax_every=0,
                        eval_every=0, trace_every=0, progress=False, ckpt_every=1, fsdp=i % 2 == 1)
        try:
            train(cfg)
            ended.append("ok")
        except UserLossError:
            ended.append("error")
        except Preempted:
            ended.append("preempted")
        time.sleep(0.2 * int(os.environ["RANK"]))
        gc.collect()
    rank = os.environ["RANK"]
    (out / f"rank{rank}.json").write_text(json.dumps({"rounds": ended, "alive": alive}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), int(sys.argv[2]))
