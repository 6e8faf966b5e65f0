"""Prop. 3.1 on real steps: the Fisher quadratic form ½ δᵀF(h)δ of a parameter step δ at a
context h, against the measured KL(π_θ(·|h) ‖ π_θ+δ(·|h)) (docs/concepts/drift.md).

F(h) is the Fisher of the next-token distribution at h: F = Σ_y π_y ∇log π_y ∇log π_yᵀ.
Since E_π[∇log π] = 0,

    δᵀ F δ = Var_{y~π}[⟨∇log π(y|h), δ⟩] = Σ_y π_y (J_y·δ − Σ_v π_v J_v·δ)²,

with J_y·δ the directional derivative of log π(y|h) along δ. One forward-mode pass
(`torch.func.jvp`) gives J·δ for every y at once: exact, and never forms the (V × P) Jacobian.
KL(π_θ ‖ π_θ+δ) = ½ δᵀFδ + O(‖δ‖³), so on small steps the two agree; where they do not, the
step is not small (or the measurement is not precise enough: measure in float64).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import jvp

Params = dict[str, Tensor]
F64_ATTN = "gradlab_float64"


def _attention_f64(module, query, key, value, attention_mask, *, scaling, dropout=0.0, **kwargs):
    """HF's eager attention without its float32 softmax (which rounds a float64 model)."""
    rep = query.shape[1] // key.shape[1]  # grouped-query heads
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def _rmsnorm_f64(self, h: Tensor) -> Tensor:
    """Qwen3/Llama RMSNorm in the input's precision (HF's upcast to float32 rounds float64)."""
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def float64_meter(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of an HF causal LM for measurement (eval mode): every op in float64, so a
    KL of ~1e-9 nats between two nearby parameter vectors is not rounding noise. Patches the
    attention (an eager attention with a float64 softmax, registered as F64_ATTN) and the
    RMSNorms; the float32 rotary tables stay (a fixed function of the positions, not of θ)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(F64_ATTN, _attention_f64)
    AttentionMaskInterface.register(F64_ATTN, AttentionMaskInterface._global_mapping["eager"])
    meter = copy.deepcopy(model).double().eval()
    # a forward set on the instance (accelerate's output-casting wrapper on a TRL model) is
    # bound to the original model: the copy would run the original's float32 weights
    meter.__dict__.pop("forward", None)
    meter.config._attn_implementation = F64_ATTN
    for m in meter.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_rmsnorm_f64, m)
    return meter


def half_fisher_form(logp: Tensor, dlogp: Tensor) -> Tensor:
    """½ Var_{y~π}[dlogp_y] per context: (K, V), (K, V) → (K,) (nats).

    logp: log π(·|h) (log-softmax); dlogp: its directional derivative J·δ along a step δ
    (from `logprob_jvp`). The centring makes it exact for logit derivatives too (a shift of
    all V entries by one constant leaves the variance unchanged).
    """
    if logp.shape != dlogp.shape:
        raise ValueError(f"half_fisher_form: shapes differ, {tuple(logp.shape)} vs {tuple(dlogp.shape)}")
    p = logp.exp()
    mean = (p * dlogp).sum(-1, keepdim=True)
    return 0.5 * (p * (dlogp - mean) ** 2).sum(-1)


def logprob_jvp(f: Callable[[Params], Tensor], params: Params, delta: Params) -> tuple[Tensor, Tensor]:
    """(f(params), J_f(params)·delta) by one forward-mode pass; f maps a parameter dict to the
    (K, V) log-probs at K contexts. delta must have the keys and shapes of params."""
    if set(delta) != set(params):
        raise ValueError(f"logprob_jvp: delta's keys differ from params' "
                         f"(missing {sorted(set(params) - set(delta))[:3]}, extra {sorted(set(delta) - set(params))[:3]})")
    tangent = {n: delta[n].to(params[n].dtype) for n in params}
    return jvp(f, (params,), (tangent,))


def kl_and_fisher(f: Callable[[Params], Tensor], before: Params, after: Params,
                  directions: dict[str, Params]) -> dict[str, Tensor]:
    """At the contexts of f: measured KL(π_before ‖ π_after) and ½ dᵀF(h)d for each direction.

    before/after: parameter dicts (θ and θ+); directions: {name: step dict}, e.g. {"delta":
    after − before, "res": the residual's part}. Returns {"kl": (K,), "logp": (K, V) at θ,
    f"half_{name}": (K,) per direction} (nats).
    """
    with torch.no_grad():
        lp_after = f(after)
    out: dict[str, Tensor] = {}
    for name, d in directions.items():
        lp, dlp = logprob_jvp(f, before, d)
        out[f"half_{name}"] = half_fisher_form(lp.detach(), dlp.detach())
        out["logp"] = lp.detach()
    if "logp" not in out:
        with torch.no_grad():
            out["logp"] = f(before)
    lp = out["logp"]
    out["kl"] = (lp.exp() * (lp - lp_after)).sum(-1)
    return out


def adam_step_parts(opt: torch.optim.Optimizer, params: Params, grads: dict[str, Params]
                    ) -> dict[str, Params]:
    """The part of an Adam(W) step that this step's gradient pieces account for (ours).

    Call right after `opt.step()`. With the state (t, v_t) of that step, torch's update is
    δ = −(lr / (1 − β1^t)) · m_t / (√v_t / √(1 − β2^t) + ε) − lr·wd·θ, and m_t = β1 m_{t−1} +
    (1 − β1) g_t. Holding the preconditioner v_t fixed, a piece g' of g_t contributes
    δ' = −(lr / (1 − β1^t)) (1 − β1) g' / (√v_t / √(1 − β2^t) + ε): linear in g', so the pieces
    (e.g. the clipped g_tax) add up to the current step's share of δ; the rest of δ is momentum
    from earlier steps (and weight decay). Also returns "adam": the full update rebuilt from the
    state (m_t included, no weight decay), to check against the step actually taken.

    params: {name: parameter of opt}; grads: {piece name: {name: tensor like the parameter}}.
    """
    out: dict[str, Params] = {k: {} for k in grads}
    out["adam"] = {}
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for n, p in params.items():
        g = group_of[id(p)]
        st = opt.state[p]
        b1, b2 = g["betas"]
        t = float(st["step"])
        denom = st["exp_avg_sq"].sqrt() / (1 - b2 ** t) ** 0.5 + g["eps"]
        step = g["lr"] / (1 - b1 ** t)
        out["adam"][n] = -step * st["exp_avg"] / denom
        for k, piece in grads.items():
            out[k][n] = -step * (1 - b1) * piece[n] / denom
    return out
