"""How a rollout batch is cut: into optimizer steps (`minibatches`) and each step into
micro-batches of whole groups (`micro_batches`)."""

from __future__ import annotations

import torch


def minibatches(group: torch.Tensor, k: int, gen: torch.Generator, split: bool,
                n_groups: int | None = None,
                polarity: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Row indices of k optimizer steps. Whole groups per step unless `split` (then rows are
    shuffled and cut like TRL's generation batch, so a group is spread over steps).

    group (N,) holds global group labels 0..n_groups−1; the permutation is over all n_groups
    labels, so every data-parallel rank (same generator state) agrees on which groups make up
    each global step and takes its own rows of them. polarity (N,): the rows' sequence
    advantages; given, the cut balances positive and negative rows over the steps instead
    (`balanced_minibatches`, one process only).
    """
    if polarity is not None:
        return balanced_minibatches(group, k, gen, split, polarity, n_groups)
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


def _polarity(a: torch.Tensor) -> torch.Tensor:
    """(N,) long: 0 for A > 0, 1 for A < 0, 2 for A = 0."""
    return torch.where(a > 0, 0, torch.where(a < 0, 1, 2))


def balanced_minibatches(group: torch.Tensor, k: int, gen: torch.Generator, split: bool,
                         adv: torch.Tensor, n_groups: int | None = None) -> list[torch.Tensor]:
    """Row indices of k optimizer steps in which positive- and negative-advantage rows are
    spread as evenly as the batch allows (docs/concepts/token-flips.md#balancing-polarity).

    adv (N,): each row's sequence advantage (its sign: the row's polarity). The generator draws
    one permutation, as the unbalanced cut does, and breaks every tie.
    The number of steps is that of the unbalanced cut (`torch.chunk` into k parts, which can
    give fewer than k).
    split: rows move singly. The permuted rows are ordered positives, negatives, zeros and dealt
      round-robin to the steps, so every step holds ⌊n₊/k⌋ or ⌈n₊/k⌉ positive rows, the same for
      negative and zero rows, and step sizes differ by at most one. Groups are spread over steps.
    whole groups: groups never split. Each group's imbalance d = #positive − #negative rows;
      groups, largest |d| first (ties in permuted order), go one at a time to the step, among
      those with room, whose running Σd is moved closest to 0 (ties: the step with fewer rows,
      then the lower index). Steps hold the same numbers of groups as the unbalanced cut
      (`torch.chunk` of the n groups into k parts). Greedy: Σd per step is not always the
      smallest possible, but a step never takes a group that pushes it away from 0 while a
      step with room could take it closer.
    Every row appears in exactly one step; each step's rows are in ascending order.
    """
    if adv.shape != group.shape:
        raise ValueError(f"minibatches: polarity must be ({group.numel()},) like group, got {tuple(adv.shape)}")
    dev = group.device
    pol = _polarity(adv)
    if split:
        perm = torch.randperm(group.numel(), generator=gen, device=dev)
        order = perm[torch.argsort(pol[perm], stable=True)]
        k = len(perm.chunk(k))  # as many steps as the unbalanced cut
        step = torch.arange(order.numel(), device=dev) % k
        return [order[step == s].sort().values for s in range(k)]
    n = int(group.max()) + 1 if n_groups is None else n_groups
    perm = torch.randperm(n, generator=gen, device=dev).tolist()
    d = torch.zeros(n, dtype=torch.long).index_add_(0, group.cpu().long(),
                                                    ((pol == 0).long() - (pol == 1).long()).cpu())
    rows = torch.bincount(group.cpu().long(), minlength=n)
    cap = [len(c) for c in torch.arange(n).chunk(k)]  # groups per step, as the unbalanced cut
    k = len(cap)
    load, size, members = [0] * k, [0] * k, [[] for _ in range(k)]
    for g in sorted(perm, key=lambda g: -abs(int(d[g]))):  # stable: permuted order breaks ties
        open_ = [s for s in range(k) if len(members[s]) < cap[s]]
        s = min(open_, key=lambda s: (abs(load[s] + int(d[g])), size[s], s))
        members[s].append(g)
        load[s] += int(d[g])
        size[s] += int(rows[g])
    return [torch.isin(group, torch.tensor(m, dtype=group.dtype, device=dev)).nonzero().squeeze(-1)
            for m in members]
