"""gradlab inside verl's actor update: W and ρ of verl's *own* policy losses, and DFPO.

Importing this module registers, in verl's policy-loss registry (verl ≥ 0.9,
`verl.trainer.ppo.core_algos`), for every loss registered at that moment (`register(base)` adds
one registered later):

    gradlab_measure:<base>                 verl's <base> unchanged (same value, same gradient),
                                           plus `gradlab/*` figures in its metrics dict
    gradlab_dfpo  gradlab_dfpo:<base>  gradlab_dfpo:<base>:<transform>
                                           DFPO on verl's <base> (default vanilla, "orth")

verl selects one with `actor_rollout_ref.actor.policy_loss.loss_mode=gradlab_measure:vanilla`; the
module must be imported in every worker: `VERL_USE_EXTERNAL_MODULES=gradlab.integrations.verl`.
It also registers the IBPO advantage estimators `gradlab_ibpo[:<form>[:sqrt]]`
(`algorithm.adv_estimator=gradlab_ibpo:togo`) and feeds them the response token ids, which verl
does not pass to an estimator: `gradlab.integrations.verl.ibpo`.

What verl does not pass: a policy loss receives (old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights), all (B, T), and no token ids or group
ids; shared-token nodes need both. The caller supplies them for each loss call with

    with micro_batch(responses=data["responses"], uid=data["uid"], last=is_last_micro_batch):
        loss, metrics = policy_loss_fn(...)

(uid: verl's per-prompt id, any hashable per row; `last` closes the mini-batch, whose figures are
then added under `gradlab/mini/*`). Importing this module does that for verl's actor: it routes
verl's `ppo_loss` through `actor.gradlab_ppo_loss`, which reads them from the micro-batch.
Called some other way, without it, the gradlab losses raise a one-line error.

How W is read — *our choice*: verl logs the metrics dict before the backward, so a hook (which
fires in the backward) would come too late. W = −∂L/∂log_prob is taken inside the loss call by
`torch.autograd.grad(L, log_prob, retain_graph=True)`: the gradient of verl's loss graph at the
log-prob tensor (it stops there, no model backward), exactly what a hook on log_prob receives.

DFPO: W̃ = W + A(w̃ − w) with w = W/A on rows with A ≠ 0 (rows with A = 0 left out), the TRL
drop-in's rule (`gradlab.probes.DFPOGradientTransform` without weight); it assumes W = A·w, i.e.
no KL or entropy term inside the policy loss (verl adds those outside it). The returned loss is
L + Σ sg(W − W̃)·l − sg(Σ (W − W̃)·l): verl's value, gradient −W̃ at log_prob. Each group must be
whole in the loss call (`config.rollout_n` rows): else a ValueError names the group.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from verl.trainer.ppo import core_algos

from ...core.batch import TokenBatch, group_index, split_share
from ...core.dfpo import SCOPES, TRANSFORMS
from ...core.nodes import NODE_KINDS
from ...instruments import InstrumentSet, Residual, resolve
from ...instruments.window import OFFERED as WINDOW_GIVES
from ...instruments.window import WindowView, measure_window

MEASURE, DFPO = "gradlab_measure", "gradlab_dfpo"
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_DFPO_DEFAULT = ("vanilla", "orth")
_state = threading.local()  # per thread: the current micro-batch and the open mini-batch


@dataclass
class DFPOSettings:
    """Node kind and scope of `gradlab_dfpo` (transform and base come from the loss name)."""

    nodes: str = "prefix"
    scope: str = "shared"

    def __post_init__(self) -> None:
        for name, valid in (("nodes", NODE_KINDS), ("scope", SCOPES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"gradlab verl DFPO: {name}={getattr(self, name)!r}; valid: {valid}")


SETTINGS = DFPOSettings()
INSTRUMENTS = InstrumentSet()


def use_instruments(spec: str) -> InstrumentSet:
    """Run these instruments (`gradlab.instruments.resolve` spec) on every mini-batch's W and
    batch, reported as `gradlab/mini/<metric>`; the workers read GRADLAB_INSTRUMENTS on import."""
    global INSTRUMENTS
    chosen = InstrumentSet(resolve(spec) if spec else [])
    chosen.check(set(WINDOW_GIVES), "verl's mini-batch (W and the batch)")
    INSTRUMENTS = chosen
    return chosen


use_instruments(os.environ.get("GRADLAB_INSTRUMENTS", ""))


@dataclass
class _MicroBatch:
    responses: Tensor  # (B, T) long
    uid: list  # (B,) hashable
    last: bool


@dataclass
class _MiniBatch:
    """The loss calls of one mini-batch so far (one optimizer step)."""

    labels: dict = field(default_factory=dict)  # uid -> group label
    parts: list[dict] = field(default_factory=list)


# ----------------------------------------------------------------------------- the caller's side


@contextlib.contextmanager
def micro_batch(responses: Tensor, uid: Sequence | Tensor, last: bool = False) -> Iterator[None]:
    """Token and group ids of the loss call(s) inside the block.

    responses (B, T) long: the response token ids, aligned with verl's log_prob / response_mask.
    uid (B,): one hashable per row, equal within a prompt's group (verl's `uid`; a tensor or a
    numpy array works). last: this is the mini-batch's last micro-batch (closes it).
    """
    if not isinstance(responses, Tensor) or responses.dim() != 2:
        raise ValueError(f"gradlab micro_batch: responses must be a (B, T) tensor, got "
                         f"{getattr(responses, 'shape', type(responses).__name__)}")
    ids = uid.tolist() if hasattr(uid, "tolist") else list(uid)
    if len(ids) != responses.shape[0]:
        raise ValueError(f"gradlab micro_batch: uid has {len(ids)} entries, responses has "
                         f"{responses.shape[0]} rows")
    _state.micro = _MicroBatch(responses, ids, bool(last))
    try:
        yield
    finally:
        _state.micro = None


def reset() -> None:
    """Drop a half-gathered mini-batch (e.g. after an exception inside the update)."""
    _state.micro, _state.mini, _state.last = None, None, None


def last_modulation() -> tuple[Tensor, Tensor | None]:
    """(W, W_base) of this thread's last gradlab loss call, (B, T) float64 in the loss's units:
    W the modulation the backward uses (W̃ under DFPO), W_base verl's own (None when measuring)."""
    last = getattr(_state, "last", None)
    if last is None:
        raise RuntimeError("gradlab verl: no gradlab loss call yet in this thread")
    return last


