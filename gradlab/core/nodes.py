"""Where a group's responses share a token: full-group prefix nodes and prefix-trie nodes.

Two rows of one group share position t when both are masked in at t and agree on every token
(and mask state) up to and including t (docs/concepts/shared-nodes.md). Shared positions form a prefix trie; a
*node* is one (group, position, member set) with ≥ 2 members. A *prefix* (full-group) node is
a node whose members are every row of its group present in the batch.

Vectorised: rows are packed into a (n_groups, G_max, T) grid, pairwise longest-common-prefix
lengths are computed once, and node membership follows from `lcp > t`. Cost O(n_groups ·
G_max² · T) memory and time, linear in T; no Python loop over tokens or over pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .batch import TokenBatch, group_index

NODE_KINDS = ("prefix", "trie")


@dataclass
class SharedNodes:
    """The shared-token structure of a batch.

    node       (B, T) long — node id of each (row, position), −1 where the position is not shared
    group      (N,) long   — the node's group label (as in batch.group)
    position   (N,) long   — the node's response position t
    size       (N,) long   — number of members |S_n|
    token      (N,) long   — the shared token id
    rep        (N,) long   — one member row (the smallest row index), rep(n) of docs/concepts/tax.md
    full       (N,) bool   — True when the node spans its whole group (a prefix node)
    kind       "prefix" or "trie"
    """

    node: Tensor
    group: Tensor
    position: Tensor
    size: Tensor
    token: Tensor
    rep: Tensor
    full: Tensor
    kind: str

    @property
    def n(self) -> int:
        return int(self.group.numel())

    def members(self, n: int) -> Tensor:
        """Row indices of node n's members, (|S_n|,) long."""
        t = int(self.position[n])
        return (self.node[:, t] == n).nonzero().squeeze(-1)

    def full_group(self) -> SharedNodes:
        """The prefix (full-group) nodes of a trie structure, renumbered 0..N'-1."""
        if self.kind == "prefix" or self.n == 0:
            return SharedNodes(*(getattr(self, f) for f in (
                "node", "group", "position", "size", "token", "rep", "full")), kind="prefix")
        keep = self.full
        new_id = torch.cumsum(keep.long(), 0) - 1
        idx = self.node.clamp(min=0)
        node = torch.where((self.node >= 0) & keep[idx], new_id[idx], -1)
        f = [x[keep] for x in (self.group, self.position, self.size, self.token, self.rep, self.full)]
        return SharedNodes(node, *f, kind="prefix")


