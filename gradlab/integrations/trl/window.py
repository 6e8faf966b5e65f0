"""The pure parts of the TRL integration: a window of loss calls, group reconstruction from
TRL's inputs, the group-preserving shuffle and the share of tied groups (tensor functions, no
trainer; gradlab.integrations.trl.trainer wires them into GRPOTrainer)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...core.batch import TokenBatch, group_index

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


def tied_share(batch: TokenBatch) -> float:
    """Share of groups whose every advantage is 0 (equal rewards: no gradient from them); NaN
    with no group."""
    gid, sizes = group_index(batch.group)
    moving = ((batch.adv_tokens.abs() * batch.mask).sum(-1) > 0).double()  # (B,)
    n = torch.zeros(sizes.numel(), dtype=moving.dtype, device=moving.device).index_add_(0, gid, moving)
    return float((n == 0).double().mean()) if sizes.numel() else math.nan