# ----------------------------------------------------------------------------- pure helpers
from .parts import _global_totals, closed_form, dfpo_delta, row_advantages  # noqa: E402,F401

# ----------------------------------------------------------------------------- the loss calls


def _current(who: str, log_prob: Tensor) -> _MicroBatch:
    mb = getattr(_state, "micro", None)
    if mb is None:
        raise ValueError(f"{who}: no token/group ids for this loss call; verl passes none to a "
                         "policy loss: call it inside gradlab.integrations.verl.micro_batch("
                         "responses, uid) (docs/guides/verl.md)")
    if tuple(mb.responses.shape) != tuple(log_prob.shape):
        raise ValueError(f"{who}: micro_batch responses are {tuple(mb.responses.shape)}, "
                         f"log_prob is {tuple(log_prob.shape)}")
    return mb


def _batch(mb: _MicroBatch, old_log_prob, log_prob, advantages, response_mask, config,
           strict: bool, who: str) -> TokenBatch:
    """The loss call's TokenBatch; group labels stable over the open mini-batch."""
    mini = getattr(_state, "mini", None) or _MiniBatch()
    _state.mini = mini
    labels = [mini.labels.setdefault(u, len(mini.labels)) for u in mb.uid]
    mask = response_mask.bool()
    return TokenBatch(tokens=mb.responses.to(log_prob.device), mask=mask,
                      logps=log_prob.detach(), old_logps=old_log_prob.detach(),
                      advantages=row_advantages(advantages, mask, strict, who),
                      group=torch.tensor(labels, dtype=torch.long, device=log_prob.device),
                      validate=False, **_global_totals(config))


