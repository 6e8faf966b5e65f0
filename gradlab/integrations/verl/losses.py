"""gradlab inside verl's actor update: verl's actor as a host of gradlab's instruments, on
verl's *own* policy losses, and DFPO.

Importing this module registers, in verl's policy-loss registry (verl ≥ 0.9,
`verl.trainer.ppo.core_algos`), for every loss registered at that moment (`register(base)` adds
one registered later):

    gradlab_measure:<base>                 verl's <base> unchanged (same value, same gradient),
                                           plus `gradlab/<metric>` in its metrics dict
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

(uid: verl's per-prompt id, any hashable per row; `last` closes the mini-batch). Importing this module does that for verl's actor: it routes
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

What is measured: verl gives W, the batch and the loss's closed form (`HOSTS["verl"]`), not the
model nor the gradient. Each loss call adds its W (W̃ under DFPO: what the backward uses), its
TokenBatch and its closed form (`parts.closed_form`; None where gradlab has none) to the open
mini-batch (one optimizer step); its last call runs the chosen instruments (`use_instruments`,
default the `cheap` preset: modulation, residual) once on one `HostView` of the whole
mini-batch and adds their metrics, under the loop's names, as `gradlab/<metric>`.
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
from ...instruments import InstrumentSet, reduce_readings, resolve
from ...instruments.host import HOSTS, MISSING, HostView

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
GIVES = HOSTS["verl"]  # W, the batch and the loss's closed form: no model, no gradient
DEFAULT = "cheap"  # modulation (w_dev, w_max) and residual (ρ) on every mini-batch
INSTRUMENTS = InstrumentSet()


def use_instruments(spec: str | list | None = None) -> InstrumentSet:
    """Run these instruments (a `gradlab.instruments.resolve` spec or list; None or "": the
    `cheap` preset, "off": none) on every mini-batch's `HostView`, reported as `gradlab/<metric>` under
    the loop's names; `@k` counts mini-batches. An instrument that needs what verl's actor does
    not give (`HOSTS["verl"]`: the model, the gradient, entropy) is refused here, in one line.
    The workers read GRADLAB_INSTRUMENTS on import."""
    global INSTRUMENTS
    chosen = InstrumentSet(resolve(spec or DEFAULT))
    for inst in chosen:
        missing = sorted(set(inst.needs) - GIVES)
        if missing:
            why = "; ".join(MISSING.get(("verl", n), f"verl gives no {n}") for n in missing)
            raise ValueError(f"instrument {inst.name!r} needs {', '.join(missing)}, which verl's "
                             f"actor does not give: {why}")
        if inst.phase != "step":
            raise ValueError(f"instrument {inst.name!r} runs around the optimizer step (phase "
                             f"{inst.phase!r}); verl's policy loss runs before the backward and "
                             "sees no optimizer step")
    INSTRUMENTS = chosen
    return chosen


use_instruments(os.environ.get("GRADLAB_INSTRUMENTS"))


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
from .parts import (  # noqa: E402,F401
    DFPOForm,
    MiniBatchForm,
    closed_form,
    dfpo_delta,
    global_totals,
    row_advantages,
)

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


def _batch(mb: _MicroBatch, old_log_prob, log_prob, advantages, response_mask, *, config,
           strict: bool, who: str) -> TokenBatch:
    """The loss call's TokenBatch; group labels stable over the open mini-batch."""
    mini = getattr(_state, "mini", None) or _MiniBatch()
    _state.mini = mini
    labels = [mini.labels.setdefault(u, len(mini.labels)) for u in mb.uid]
    mask = response_mask.bool()
    return TokenBatch(tokens=mb.responses.to(log_prob.device), mask=mask,
                      logps=log_prob.detach(), old_logps=old_log_prob.detach(),
                      advantages=row_advantages(advantages, mask, strict, who, tokens=True),
                      group=torch.tensor(labels, dtype=torch.long, device=log_prob.device),
                      validate=False, **global_totals(config))


