"""IBPO token advantages as a verl advantage estimator (trie reading, *ours*: docs/concepts/ibpo.md#reading-1-values-on-the-groups-prefix-trie).

`import gradlab.integrations.verl` registers, in verl's advantage-estimator registry
(`verl.trainer.ppo.core_algos.register_adv_est`, verl ≥ 0.9):

    gradlab_ibpo                  form ga+la
    gradlab_ibpo:<form>           form ga | la | ga+la | togo
    gradlab_ibpo:<form>:sqrt      the same, reweight="sqrt"

selected with `algorithm.adv_estimator=gradlab_ibpo:togo`. Each returns (advantages, returns),
both (bs, response_length) in the rewards' dtype, 0 off the response mask; returns = advantages
(no critic, as verl's GRPO). R_i = Σ_t token_level_rewards (verl's GRPO does the same); groups
are verl's `uid`. Scale: `algorithm.norm_adv_by_std_in_grpo` True (verl's default) divides by
the group's reward std + 1e-6 as verl's GRPO; False keeps raw reward units (Dr. GRPO).
The repair form needs repair rollouts, which verl does not make: not offered here.

What verl passes: its `compute_advantage` (verl/trainer/ppo/ray_trainer.py) calls a registered
estimator with `token_level_rewards`, `response_mask`, `config` (the `algorithm` config),
`index` (= `non_tensor_batch["uid"]`) and `reward_baselines` when present; `batch` and
`non_tensor_batch` go only to the estimator named "gdpo". No token ids, which the trie needs.
How they get there — *our choice*, the smallest change to verl that keeps its call as is:

  * The estimator takes `responses` (bs, response_length) as a keyword when a caller passes it,
    else reads this thread's `advantage_inputs(responses)` block, else raises a one-line error.
  * `gradlab_compute_advantage` is a drop-in for verl's `compute_advantage`: it enters that
    block with `data.batch["responses"]` and calls verl's function unchanged. It replaces
    `ray_trainer.compute_advantage`, which the legacy trainer and `v1/utils.py` call.
  * verl's v1 trainer (the default, `trainer.use_v1=True`) fetches a fixed field list from its
    TransferQueue for the advantage step, without `responses`: `PPOTrainer._compute_advantage`
    is wrapped to fetch them as verl's own validation code does (`tq.kv_batch_get(keys,
    partition_id, select_fields=["responses"])`) and enter the block around verl's method.

Both replacements are made when verl imports those modules (a post-import hook; at once when
already imported) and only act when `algorithm.adv_estimator` is one of ours. Nothing else in
verl changes. They run in the process that computes advantages (verl's driver / task runner),
which imports `verl` and so the modules in `VERL_USE_EXTERNAL_MODULES` like every worker.
Tested here: the registry, the estimator and verl's own `compute_advantage` source run on a
real `DataProto`; not tested: the v1 wrapper inside a Ray run with a TransferQueue.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from verl.trainer.ppo import core_algos

from ...core.credit import FORMS, process_advantages, reward_scale

PREFIX = "gradlab_ibpo"
VERL_EPS = 1e-6  # verl's GRPO: (R − mean) / (std + 1e-6)
_state = threading.local()


def estimator_names() -> list[str]:
    """Every name this module registers."""
    return [PREFIX] + [f"{PREFIX}:{f}{s}" for f in FORMS for s in ("", ":sqrt")]


def _spec(name: str) -> tuple[str, str]:
    parts = name.split(":")[1:]
    return (parts[0] if parts else "ga+la"), (parts[1] if len(parts) > 1 else "none")


@contextlib.contextmanager
def advantage_inputs(responses: Tensor) -> Iterator[None]:
    """Response token ids (bs, response_length) long for the estimator calls inside the block."""
    if not isinstance(responses, Tensor) or responses.dim() != 2:
        raise ValueError(f"gradlab advantage_inputs: responses must be a (bs, response_length) "
                         f"tensor, got {getattr(responses, 'shape', type(responses).__name__)}")
    prev, _state.responses = getattr(_state, "responses", None), responses
    try:
        yield
    finally:
        _state.responses = prev


def group_labels(index, n: int) -> Tensor:
    """(n,) long labels from verl's `index` (uid strings, numpy object array, list or tensor)."""
    ids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids) != n:
        raise ValueError(f"gradlab_ibpo: index has {len(ids)} entries, the batch {n} rows")
    seen: dict = {}
    return torch.tensor([seen.setdefault(u, len(seen)) for u in ids], dtype=torch.long)