def _measure(W: Tensor, batch: TokenBatch, config, base: str, agg: str,
             W_base: Tensor | None) -> dict[str, float]:
    """Micro-batch figures (W̃ and W = W_base under DFPO); a ρ is NaN where undefined
    (no node of its kind, or W ≡ 0 there: every group tied)."""
    view = WindowView(batch, W)
    m = measure_window([Residual()], view)  # the loop's residual instrument, on the loss call
    out = {"rho_full": m["rho_prefix"], "rho_trie": m["rho_trie"],
           "shared_fraction": m["shared_frac_prefix"]}
    G = config.get("rollout_n") if hasattr(config, "get") else None
    if isinstance(G, int) and G > 0:
        _, sizes = group_index(batch.group)
        out["split_micro"] = float((sizes != G).float().mean()) if sizes.numel() else math.nan
    ref = W if W_base is None else W_base
    obj = closed_form(base, agg, config, batch.T)
    if obj is not None:
        Wc = obj.modulation(batch.replace(logps=batch.logps.to(torch.float64),
                                          old_logps=batch.old_logps.to(torch.float64),
                                          advantages=batch.advantages.to(torch.float64)))
        scale = float(ref.abs().max()) or 1.0  # W ≡ 0: the absolute deviation (0 = agree)
        out["W_dev"] = float((ref.double() - Wc).abs().max()) / scale  # relative to max |W|
    if W_base is not None:
        base = WindowView(batch, W_base, view.nodes())
        out["rho_full_base"] = measure_window([Residual()], base)["rho_prefix"]
    return out


def _record(batch: TokenBatch, W: Tensor, last: bool) -> dict[str, float]:
    """Add the loss call to the open mini-batch; on its last call, the mini-batch figures."""
    mini = _state.mini
    mini.parts.append({"batch": batch, "W": W.detach()})
    if not last:
        return {}
    _state.mini = None
    parts = mini.parts
    Tm = max(p["batch"].T for p in parts)

    def cat(get, fill=0):
        return torch.cat([torch.nn.functional.pad(get(p), (0, Tm - p["batch"].T), value=fill)
                          for p in parts])

    W = cat(lambda p: p["W"].double())
    micro = torch.cat([torch.full((p["batch"].B,), k, dtype=torch.long)
                       for k, p in enumerate(parts)]).to(W.device)
    group = torch.cat([p["batch"].group for p in parts])
    mb = TokenBatch(tokens=cat(lambda p: p["batch"].tokens), mask=cat(lambda p: p["batch"].mask, False),
                    logps=torch.zeros_like(W), old_logps=torch.zeros_like(W),
                    advantages=torch.cat([p["batch"].advantages.double() for p in parts]),
                    group=group, validate=False)
    view = WindowView(mb, W)
    m = measure_window([Residual()], view)
    out = {"mini/rho_full": m["rho_prefix"], "mini/rho_trie": m["rho_trie"],
           "mini/split": split_share(group, micro), "mini/micro_batches": float(len(parts))}
    step = _state.minis = getattr(_state, "minis", -1) + 1  # this thread's mini-batch count
    due = INSTRUMENTS.due(step)  # a user's instruments (`use_instruments`), once per mini-batch
    return {**out, **{f"mini/{k}": v for k, v in measure_window(due, view).items()}} if due else out


def _modulation(loss: Tensor, log_prob: Tensor) -> Tensor:
    """W = −∂loss/∂log_prob (B, T), the loss graph only (see the module doc)."""
    if not log_prob.requires_grad:
        raise ValueError("gradlab verl: log_prob does not require grad (called under no_grad?)")
    (g,) = torch.autograd.grad(loss, log_prob, retain_graph=True, allow_unused=True)
    return torch.zeros_like(log_prob) if g is None else -g.detach()


def _reported(ours: dict[str, float]) -> dict[str, float]:
    """The `gradlab/*` figures for verl without the undefined (NaN) ones: verl averages a key
    over the calls that report it, so an undefined ρ is left out, never a 0 or a NaN mean."""
    return {f"gradlab/{k}": v for k, v in ours.items() if not math.isnan(v)}


def _measure_fn(base: str):
    name = f"{MEASURE}:{base}"

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                config=None, rollout_is_weights=None):
        mb = _current(name, log_prob)
        loss, metrics = core_algos.get_policy_loss_fn(base)(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
            response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
            rollout_is_weights=rollout_is_weights)
        W = _modulation(loss, log_prob)
        _state.last = (W.double(), None)
        batch = _batch(mb, old_log_prob, log_prob, advantages, response_mask, config, False, name)
        ours = _measure(W, batch, config, base, loss_agg_mode, None)
        ours.update(_record(batch, W, mb.last))
        return loss, {**metrics, **_reported(ours)}

    loss_fn.__name__ = loss_fn.__qualname__ = f"gradlab_measure_{base}"
    return loss_fn