def _close(mini: _MiniBatch) -> dict[str, float]:
    """The closed mini-batch (one optimizer step) as ONE `HostView` of all its loss calls,
    measured by the instruments due at this thread's mini-batch count; {metric: float}, the
    instruments' numbers under the loop's names plus the host facts `split_groups_micro` and
    `micro_batches`."""
    parts = mini.parts
    Tm = max(p["batch"].T for p in parts)

    def cat(get, fill=0):
        return torch.cat([torch.nn.functional.pad(get(p), (0, Tm - p["batch"].T), value=fill)
                          for p in parts])

    W = cat(lambda p: p["W"].double())
    micro = torch.cat([torch.full((p["batch"].B,), k, dtype=torch.long)
                       for k, p in enumerate(parts)]).to(W.device)
    group = torch.cat([p["batch"].group for p in parts])
    batch = TokenBatch(tokens=cat(lambda p: p["batch"].tokens),
                       mask=cat(lambda p: p["batch"].mask, False),
                       logps=cat(lambda p: p["batch"].logps.double()),
                       old_logps=cat(lambda p: p["batch"].old_logps.double()),
                       advantages=cat(lambda p: p["batch"].adv_tokens.double())
                       if any(p["batch"].advantages.dim() == 2 for p in parts)
                       else torch.cat([p["batch"].advantages.double() for p in parts]),
                       group=group, validate=False)
    forms = [p["form"] for p in parts]
    objective = None if any(f is None for f in forms) else MiniBatchForm(
        [(f, p["batch"]) for f, p in zip(forms, parts)], getattr(forms[0], "name", "verl"))
    view = HostView(batch=batch, W=W, objective=objective, trained_batch=batch)
    step = _state.minis = getattr(_state, "minis", -1) + 1  # this thread's mini-batch count
    due = [i for i in INSTRUMENTS.due(step, "step") if objective is not None
           or "objective" not in i.needs]  # no closed form: no w_dev (attribution is refused)
    out = reduce_readings([i.measure(view) for i in due], [q for i in due for q in i.quantities()],
                          {"n_tokens": float(batch.mask.sum())})
    out.update(split_groups_micro=split_share(group, micro), micro_batches=float(len(parts)))
    return out


def _closed_form(name: str, base: str, agg: str, config, T: int, transform: str | None = None):
    """gradlab's closed form of this loss call (`parts.closed_form`, under DFPO with W̃'s rule on
    top), or None where gradlab has none; a requested `attribution` is refused then, before
    verl's loss runs."""
    form = closed_form(base, agg, config, T)
    if form is None:
        if INSTRUMENTS.get("attribution") is not None:
            raise ValueError(f"instrument 'attribution' needs gradlab's closed form of verl's loss "
                             f"mode {name!r} with loss_agg_mode={agg!r}, which gradlab has not "
                             "(it has: vanilla with token-mean, seq-mean-token-mean or "
                             "seq-mean-token-sum-norm; gspo with seq-mean-token-mean)")
        return None
    return form if transform is None else DFPOForm(form, transform, SETTINGS.nodes, SETTINGS.scope)


def _gather(batch: TokenBatch, W: Tensor, form, last: bool) -> dict[str, float]:
    """Add the loss call's batch, W and closed form to the open mini-batch; on its last call,
    close it: the instruments' `gradlab/<metric>` figures (nothing on the other calls)."""
    mini = _state.mini
    mini.parts.append({"batch": batch, "W": W.detach(), "form": form})
    if not last:
        return {}
    _state.mini = None
    return _report(_close(mini))


def _modulation(loss: Tensor, log_prob: Tensor) -> Tensor:
    """W = −∂loss/∂log_prob (B, T), the loss graph only (see the module doc)."""
    if not log_prob.requires_grad:
        raise ValueError("gradlab verl: log_prob does not require grad (called under no_grad?)")
    (g,) = torch.autograd.grad(loss, log_prob, retain_graph=True, allow_unused=True)
    return torch.zeros_like(log_prob) if g is None else -g.detach()


def _report(mini_done: dict[str, float]) -> dict[str, float]:
    """`gradlab/<metric>` for verl's metrics dict, without the undefined (NaN) ones: verl
    averages a key over the calls that report it, so an undefined ρ is left out, never a 0."""
    return {f"gradlab/{k}": v for k, v in mini_done.items() if not math.isnan(v)}


def _measure_fn(base: str):
    name = f"{MEASURE}:{base}"

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                config=None, rollout_is_weights=None):
        mb = _current(name, log_prob)
        form = _closed_form(name, base, loss_agg_mode, config, log_prob.shape[1])
        loss, metrics = core_algos.get_policy_loss_fn(base)(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
            response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
            rollout_is_weights=rollout_is_weights)
        W = _modulation(loss, log_prob)
        _state.last = (W.double(), None)
        batch = _batch(mb, old_log_prob, log_prob, advantages, response_mask, config=config,
                       strict=False, who=name)
        return loss, {**metrics, **_gather(batch, W, form, mb.last)}

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

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                config=None, rollout_is_weights=None):
        mb = _current(name, log_prob)
        form = _closed_form(name, base, loss_agg_mode, config, log_prob.shape[1], transform)
        batch = _batch(mb, old_log_prob, log_prob, advantages, response_mask, config=config,
                       strict=True, who=name)
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
        return out, {**metrics, **_gather(batch, W_t, form, mb.last)}  # W̃: what the backward uses

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
