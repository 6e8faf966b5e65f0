"""Data parallelism on PyTorch's distributed runtime (torchrun + DistributedDataParallel).

    torchrun --nproc_per_node=N -m gradlab tandem ...     # gloo on CPU, nccl on CUDA

What is sharded: the prompts of each rollout batch (prompt g goes to rank g mod N, so every
group stays whole on one rank); rollouts, rewards and advantages are per rank. What is reduced:
gradients by DDP (then scaled so the update equals the single-process update on the global
batch, see `Dist.fix_grads`), the loss normalisers' totals (sequences, tokens, width) before
each loss, and the metrics as sums, counts and maxima (never averages of ratios). Rank 0 alone
writes the run store and checkpoints. With --fsdp the policy is sharded with FSDP2 instead of
replicated (gradlab.loop.scale.fsdp); layout and reductions stay these.

Every rank ends in one order (`Dist.teardown`, run by `with setup(...) as D:`): a barrier,
then the DDP / FSDP wrappers and everything holding them (learners, optimizers) released and
garbage-collected, then the process group destroyed. A wrapper holds the process group (DDP's
reducer, FSDP's parameter groups) and sits in a reference cycle, so without the collection it
is freed at some later garbage collection or at interpreter exit, after the group is gone: the
group's destructor then joins gloo's worker threads while holding the GIL, and a worker that is
waiting for the GIL never ends, so the rank blocks for good (at 0 % CPU).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import traceback
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    fsdp: bool = False  # shard the policy with FSDP2 (loop/scale/fsdp.py) instead of DDP
    # weak references to the wrappers `wrap` made: teardown checks that none outlives the group
    _wrapped: list = field(default_factory=list, repr=False, compare=False)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def wrap(self, model: torch.nn.Module, amp: bool = False) -> torch.nn.Module:
        """DDP or (fsdp) FSDP2 around `model`; amp: FSDP2's bf16 mixed-precision policy."""
        if not self.enabled:
            return model
        if self.fsdp:
            from .fsdp import shard

            out = shard(model, amp)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            out = DDP(model, device_ids=None if not next(model.parameters()).is_cuda else [model.device])
        self._wrapped.append(weakref.ref(out))
        return out

    def fix_grads(self, model: torch.nn.Module) -> None:
        """DDP (and FSDP's reduce-scatter) averages gradients over ranks; the per-rank losses
        already use global normalisers (they sum to the global loss), so multiply back by the
        world size."""
        if self.enabled:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.world)

    def local_prompts(self, n: int) -> list[int]:
        """Global indices of the prompts this rank owns."""
        return list(range(self.rank, n, self.world))

    def __enter__(self) -> Dist:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.teardown(exc)

    def teardown(self, exc: BaseException | None = None) -> None:
        """Leave the process group, in this order on every rank:

        1. a barrier, when the block ended normally or on `Preempted` (every rank stops after
           the same step); after any other error the other ranks may never arrive, so none;
        2. the wrappers released: the frames of `exc`'s traceback (and of its cause and context)
           are cleared, which drops the learners, models and optimizers the failed code held,
           then a garbage collection frees the wrappers' reference cycles; a wrapper still
           referenced after that (held by the caller) is logged as a warning;
        3. the process group destroyed.

        The wrappers must live only in frames that have ended when this runs: `train` keeps
        them in `_train`, called inside the `with` block. One process: nothing to do."""
        if not (self.enabled and dist.is_initialized()):
            return
        from ..faults.preempt import Preempted

        try:
            if exc is None or isinstance(exc, Preempted):
                dist.barrier()
        finally:
            self._release(exc)
            dist.destroy_process_group()

    def _release(self, exc: BaseException | None) -> None:
        chain, todo = [], [exc]  # exc, its causes and contexts, each once
        while todo:
            e = todo.pop()
            if e is not None and all(e is not x for x in chain):
                chain.append(e)
                todo += [e.__cause__, e.__context__]
        for e in chain:
            traceback.clear_frames(e.__traceback__)  # an executing frame is left as it is
        gc.collect()
        alive = sum(r() is not None for r in self._wrapped)
        self._wrapped.clear()
        if alive:
            log.warning("gradlab: %d data-parallel wrapper(s) still referenced when the process "
                        "group is destroyed; their later release may block this rank", alive)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this job's workers (0: first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


_GROUPS = itertools.count()  # numbers the process groups this process joins (store prefixes)


def _init_process_group(backend: str, world: int) -> None:
    """Join the default group. Under torchrun the workers meet on the agent's key-value store,
    which outlives a restart and a destroyed group: keys left by the dead round or by an earlier
    group of this job (rank addresses, barrier counters) would be read by the new one, so each
    round, and each group within it (`train` called again in the same workers), uses its own
    key prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend)
        return
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=False, timeout=timedelta(minutes=10))
    store = dist.PrefixStore(f"gradlab/round{restart_count()}/group{next(_GROUPS)}/", store)
    dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=world)


def setup(device: str, fsdp: bool = False) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); else one process.
    fsdp: shard the policy (needs WORLD_SIZE ≥ 2: one process has nothing to shard across).
    Use it as `with setup(...) as D:`, so that every rank leaves the group in one order, on an
    error too (`Dist.teardown`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        if fsdp:
            raise ConfigError("--fsdp: shards the policy across torchrun ranks; launch with "
                              "torchrun --nproc_per_node=N (N ≥ 2), or drop --fsdp for one process")
        return Dist()
    if not dist.is_initialized():
        _init_process_group("nccl" if device.startswith("cuda") else "gloo", world)
    rank = dist.get_rank()
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return Dist(rank=rank, world=dist.get_world_size(), fsdp=fsdp)
