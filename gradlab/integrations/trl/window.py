"""The pure parts of the TRL integration: a window of loss calls, group reconstruction from
TRL's inputs, the group-preserving shuffle and the per-window metrics (all tensor functions, no
trainer; gradlab.integrations.trl wires them into GRPOTrainer)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...core.batch import TokenBatch, group_index, split_share
from ...core.nodes import SharedNodes
from ...instruments import Residual
from ...instruments.window import WindowView, measure_window

ROW_KEY, GROUP_KEY = "gradlab_row", "gradlab_group"  # (B,) long tensors added to TRL's batch


@dataclass
class Window:
    """One pass over a generation batch, rows in the generation batch's (unshuffled) order.

    batch: TokenBatch (B, T) — completion tokens and mask (every sampled token: the nodes are
        built from it), logps = each row's log-probs in its loss call (detached), old_logps =
        TRL's old log-probs (= logps when TRL had none, i.e. on-policy), advantages (B,), group
        (B,) reconstructed.
    W (B, T): measured modulation, the one the backward used (W̃ under DFPO); 0 outside
        `loss_mask`.
    W_base (B, T) or None: the base loss's W before the DFPO transform.
    micro, opt (B,) long: the micro-batch (loss call) and optimizer step of each row.
    loss_mask (B, T) bool or None: the tokens TRL's loss counts (completion × tool mask; a
        row that mask_truncated_completions drops is all False); None = batch.mask.
    """

    batch: TokenBatch
    W: Tensor
    W_base: Tensor | None
    micro: Tensor
    opt: Tensor
    index: int
    iteration: int
    metrics: dict = field(default_factory=dict)
    loss_mask: Tensor | None = None


def reconstruct_groups(prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int) -> Tensor:
    """(B,) long group labels 0..n−1 of a generation batch in RepeatSampler order.

    prompt_ids, prompt_mask (B, P), left-padded. A group is a run of equal prompts, cut every
    `num_generations` rows (a prompt drawn twice in one batch gives two groups).
    """
    ids = torch.where(prompt_mask.bool(), prompt_ids, -1)
    B = ids.shape[0]
    new_run = torch.ones(B, dtype=torch.bool, device=ids.device)
    new_run[1:] = (ids[1:] != ids[:-1]).any(-1)
    run = torch.cumsum(new_run.long(), 0) - 1
    starts = new_run.nonzero().squeeze(-1)  # (n_runs,) first row of each run
    pos = torch.arange(B, device=ids.device) - starts[run]
    return torch.cumsum((new_run | (pos % num_generations == 0)).long(), 0) - 1


def grouped_shuffle(seq_dict: dict) -> dict:
    """TRL's `shuffle_sequence_dict` at group granularity: groups (by `GROUP_KEY`) in random
    order (global torch RNG, as TRL), the rows of a group contiguous and in their order."""
    gid, _ = group_index(seq_dict[GROUP_KEY])
    n = int(gid.max()) + 1
    rank = torch.empty(n, dtype=torch.long)
    rank[torch.randperm(n)] = torch.arange(n)
    perm = torch.argsort(rank[gid.cpu()], stable=True)

    def permute(v):
        if v is None or (isinstance(v, Tensor) and v.ndim == 0):
            return v
        if isinstance(v, Tensor):
            return v[perm.to(v.device)]
        return [v[i] for i in perm.tolist()]

    return {k: permute(v) for k, v in seq_dict.items()}


def stepwise_residual(W: Tensor, sn: SharedNodes, step: Tensor) -> tuple[float, float]:
    """(Σ|c_{n,k}|, ratio) at full-group nodes with the net coefficient taken per step k.

    W (B, T), step (B,) long. c_{n,k} = Σ of W over the members of node n that sit in step k:
    what one optimizer step can cancel. Equals the plain residual when no group is split.
    The ratio Σ|c_{n,k}| / Σ|W| is NaN where it is undefined: no full-group token, or W ≡ 0
    at the nodes (every group tied); the residual is then 0.
    """
    sh = sn.node >= 0
    if not bool(sh.any()):
        return 0.0, math.nan
    k = step - step.min()
    n_k = int(k.max()) + 1
    key = sn.node[sh] * n_k + k.unsqueeze(-1).expand_as(sn.node)[sh]
    Wd = W.detach().double()
    c = torch.zeros(sn.n * n_k, dtype=Wd.dtype).index_add_(0, key, Wd[sh])
    res, mass = float(c.abs().sum()), float(Wd[sh].abs().sum())
    return res, (res / mass if mass > 0 else math.nan)


def drift_figures(batch: TokenBatch, sn: SharedNodes,
                  loss_mask: Tensor | None = None) -> dict[str, float]:
    """Mean Δl = l_used − l_old (nats) at full-group node tokens and at divergent tokens by the
    sign of A: how far the earlier optimizer steps of the window moved the policy since
    sampling, free from TRL's own log-probs (KL would need full distributions: not kept).
    Only tokens of `loss_mask` (B, T) bool count (None: every token of batch.mask): TRL
    computes a dropped row's log-probs without attending to its completion. A mean over no
    token (no full-group token, no row of that sign) is NaN: undefined."""
    dl = (batch.logps - batch.old_logps).double()
    A = batch.adv_tokens
    live = batch.mask if loss_mask is None else batch.mask & loss_mask
    div = live & (sn.node < 0)
    out = {}
    for name, keep in (("node", live & (sn.node >= 0)), ("div_pos", div & (A > 0)),
                       ("div_neg", div & (A < 0))):
        n = int(keep.sum())
        out[f"drift_{name}_dlogp"] = float(dl[keep].sum()) / n if n else math.nan
    return out


def tied_share(batch: TokenBatch) -> float:
    """Share of groups whose every advantage is 0 (equal rewards: no gradient from them); NaN
    with no group."""
    gid, sizes = group_index(batch.group)
    moving = ((batch.adv_tokens.abs() * batch.mask).sum(-1) > 0).double()  # (B,)
    n = torch.zeros(sizes.numel(), dtype=moving.dtype, device=moving.device).index_add_(0, gid, moving)
    return float((n == 0).double().mean()) if sizes.numel() else math.nan


def window_metrics(batch: TokenBatch, W: Tensor, opt: Tensor, micro: Tensor,
                   W_base: Tensor | None = None, trie: bool = True,
                   loss_mask: Tensor | None = None) -> dict[str, float]:
    """The per-window figures (see the key list in docs/guides/trl.md). Shapes as in `Window`;
    the nodes come from batch.mask, `loss_mask` only limits the drift means.

    ρ, residual and mass come from the `residual` instrument (`gradlab.instruments.Residual`,
    the one gradlab's loop runs). Every ρ is NaN where it is undefined: nodes_prefix = 0 (no
    full-group token) or mass_prefix = 0 (W ≡ 0 there; zero_std_share = 1: every group tied);
    nodes_trie and mass_trie say the same of rho_trie. Counts and sums are numbers."""
    view = WindowView(batch, W)
    sn_all = view.nodes()["trie"]
    sn = view.nodes()["prefix"]
    m = measure_window([Residual()], view)
    res_step, rho_step = stepwise_residual(W, sn, opt)
    out = {"rho_prefix": m["rho_prefix"], "rho_prefix_step": rho_step,
           "residual_prefix": m["residual_prefix"], "residual_prefix_step": res_step,
           "mass_prefix": m["mass_prefix"], "shared_fraction": m["shared_frac_prefix"],
           "nodes_prefix": float(sn.n),
           "split_groups": split_share(batch.group, opt),
           "split_groups_micro": split_share(batch.group, micro),
           "groups": float(torch.unique(batch.group).numel()),
           "zero_std_share": tied_share(batch)}
    if trie:
        out.update(rho_trie=m["rho_trie"], mass_trie=m["mass_trie"], nodes_trie=float(sn_all.n))
    if W_base is not None:
        base = WindowView(batch, W_base, view.nodes())
        out["rho_prefix_base"] = measure_window([Residual()], base)["rho_prefix"]
        out["rho_prefix_step_base"] = stepwise_residual(W_base, sn, opt)[1]
    if not torch.equal(batch.logps, batch.old_logps):  # off-policy rows exist
        out.update(drift_figures(batch, sn, loss_mask))
    return out
