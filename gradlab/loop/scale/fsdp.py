"""Sharded data parallelism: FSDP2 (`torch.distributed.fsdp.fully_shard`) under torchrun.

    torchrun --nproc_per_node=N -m gradlab tandem --fsdp ...   # gloo on CPU, nccl on CUDA

The data layout, normalisers and metric reductions are DDP's (gradlab.loop.scale.dist); what
changes is where the weights live. Each decoder layer and the root (embeddings, final norm,
LM head) is one FSDP unit: every rank stores 1/N of each parameter, gradient and AdamW moment,
and a forward all-gathers one unit at a time. Every forward of a sharded model is therefore a
collective, and ranks must issue the same forwards in the same order. The loop keeps that
lock-step in two ways:

- optimizer steps: every rank runs the same number of micro-batch forward/backward passes
  (the maximum over ranks; a rank with fewer groups pads with passes on one row whose loss is
  multiplied by 0). FSDP reduce-scatters each backward's gradients, averaged over ranks;
  `Dist.fix_grads` multiplies by N, as under DDP, so the update is the single-process update.
- forwards whose number differs per rank (sampling with early stopping, the drift probes and
  learning tax on each rank's own nodes, the probe set, held-out evaluation): `gathered`
  all-gathers every unit once, at a point all ranks reach together, runs the local forwards
  (and the tax's `autograd.grad`) on the full weights without further communication, then
  frees them. Sampling and probes therefore hold the full parameters (not the optimizer
  state) for their duration, as verl's rollout does.

Under --amp each unit uses `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
(loop/numerics/precision.py): forwards all-gather bf16 copies of the float32 shards, gradients are
reduce-scattered in float32, and the shards, AdamW state and checkpoints stay float32.

The non-finite guard (loop/faults/guard.py) checks each rank's shard and the ranks take the worst
verdict. Checkpoints are gathered to full tensors (rank 0 writes them) in one process's format:
the same safetensors keys, AdamW state by parameter index; --resume cuts them back into shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """True when `model` was sharded by `shard`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (model.model.layers), else []."""
    body = getattr(model, "model", None)
    return list(getattr(body, "layers", None) or [])


def shard(model: torch.nn.Module, amp: bool = False) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (tied embeddings stay one parameter in the
    root unit); in place, returns the model. Every unit reshards after forward, the root too,
    so between passes a rank holds only its shards. amp: every unit gets
    `precision.fsdp_policy` (bf16 gathered weights, float32 shards and gradient reduction)."""
    from torch.distributed.fsdp import fully_shard

    from ..numerics.precision import fsdp_policy

    kw = {"mp_policy": fsdp_policy(True)} if amp else {}
    for layer in layers(model):
        fully_shard(layer, reshard_after_forward=True, **kw)
    fully_shard(model, reshard_after_forward=True, **kw)
    return model


@contextlib.contextmanager
def gathered(model: torch.nn.Module, grad: bool = False) -> Iterator[None]:
    """Full parameters on every rank for a block of local forwards (and, with grad=True,
    `torch.autograd.grad` calls: the learning tax).

    One all-gather per unit on entry (a collective: every rank must enter together), none
    inside, however many forwards each rank runs: units do not reshard after forward or
    backward and do not reduce-scatter gradients (autograd.grad leaves `.grad` alone anyway).
    The full weights are freed on exit. Without grad the block runs under `torch.no_grad()`.
    A model that is not sharded: only the grad mode.
    """
    mode = torch.enable_grad() if grad else torch.no_grad()
    if not is_sharded(model):
        with mode:
            yield
        return
    mods = _fsdp_modules(model)
    _local_mode(model, True)
    for m in mods:
        m.unshard()
    try:
        with mode:
            yield
    finally:
        for m in mods:
            m.reshard()
        _local_mode(model, False)


def _local_mode(model, on: bool) -> None:
    """Keep gathered weights across forwards and backwards, no gradient reduction (on), or
    the training defaults (off)."""
    model.set_reshard_after_forward(not on)
    model.set_reshard_after_backward(not on)
    model.set_requires_gradient_sync(not on)


class _Grad:
    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


class FullGrads:
    """`named_parameters()` whose `.grad` are the full (all-gathered) gradients of a sharded
    model, for `reduce_tax`'s ‖g_tax‖ / ‖g‖; every rank must build it (a collective per
    parameter). Holds one full gradient per rank while the heavy step's tax is reported."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.items = []
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if p.grad is not None else torch.zeros(
                p.shape, dtype=p.dtype, device=p.device)
            self.items.append((n, _Grad(g)))

    def named_parameters(self):
        return iter(self.items)


def rebuild_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer,
                      before: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """`opt` re-pointed at the sharded `model`'s parameters, in place, state kept.

    fully_shard replaces every parameter by a sharded one, so an optimizer built before
    sharding points at dead tensors. before: the plain model's `parameters()` before sharding,
    in order. State tensors shaped like their parameter (AdamW's moments, loaded by --resume)
    are cut to this rank's shard; scalars (`step`) are kept.
    """
    from collections import defaultdict

    from torch.distributed.tensor import distribute_tensor

    after = list(model.parameters())
    if len(after) != len(before):
        raise RuntimeError(f"sharding changed the parameter count: {len(before)} → {len(after)}")
    new_of = {id(p): q for p, q in zip(before, after)}
    state = defaultdict(dict)
    for p_old, p_new in zip(before, after):
        st = opt.state.get(p_old)
        if st:
            state[p_new] = {
                k: (distribute_tensor(v.to(p_new.device), p_new.device_mesh, p_new.placements,
                                      src_data_rank=None)  # every rank holds the same full tensor
                    if torch.is_tensor(v) and v.shape == p_old.shape else v)
                for k, v in st.items()}
    for g in opt.param_groups:
        g["params"] = [new_of[id(p)] for p in g["params"]]
    opt.state = state
    return opt


def _full(v, cache: dict, keep: bool):
    """The full tensor of a (possibly sharded) tensor, on CPU; a DTensor is all-gathered
    (a collective: every rank calls this in the same order). Tied parameters are one tensor."""
    loc = v.to_local() if hasattr(v, "to_local") else v
    key = (loc.untyped_storage().data_ptr(), loc.storage_offset(), tuple(v.shape))
    if loc.numel() and key in cache:  # state_dict() detaches: tied weights are new objects
        return cache[key]
    full = v.full_tensor() if hasattr(v, "full_tensor") else v
    out = full.detach().contiguous().cpu() if keep else None
    if loc.numel():
        cache[key] = out
    return out


class _Full:
    """A stand-in with `state_dict()` for `RunStore.save_checkpoint`."""

    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd


def full_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    keep: bool) -> tuple[_Full, _Full]:
    """(model, optimizer) stand-ins whose state dicts are the full, unsharded tensors in the
    layout of one process (keys, tied weights sharing one tensor, optimizer state by parameter
    index). Every rank must call it; only with keep=True (rank 0) are the tensors kept."""
    cache: dict = {}
    msd = {k: _full(v, cache, keep) for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    state = {i: {k: (_full(v, cache, keep) if torch.is_tensor(v) else v) for k, v in s.items()}
             for i, s in osd["state"].items()}
    return _Full(msd), _Full({"state": state, "param_groups": osd["param_groups"]})