def ibpo_advantage(token_level_rewards: Tensor, response_mask: Tensor, index=None, *, config=None,
                   responses: Tensor | None = None, form: str = "ga+la", reweight: str = "none",
                   **_unused) -> tuple[Tensor, Tensor]:
    """IBPO token advantages in verl's estimator signature → (advantages, returns), (bs, T).

    token_level_rewards (bs, T) float (summed per row to R_i), response_mask (bs, T), index
    (bs,) group ids, config verl's algorithm config (reads norm_adv_by_std_in_grpo), responses
    (bs, T) long: keyword, else the enclosing `advantage_inputs` block.
    """
    who = f"{PREFIX}:{form}" + (":sqrt" if reweight == "sqrt" else "")
    if index is None:
        raise ValueError(f"{who}: verl passed no index (the batch has no 'uid'); IBPO needs groups")
    resp = responses if responses is not None else getattr(_state, "responses", None)
    if resp is None:
        raise ValueError(f"{who}: no response token ids; verl passes none to an estimator: call it "
                         "inside gradlab.integrations.verl.ibpo.advantage_inputs(responses) or "
                         "through gradlab_compute_advantage (installed by importing "
                         "gradlab.integrations.verl)")
    if tuple(resp.shape) != tuple(response_mask.shape):
        raise ValueError(f"{who}: responses are {tuple(resp.shape)}, response_mask is "
                         f"{tuple(response_mask.shape)}")
    mask = response_mask.bool()
    R = token_level_rewards.sum(dim=-1)
    group = group_labels(index, R.shape[0]).to(R.device)
    A = process_advantages(resp.to(R.device), mask, group, R, form=form, reweight=reweight)
    get = getattr(config, "get", None)
    by_std = bool(get("norm_adv_by_std_in_grpo", True)) if get is not None else True
    div = reward_scale(R, group, "group" if by_std else "none", eps=VERL_EPS).to(A.dtype)
    A = A / div.unsqueeze(-1)
    return A, A


def register() -> list[str]:
    """Register every `gradlab_ibpo*` name in verl (idempotent); returns the names."""
    for name in estimator_names():
        if name in core_algos.ADV_ESTIMATOR_REGISTRY:
            continue
        form, rw = _spec(name)
        fn = functools.partial(ibpo_advantage, form=form, reweight=rw)
        core_algos.register_adv_est(name)(fn)
    return estimator_names()


def is_ours(adv_estimator) -> bool:
    name = getattr(adv_estimator, "value", adv_estimator)
    return isinstance(name, str) and name.split(":")[0] == PREFIX


# ----------------------------------------------------------------------------- verl's callers

_ORIGINAL: dict[str, Callable] = {}


def gradlab_compute_advantage(data, adv_estimator, *args, **kwargs):
    """verl's `compute_advantage`, inside `advantage_inputs(data.batch["responses"])` when the
    estimator is ours and the batch has the responses (else exactly verl's call)."""
    original = _ORIGINAL["compute_advantage"]
    if not is_ours(adv_estimator) or "responses" not in data.batch.keys():
        return original(data, adv_estimator, *args, **kwargs)
    with advantage_inputs(data.batch["responses"]):
        return original(data, adv_estimator, *args, **kwargs)


def _v1_compute_advantage(self, batch, metrics):
    """verl v1 `PPOTrainer._compute_advantage`, with the batch's responses fetched from the
    TransferQueue (verl's own call pattern) for our estimators."""
    original = _ORIGINAL["v1"]
    if not is_ours(self.config.algorithm.adv_estimator):
        return original(self, batch, metrics)
    import transfer_queue as tq

    got = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                          select_fields=["responses"])
    with advantage_inputs(got["responses"].to_padded_tensor(padding=0)):
        return original(self, batch, metrics)


def _patch_ray_trainer(module) -> None:
    if module.compute_advantage is not gradlab_compute_advantage:
        _ORIGINAL["compute_advantage"] = module.compute_advantage
        module.compute_advantage = gradlab_compute_advantage
    utils = sys.modules.get("verl.trainer.ppo.v1.utils")  # bound the name before we came
    if utils is not None and utils.compute_advantage is _ORIGINAL["compute_advantage"]:
        utils.compute_advantage = gradlab_compute_advantage


def _patch_v1(module) -> None:
    cls = module.PPOTrainer
    if cls._compute_advantage is not _v1_compute_advantage:
        _ORIGINAL["v1"] = cls._compute_advantage
        cls._compute_advantage = _v1_compute_advantage


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs fn(module) right after a named module is executed (a post-import hook)."""

    def __init__(self) -> None:
        self.pending: dict[str, Callable] = {}

    def find_spec(self, fullname, path, target=None):
        fn = self.pending.get(fullname)
        if fn is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.pending.pop(fullname, None)
            fn(module)

        spec.loader.exec_module = exec_module
        return spec


_HOOK = _AfterImport()


def after_import(name: str, fn: Callable) -> None:
    """fn(module) now if `name` is imported, else right after it is."""
    if name in sys.modules:
        fn(sys.modules[name])
        return
    _HOOK.pending[name] = fn
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def install() -> None:
    """Register the estimators and route verl's advantage step through the drop-ins above."""
    register()
    after_import("verl.trainer.ppo.ray_trainer", _patch_ray_trainer)
    after_import("verl.trainer.ppo.v1.trainer_base", _patch_v1)
