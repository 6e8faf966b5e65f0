"""The parameter-space learning tax: the part of the update paid for by shared-token residuals.

docs/concepts/tax.md: at node n the shared tokens contribute (Σ_{S_n} W) ∇θ l_rep(n) to −∇θL; of that,
c*_n ∇l is legitimate exchangeable credit and d_n = c_n − c*_n is the residual. So the loss
gradient splits as g_total = g_rest + g_tax with

    g_tax = −Σ_n d_n ∇θ l_{rep(n), t_n}          (loss-gradient sign, same as param.grad)

(docs/concepts/tax.md writes the ascent direction Σ_n d_n ∇l; norms, shares and cosines are the same.)
One extra backward over the retained graph gives g_tax exactly:
torch.autograd.grad(logps, params, grad_outputs=−D), D (B, T) holding d_n at (rep(n), t_n).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.cancellation import node_coefficients
from ..core.nodes import SharedNodes, shared_nodes
from .modulation import check_logps

GROUPS = ("embed", "attn", "mlp", "head", "norm", "other")


def group_of(name: str) -> str:
    """Layer group of an HF Qwen3 (Llama-like) parameter name, for a bare {name: tensor} dict
    without its model (`layer_groups` reads the module types instead and covers every
    architecture).

    "norm": every RMSNorm weight (input/post-attention, q_norm/k_norm, the final norm);
    "embed": embed_tokens (with tied embeddings it is the head too); "head": lm_head;
    "attn": self_attn projections; "mlp": gate/up/down projections; else "other".
    """
    if "norm" in name:
        return "norm"
    for key, grp in (("embed_tokens", "embed"), ("lm_head", "head"), ("self_attn", "attn"),
                     ("mlp", "mlp")):
        if key in name:
            return grp
    return "other"


# Module roles from the module's type. A parameter takes the role of its own module when that
# is a norm, an embedding or the LM head, else of its nearest attention / MLP ancestor
# (Qwen3's q_norm inside the attention is a norm; a Linear inside an MLP is MLP).
_ATTN_TYPES = ("Attention", "Attn", "Mixer")  # Mamba's mixer: the sequence mixing block
_MLP_TYPES = ("MLP", "FeedForward", "FFN", "Moe", "MoE", "Experts", "Expert", "Router",
              "Gate")


def module_role(module: torch.nn.Module, head: torch.nn.Module | None = None) -> str | None:
    """'embed', 'head', 'norm', 'attn', 'mlp' from the module's type; None for a module with no
    role of its own (a Linear, a decoder layer, a container)."""
    kind = type(module).__name__
    if head is not None and module is head:
        return "head"
    if isinstance(module, torch.nn.Embedding):
        return "embed"
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm)) or \
            "Norm" in kind:
        return "norm"
    if any(k in kind for k in _ATTN_TYPES):
        return "attn"
    if any(k in kind for k in _MLP_TYPES):
        return "mlp"
    return None


def layer_groups(model: torch.nn.Module) -> dict[str, str]:
    """{parameter name: group} for model.named_parameters(), from module types (`module_role`):
    embed, attn, mlp, norm, head, or "other" for a parameter under no module of a known role
    (counted by `unknown_modules`). In a block with an attention child, a weight layer outside
    any role (OPT's fc1/fc2) is the MLP. With tied embeddings the shared weight is "embed"."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    mods = dict(model.named_modules())
    # a block with an attention child: its other weight layers are the MLP (OPT's fc1/fc2)
    blocks = {n.rpartition(".")[0] for n, m in mods.items() if n and module_role(m) == "attn"}
    roles: dict[str, str | None] = {"": None}
    out = {}
    for mname, m in mods.items():
        own = module_role(m, head)
        up = mname.rpartition(".")[0]
        parent = roles.get(up) if mname else None
        if own is None and parent is None and mname and up in blocks and \
                any(True for _ in m.parameters(recurse=False)):
            own = "mlp"
        # own norm/embed/head wins; otherwise attention/MLP membership is inherited
        roles[mname] = own if own in ("norm", "embed", "head") or parent is None or \
            own is not None and parent not in ("attn", "mlp") else parent
        for pname, _ in m.named_parameters(recurse=False):
            out.setdefault(f"{mname}.{pname}" if mname else pname, roles[mname] or "other")
    names = [n for n, _ in model.named_parameters()]
    return {n: out.get(n, "other") for n in names}


def unknown_modules(model: torch.nn.Module) -> dict[str, int]:
    """{module type: parameter count} of the parameters `layer_groups` puts in "other"."""
    groups = layer_groups(model)
    mods = dict(model.named_modules())
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        if groups[name] == "other":
            kind = type(mods.get(name.rpartition(".")[0], model)).__name__
            out[kind] = out.get(kind, 0) + p.numel()
    return out


def residual_grad_outputs(W: Tensor, batch: TokenBatch, sn: SharedNodes) -> Tensor:
    """(B, T) D with d_n at (rep(n), t_n), 0 elsewhere (d_n from `node_coefficients`)."""
    d = node_coefficients(W, batch, sn).d
    D = torch.zeros(batch.tokens.shape, dtype=d.dtype, device=d.device)
    return D.index_put_((sn.rep, sn.position), d, accumulate=True)


def _norms(tax: dict[str, Tensor], total: dict[str, Tensor], names) -> dict[str, Tensor]:
    """0-dim tensors tax_norm, total_norm, tax_share, tax_cos over the parameters `names`.
    Undefined is NaN, never 0: tax_share when g_total = 0, tax_cos when g_tax or g_total = 0."""
    ref = next(iter(tax.values()))
    z = ref.new_zeros(())
    tt = sum(((tax[n] * tax[n]).sum() for n in names), z)
    gg = sum(((total[n] * total[n]).sum() for n in names), z)
    tg = sum(((tax[n] * total[n]).sum() for n in names), z)
    tn, gn = tt.sqrt(), gg.sqrt()
    nan = float("nan")
    share = torch.where(gn > 0, tn / torch.where(gn > 0, gn, 1), nan)  # g_total = 0: undefined
    den = tn * gn
    cos = torch.where(den > 0, tg / torch.where(den > 0, den, 1), nan)
    bad = ~torch.isfinite(tt + gg + tg)  # NaN in → NaN out: never a reassuring 0
    share, cos = share.masked_fill(bad, float("nan")), cos.masked_fill(bad, float("nan"))
    return {"tax_norm": tn, "total_norm": gn, "tax_share": share, "tax_cos": cos}


def learning_tax(
    logps: Tensor,
    W: Tensor,
    batch: TokenBatch,
    params: dict[str, Tensor],
    *,
    nodes: str = "prefix",
    groups: dict[str, str] | None = None,
    sn: SharedNodes | None = None,
    g_total: dict[str, Tensor] | None = None,
    retain_graph: bool = False,
) -> dict:
    """g_tax and its size relative to the loss gradient, overall and per layer group.

    logps (B, T): the log-prob tensor the loss was built from, graph still alive (the caller
    ran loss.backward(retain_graph=True)). W (B, T): the modulation of that loss, e.g.
    `ModulationProbe.W`. params: {name: parameter}, e.g. dict(model.named_parameters()).
    g_total: the loss gradient per parameter; default each param's `.grad` (None → 0).
    groups: {name: group}; default `group_of(name)`. sn: precomputed nodes of kind `nodes`.

    Returns (all figures are 0-dim tensors on the device — no host sync; `.item()` them once):
      tax_norm ‖g_tax‖, total_norm ‖g_total‖, tax_share ‖g_tax‖/‖g_total‖ (NaN if g_total = 0:
      undefined), tax_cos cos(g_tax, g_total) (NaN if either is 0), n_nodes (int),
      groups {group: {the same four, n_params}}, param_groups {name: group},
      g_tax {name: tensor like the param, loss-gradient sign}.
    """
    check_logps(logps, "learning_tax")
    if not params:
        raise ValueError("learning_tax: params is empty")
    if W.shape != logps.shape:
        raise ValueError(f"learning_tax: W is {tuple(W.shape)}, logps is {tuple(logps.shape)}")
    sn = shared_nodes(batch, nodes) if sn is None else sn
    names = list(params)
    if g_total is None:  # read before the extra pass (which does not touch .grad anyway)
        g_total = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()}
    if sn.n:
        D = residual_grad_outputs(W, batch, sn).to(logps.dtype)
        # loss-gradient sign: the residual's share of −Σ W ∇l is −Σ d ∇l_rep
        grads = torch.autograd.grad(logps, [params[n] for n in names], grad_outputs=-D,
                                    retain_graph=retain_graph, allow_unused=True)
    else:  # no shared token: no tax, no extra pass
        grads = [None] * len(names)
    tax = {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, grads)}
    out = tax_report(tax, params, g_total, groups)
    out["n_nodes"] = sn.n
    return out