def _pack_labels(group: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pack rows into a (n_groups, G_max, T) grid.

    Returns (slot (B,) — flat index gid * G_max + rank of each row, gid (B,), sizes, G_max).
    """
    gid, sizes = group_index(group)
    order = torch.argsort(gid, stable=True)
    starts = torch.cumsum(sizes, 0) - sizes  # (n_groups,)
    rank = torch.empty_like(gid)
    rank[order] = torch.arange(gid.numel(), device=gid.device) - starts[gid[order]]
    g_max = int(sizes.max()) if sizes.numel() else 1
    return gid * g_max + rank, gid, sizes, torch.tensor(g_max)


@dataclass
class PrefixGrid:
    """Pairwise prefix structure of a batch's groups, on a (n_groups, G_max, T) grid.

    slot  (B,) long — flat grid row (gid * G_max + rank) of each batch row
    sizes (n_groups,) long — rows per group in the batch
    lcp   (n, G, G) long — longest common prefix of rows i, j (≤ T; T for a row with itself)
    count (n, G, T) long — |S| of the node of (i, t): rows j with lcp_ij > t (0 where masked out)
    first (n, G, T) long — the node's smallest member rank (its id within the group)
    """

    slot: Tensor
    sizes: Tensor
    lcp: Tensor
    count: Tensor
    first: Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.count.shape)

    def to_rows(self, x: Tensor) -> Tensor:
        """A (n, G, T) grid tensor as (B, T) batch rows."""
        n, g, T = self.count.shape
        return x.reshape(n * g, T)[self.slot]


def prefix_grid(tokens: Tensor, mask: Tensor, group: Tensor) -> PrefixGrid:
    """The pairwise prefix structure behind `shared_nodes` and the trie advantages
    (`gradlab.core.ibpo`). tokens (B, T), mask (B, T) bool, group (B,). O(n G² T), no Python
    loop over tokens or pairs."""
    B, T = tokens.shape
    dev = tokens.device
    slot, gid, sizes, g_max_t = _pack_labels(group)
    g_max, n_groups = int(g_max_t), int(sizes.numel())
    # Grid of effective tokens: masked-out positions become −1 so the mask state is compared too.
    eff = torch.where(mask, tokens.long(), torch.full_like(tokens.long(), -1))
    grid = torch.full((n_groups * g_max, T), -2, dtype=torch.long, device=dev)
    grid[slot] = eff
    gmask = torch.zeros((n_groups * g_max, T), dtype=torch.bool, device=dev)
    gmask[slot] = mask
    grid = grid.view(n_groups, g_max, T)
    gmask = gmask.view(n_groups, g_max, T)

    # Pairwise longest common prefix lcp[g, i, j], (n_groups, G, G): T − max over the
    # disagreeing positions of (T − t) gives the first disagreement (an int reduction is far
    # faster than argmax over bools).
    pos = torch.arange(T, device=dev)
    neq = grid.unsqueeze(2) != grid.unsqueeze(1)  # (n, G, G, T)
    rev = torch.where(neq, (T - pos).to(torch.int32), 0)
    lcp = T - rev.amax(-1).long()  # (n, G, G)
    del neq, rev
    # Row i is in node (i, t) with j iff t < lcp[i, j] (then both are masked in at t: a
    # masked-out position has token −1 and breaks the common prefix). So, per row i:
    #   count(t) = #{j : lcp_ij > t}   and   first(t) = min{j : lcp_ij > t},
    # both from a scatter over lcp values and a reverse cumulative reduction over t — O(n G T).
    lcp_c = lcp.clamp(max=T)  # index T+1 slots: value v means "shared for t < v"
    hist = torch.zeros(n_groups, g_max, T + 1, dtype=torch.long, device=dev)
    hist.scatter_add_(2, lcp_c, torch.ones_like(lcp_c))
    count = hist.flip(-1).cumsum(-1).flip(-1)[..., 1:]  # (n, G, T): Σ_{v > t}
    j = torch.arange(g_max, device=dev).view(1, 1, -1).expand_as(lcp_c)
    mins = torch.full((n_groups, g_max, T + 1), g_max, dtype=torch.long, device=dev)
    mins.scatter_reduce_(2, lcp_c, j, reduce="amin")
    first = mins.flip(-1).cummin(-1).values.flip(-1)[..., 1:]  # (n, G, T)
    count = count * gmask  # a masked-out position belongs to no node
    return PrefixGrid(slot, sizes, lcp_c, count, first)


def shared_nodes(batch: TokenBatch, nodes: str = "prefix",
                 grid: PrefixGrid | None = None) -> SharedNodes:
    """Find the shared-token nodes of a batch (docs/concepts/shared-nodes.md).

    nodes="prefix": full-group nodes only (all rows of the group agree up to t);
    nodes="trie": every node of each group's prefix trie with ≥ 2 members (prefix nodes included).
    grid: the batch's `prefix_grid`, when the caller has it already (computed here otherwise).
    """
    if nodes not in NODE_KINDS:
        raise ValueError(f"shared_nodes: unknown nodes={nodes!r}; valid: {NODE_KINDS}")
    B, T = batch.tokens.shape
    dev = batch.tokens.device
    pg = prefix_grid(batch.tokens, batch.mask, batch.group) if grid is None else grid
    slot, sizes, count, first = pg.slot, pg.sizes, pg.count, pg.first
    n_groups, g_max, _ = pg.shape
    gid, _ = group_index(batch.group)
    pos = torch.arange(T, device=dev)

    in_node = count >= 2
    if nodes == "prefix":
        in_node &= count == sizes.view(-1, 1, 1)
    # Flat key (group, first member, t) identifies a node; back to batch rows via slot.
    key = (torch.arange(n_groups, device=dev).view(-1, 1, 1) * g_max + first) * T + pos
    key = key.view(n_groups * g_max, T)[slot]  # (B, T)
    in_node = in_node.view(n_groups * g_max, T)[slot]
    count = count.view(n_groups * g_max, T)[slot]

    node = torch.full((B, T), -1, dtype=torch.long, device=dev)
    if bool(in_node.any()):
        uniq, inv = torch.unique(key[in_node], return_inverse=True)
        node[in_node] = inv
        n_nodes = uniq.numel()
        position = uniq % T
        # Representative: the smallest batch row of the node.
        rows = torch.arange(B, device=dev).view(-1, 1).expand(B, T)[in_node]
        rep = torch.full((n_nodes,), B, dtype=torch.long, device=dev)
        rep = rep.scatter_reduce(0, inv, rows, reduce="amin")
        size = torch.zeros(n_nodes, dtype=torch.long, device=dev).scatter_(0, inv, count[in_node])
        token = batch.tokens.long()[rep, position]
        grp = batch.group.long()[rep]
        full = size == sizes[gid[rep]]
    else:
        z = torch.zeros(0, dtype=torch.long, device=dev)
        position = rep = size = token = grp = z
        full = torch.zeros(0, dtype=torch.bool, device=dev)
    return SharedNodes(node, grp, position, size, token, rep, full, nodes)
