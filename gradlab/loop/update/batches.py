"""How a rollout batch is cut: into optimizer steps (`minibatches`) and each step into
micro-batches of whole groups (`micro_batches`)."""

from __future__ import annotations

import torch


def minibatches(group: torch.Tensor, k: int, gen: torch.Generator, split: bool,
                n_groups: int | None = None) -> list[torch.Tensor]:
    """Row indices of k optimizer steps. Whole groups per step unless `split` (then rows are
    shuffled and cut like TRL's generation batch, so a group is spread over steps).

    group (N,) holds global group labels 0..n_groups−1; the permutation is over all n_groups
    labels, so every data-parallel rank (same generator state) agrees on which groups make up
    each global step and takes its own rows of them.
    """
    dev = group.device
    if split:
        perm = torch.randperm(group.numel(), generator=gen, device=dev)
        return list(perm.chunk(k))
    n = int(group.max()) + 1 if n_groups is None else n_groups
    order = torch.randperm(n, generator=gen, device=dev)
    return [torch.isin(group, part).nonzero().squeeze(-1) for part in order.chunk(k)]


def micro_batches(group: torch.Tensor, size: int | None, G: int | None = None) -> list[torch.Tensor]:
    """Positions (into the step's rows) of each micro-batch: whole groups in order of group
    label, as many as fit in `size` rows (at least one), each part keeping the step's row
    order; groups of G rows give `size // G` groups a part, and groups of varying size (repair
    layouts) are packed the same way. size None or ≥ the step's rows: one part, the whole step.
    group (B,) holds the step's group labels; G is unused (kept for callers)."""
    B = group.numel()
    if size is None or size >= B:
        return [torch.arange(B, device=group.device)]
    _, inv = torch.unique(group, return_inverse=True)  # (B,) 0..n_groups−1
    bounds, rows = [0], 0
    for k, n in enumerate(torch.bincount(inv).tolist()):  # group k holds n rows
        if rows and rows + n > size:
            bounds.append(k)
            rows = 0
        rows += n
    bounds.append(int(inv.max()) + 1)
    return [((inv >= a) & (inv < b)).nonzero().squeeze(-1) for a, b in zip(bounds, bounds[1:])]