def tax_report(tax: dict[str, Tensor], params: dict[str, Tensor],
               g_total: dict[str, Tensor] | None = None,
               groups: dict[str, str] | None = None) -> dict:
    """Norms of a g_tax ({name: tensor}) against g_total (default each param's `.grad`),
    overall and per layer group; the dict layout of `learning_tax`."""
    names = list(tax)
    if g_total is None:
        g_total = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()}
    groups = {n: group_of(n) for n in names} if groups is None else groups
    by_group: dict[str, list[str]] = {}
    for n in names:
        by_group.setdefault(groups.get(n, "other"), []).append(n)
    out = _norms(tax, g_total, names)
    out["groups"] = {g: {**_norms(tax, g_total, ns), "n_params": sum(tax[n].numel() for n in ns)}
                     for g, ns in by_group.items()}
    out["param_groups"] = {n: groups.get(n, "other") for n in names}
    out["g_tax"] = tax
    return out


def tax_from_reps(logps_reps: Tensor, D_reps: Tensor, params: dict[str, Tensor],
                  groups: dict[str, str] | None = None) -> dict:
    """g_tax from a separate forward over the nodes' representative rows only.

    logps_reps (R, T') — log-probs of the R representative rows, truncated after the last node
    position, from a fresh forward with gradients; D_reps (R, T') — `residual_grad_outputs`
    restricted to those rows and positions. Since ∇l at a node depends only on its shared
    context, this equals `learning_tax` on the full graph (exactly, up to float rounding) at
    ~(1/G)·(T'/T) of the cost of a backward over the whole batch.
    """
    return tax_report(tax_grads(logps_reps, D_reps, params), params, None, groups)


def tax_grads(logps_reps: Tensor, D_reps: Tensor, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """{name: g_tax part} = −Σ D ∇θ logps over the given rows (loss-gradient sign); rows
    (R, T') as in `tax_from_reps`. Parts from disjoint row chunks add up to the whole g_tax."""
    names = list(params)
    grads = torch.autograd.grad(logps_reps, [params[n] for n in names],
                                grad_outputs=-D_reps.to(logps_reps.dtype), allow_unused=True)
    return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, grads)}


def reduce_tax(res: dict, model: torch.nn.Module, D) -> dict:
    """Data parallelism: sum each rank's g_tax over ranks (`D.sum`), then recompute the norms
    against the (already reduced) parameter gradients."""
    tax = {n: D.sum(g) for n, g in res["g_tax"].items()}
    # a stand-in with parameters only (FSDP's gathered gradients): the groups res was made with
    groups = layer_groups(model) if hasattr(model, "named_modules") else res.get("param_groups")
    return tax_report(tax, dict(model.named_parameters()), None, groups)