def _check_whole(batch: TokenBatch, uid: list, config, who: str) -> None:
    G = config.get("rollout_n") if hasattr(config, "get") else None
    if not isinstance(G, int) or G < 1:
        raise ValueError(f"{who}: config.rollout_n={G!r}; DFPO needs the group size")
    gid, sizes = group_index(batch.group)
    bad = (sizes != G).nonzero().squeeze(-1)
    if bad.numel():
        row = int((gid == bad[0]).nonzero()[0])
        raise ValueError(f"{who}: group uid={uid[row]!r} has {int(sizes[bad[0]])} of its "
                         f"rollout_n={G} rows in this loss call; DFPO needs every group whole in "
                         "one micro-batch (ppo_micro_batch_size_per_gpu a multiple of rollout.n, "
                         "no dynamic batch size, no row shuffle that cuts groups)")


def _dfpo_fn(base: str, transform: str):
    name = f"{DFPO}:{base}:{transform}"

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                config=None, rollout_is_weights=None):
        mb = _current(name, log_prob)
        batch = _batch(mb, old_log_prob, log_prob, advantages, response_mask, config, True, name)
        _check_whole(batch, mb.uid, config, name)
        loss, metrics = core_algos.get_policy_loss_fn(base)(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
            response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
            rollout_is_weights=rollout_is_weights)
        W = _modulation(loss, log_prob)
        delta = dfpo_delta(W.double(), batch, transform, SETTINGS.nodes, SETTINGS.scope)
        W_t = W.double() + delta
        _state.last = (W_t, W.double())
        extra = -(delta.to(log_prob.dtype) * log_prob).sum()  # gradient +delta·(−1) at log_prob
        out = loss + extra - extra.detach()
        ours = _measure(W_t, batch, config, base, loss_agg_mode, W.double())
        ours.update(_record(batch, W_t, mb.last))
        return out, {**metrics, **_reported(ours)}

    loss_fn.__name__ = loss_fn.__qualname__ = f"gradlab_dfpo_{base}_{transform}"
    return loss_fn


def _is_ours(name: str) -> bool:
    return name.startswith((MEASURE, DFPO))


def register(base: str) -> list[str]:
    """Register gradlab_measure:<base> and gradlab_dfpo:<base>[:<t>] for a verl loss; returns
    the names. `base` must already be in verl's registry."""
    if base not in core_algos.POLICY_LOSS_REGISTRY or _is_ours(base):
        raise ValueError(f"gradlab verl: {base!r} is not a verl policy loss; registered: "
                         f"{sorted(k for k in core_algos.POLICY_LOSS_REGISTRY if not _is_ours(k))}")
    names = {f"{MEASURE}:{base}": _measure_fn(base)}
    for t in TRANSFORMS:
        names[f"{DFPO}:{base}:{t}"] = _dfpo_fn(base, t)
    names[f"{DFPO}:{base}"] = names[f"{DFPO}:{base}:{_DFPO_DEFAULT[1]}"]
    if base == _DFPO_DEFAULT[0]:
        names[DFPO] = names[f"{DFPO}:{base}:{_DFPO_DEFAULT[1]}"]
    for n, fn in names.items():
        core_algos.register_policy_loss(n)(fn)
    return list(names)


def base_losses() -> list[str]:
    """verl's own registered policy losses (gradlab's names excluded)."""
    return sorted(k for k in core_algos.POLICY_LOSS_REGISTRY if not _is_ours(k))


for _base in base_losses():
    register(_base)

from .actor import install as _install  # noqa: E402 (needs the names above)
from .ibpo import install as _install_ibpo  # noqa: E402

_install(sys.modules[__name__])  # verl's actor loss → gradlab_ppo_loss, which supplies micro_batch(...) (actor.py)
_install_ibpo()  # the gradlab_ibpo advantage estimators and their token-id feed (ibpo.py)
