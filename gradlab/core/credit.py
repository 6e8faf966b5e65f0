"""Token advantages from counterfactual paths: IBPO's implicit process-level credit (docs/concepts/ibpo.md).

Every form here is *our reading*: the IBPO paper's formulas are not public. Its authors describe
comparing several paths sampled for one input, correcting an incorrect path against a correct
reference and crediting only the tokens the correction edited; §6 turns that into two readings.

6a, trie: values on the group's prefix trie. Node c = (prompt, y_{i,≤t}) is shared by the rows
whose first t+1 tokens equal y_{i,≤t}; V(c) = mean reward over them, the root holds the group.
With p the parent of c (y_{i,<t}):
  ga    GA_{i,t} = V(c) − V(root)
  la    LA_{i,t} = V(c) − V(p)        (≠ 0 only where the group branches at p)
  ga+la GA + LA                       (the default)
  togo  TG_{i,t} = R_i − V(p)         (a per-node baseline; = Σ_{t' ≥ t} LA when i ends alone)
reweight="sqrt" divides by √|S_c| (early nodes, which sit in many paths, do not dominate).

6b, repair: a corrected row y~ (`repair_of[y~] = y`, R(y~) > R(y)) and its original y get
(1 − λ) A on every token plus ± λ D T / |E| on the tokens the correction edited
(`edited_tokens`, an LCS alignment); D = R(y~) − R(y), A the group advantage R − mean R.

All outputs are (B, T) in raw reward units (0 at masked positions); `reward_scale` gives the
divisor `advantages` uses for --adv-scale. Trie values are computed from `prefix_grid` in
O(n G² T) with no Python loop over tokens, nodes or pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .batch import ADVANTAGE_SCALES, group_index
from .nodes import PrefixGrid, prefix_grid

FORMS = ("ga", "la", "ga+la", "togo")
REWEIGHTS = ("none", "sqrt")


@dataclass
class TrieValues:
    """Per token (B, T): V(c) of the token's node, V(p) of its parent, |S_c|, |S_p| (0 masked)."""

    node: Tensor
    parent: Tensor
    size: Tensor
    parent_size: Tensor

    @property
    def branch(self) -> Tensor:
        """(B, T) bool — tokens whose parent node branches (some member of p went elsewhere)."""
        return (self.size > 0) & (self.size < self.parent_size)


def trie_values(tokens: Tensor, mask: Tensor, group: Tensor, rewards: Tensor) -> TrieValues:
    """Node and parent values of every token on its group's prefix trie (docs/concepts/ibpo.md#reading-1-values-on-the-groups-prefix-trie).

    tokens (B, T), mask (B, T) bool, group (B,), rewards (B,) float → `TrieValues`, values in
    the dtype of rewards. Every member of a node reads one number (from the node's first
    member), so members get bitwise equal values; a full-group node's value is bitwise V(root).
    """
    B, T = tokens.shape
    pg = prefix_grid(tokens, mask, group)
    n, G, _ = pg.shape
    R = rewards if rewards.is_floating_point() else rewards.float()
    Rg = R.new_zeros(n * G)
    Rg[pg.slot] = R
    Rg = Rg.view(n, 1, G).expand(n, G, G)
    # reward sums by lcp value, then Σ over lcp_ij > t by a reverse cumulative sum (slot v = T+1
    # entries: index 0 covers every row of the group, the root)
    hist = R.new_zeros(n, G, T + 1).scatter_add_(2, pg.lcp, Rg)
    cum = hist.flip(-1).cumsum(-1).flip(-1)  # (n, G, T+1): Σ_{v ≥ u}
    cnt = torch.zeros(n, G, T + 1, dtype=torch.long, device=R.device)
    cnt = cnt.scatter_add_(2, pg.lcp, torch.ones_like(pg.lcp)).flip(-1).cumsum(-1).flip(-1)
    live = pg.count > 0
    row_v = cum[..., 1:] / cnt[..., 1:].clamp(min=1)  # (n, G, T) V of (i, t) seen from row i
    v_node = torch.where(live, row_v.gather(1, pg.first), 0)  # read from the node's first member
    # the root: the group's reward sum (rank 0's slot 0 holds every row; empty grid slots have
    # reward 0) over the group's size (the grid's empty slots are not rows)
    v_root = (cum[:, 0, 0] / pg.sizes.to(cum.dtype)).view(n, 1, 1)
    v_parent = torch.cat([v_root.expand(n, G, 1), v_node[..., :-1]], -1)
    size_root = pg.sizes.view(n, 1, 1).expand(n, G, 1)
    p_size = torch.cat([size_root, pg.count[..., :-1]], -1)
    v_parent = torch.where(live, v_parent, 0)
    return TrieValues(pg.to_rows(v_node), pg.to_rows(v_parent), pg.to_rows(pg.count),
                      pg.to_rows(p_size * live))


def branch_tokens(tokens: Tensor, mask: Tensor, group: Tensor,
                  grid: PrefixGrid | None = None) -> Tensor:
    """(B, T) bool — tokens whose parent node branches: some row of the parent's node (the
    root, at t = 0) took another token there. Where the group's paths part. grid: the rows'
    `prefix_grid` when the caller has it already."""
    pg = prefix_grid(tokens, mask, group) if grid is None else grid
    n, G, _ = pg.shape
    parent = torch.cat([pg.sizes.view(n, 1, 1).expand(n, G, 1), pg.count[..., :-1]], -1)
    return pg.to_rows((pg.count > 0) & (pg.count < parent))


def process_advantages(tokens: Tensor, mask: Tensor, group: Tensor, rewards: Tensor,
                       form: str = "ga+la", reweight: str = "none", *,
                       la_weight: float = 1.0) -> Tensor:
    """Trie token advantages (docs/concepts/ibpo.md#reading-1-values-on-the-groups-prefix-trie, *ours*), (B, T) in raw reward units, 0 where masked.

    form: "ga" (V(c) − V(root)), "la" (V(c) − V(p)), "ga+la", "togo" (R_i − V(p));
    reweight: "none" or "sqrt" (÷ √|S_c|). la_weight λ (form "ga+la" only): ga + λ·la, so
    λ = 0 is "ga" (GRPO's advantage) and λ = 1 the default. With no token shared beyond the root, "ga" is
    R_i − mean_g R on every token (GRPO's unscaled advantage), while "la" and "togo" put it on
    the first token only (a lone path's later nodes are their own baseline).
    """
    if form not in FORMS:
        raise ValueError(f"process_advantages: unknown form={form!r}; valid: {FORMS}")
    if reweight not in REWEIGHTS:
        raise ValueError(f"process_advantages: unknown reweight={reweight!r}; valid: {REWEIGHTS}")
    if la_weight != 1.0 and form != "ga+la":
        raise ValueError(f"process_advantages: la_weight={la_weight} weighs the la term of form "
                         f"'ga+la'; form={form!r} has none")
    _check_rows(tokens, mask, group, rewards, "process_advantages")
    tv = trie_values(tokens, mask, group, rewards)
    R = rewards.to(tv.node.dtype).unsqueeze(-1)  # (B, 1)
    v_root = tv.parent[:, :1]  # (B, 1): a row's first parent is its group's root
    A = {"ga": lambda: tv.node - v_root, "la": lambda: tv.node - tv.parent,
         "ga+la": lambda: (tv.node - v_root) + (tv.node - tv.parent) * la_weight
         if la_weight != 1.0 else (tv.node - v_root) + (tv.node - tv.parent),
         "togo": lambda: R - tv.parent}[form]()
    if reweight == "sqrt":
        A = A / tv.size.clamp(min=1).to(A.dtype).sqrt()
    return torch.where(mask, A, 0)


@dataclass
class Alignment:
    """LCS alignment of token sequences a (La,) and b (Lb,).

    pairs     (K, 2) long — matched (kept) positions (i in a, j in b), increasing
    edited_a  (La,) bool  — a's tokens that were replaced or deleted, plus, where b only inserts,
                            the a token at the insertion point (the decision b changed)
    edited_b  (Lb,) bool  — likewise for b (inserted or replaced; the token after a deletion)
    """

    pairs: Tensor
    edited_a: Tensor
    edited_b: Tensor


def edited_tokens(a, b) -> Alignment:
    """Align two token sequences (lists or 1-D tensors, no padding) by a longest common
    subsequence and return what was edited (docs/concepts/ibpo.md#reading-2-credit-on-the-edited-tokens-of-a-repair; the insertion-point rule is *ours*:
    it gives every edit a token on both sides, so a pure insertion still names the decision of
    the original path it replaced). Common prefix and suffix are matched first; the middle is
    an O(La·Lb) dynamic programme vectorised per row."""
    a = np.asarray(a.tolist() if isinstance(a, Tensor) else a, dtype=np.int64).reshape(-1)
    b = np.asarray(b.tolist() if isinstance(b, Tensor) else b, dtype=np.int64).reshape(-1)
    ops = _lcs_ops(a, b)  # list of (i or -1, j or -1) in order
    ea, eb = np.zeros(len(a), dtype=bool), np.zeros(len(b), dtype=bool)
    k = 0
    while k < len(ops):
        if ops[k][0] >= 0 and ops[k][1] >= 0:
            k += 1
            continue
        s = k  # a gap: a maximal run of unmatched ops
        while k < len(ops) and not (ops[k][0] >= 0 and ops[k][1] >= 0):
            k += 1
        gap = ops[s:k]
        del_a = [i for i, j in gap if i >= 0]
        ins_b = [j for i, j in gap if j >= 0]
        ea[del_a] = True
        eb[ins_b] = True
        nxt = ops[k] if k < len(ops) else (len(a) - 1, len(b) - 1)
        if not del_a and len(a):
            ea[max(min(nxt[0], len(a) - 1), 0)] = True  # b inserted before a's token here
        if not ins_b and len(b):
            eb[max(min(nxt[1], len(b) - 1), 0)] = True  # b deleted a's tokens before this one
    pairs = [(i, j) for i, j in ops if i >= 0 and j >= 0]
    return Alignment(torch.tensor(pairs, dtype=torch.long).reshape(-1, 2),
                     torch.from_numpy(ea), torch.from_numpy(eb))


def _lcs_ops(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int]]:
    """Alignment ops (i, j): both ≥ 0 a match, (i, −1) a deleted from a, (−1, j) inserted in b."""
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    q = 0
    while q < min(len(a), len(b)) - p and a[len(a) - 1 - q] == b[len(b) - 1 - q]:
        q += 1
    ma, mb = a[p:len(a) - q], b[p:len(b) - q]
    L = np.zeros((len(ma) + 1, len(mb) + 1), dtype=np.int32)
    for i in range(1, len(ma) + 1):  # L[i, j] = cummax_j max(L[i−1, j], L[i−1, j−1] + match)
        tmp = L[i - 1].copy()
        tmp[1:] = np.maximum(tmp[1:], L[i - 1, :-1] + (mb == ma[i - 1]))
        L[i] = np.maximum.accumulate(tmp)
    mid, i, j = [], len(ma), len(mb)
    while i > 0 or j > 0:
        if i > 0 and j > 0 and ma[i - 1] == mb[j - 1] and L[i, j] == L[i - 1, j - 1] + 1:
            mid.append((p + i - 1, p + j - 1))
            i, j = i - 1, j - 1
        elif i > 0 and (j == 0 or L[i - 1, j] >= L[i, j - 1]):
            mid.append((p + i - 1, -1))
            i -= 1
        else:
            mid.append((-1, p + j - 1))
            j -= 1
    head = [(k, k) for k in range(p)]
    tail = [(len(a) - q + k, len(b) - q + k) for k in range(q)]
    return head + mid[::-1] + tail


def repair_advantages(tokens: Tensor, mask: Tensor, group: Tensor, rewards: Tensor,
                      repair_of: Tensor, lam: float = 0.5) -> Tensor:
    """Repair token advantages (docs/concepts/ibpo.md#reading-2-credit-on-the-edited-tokens-of-a-repair, *ours*), (B, T) raw reward units, 0 where masked.

    repair_of (B,) long: for a corrected row y~, the row y it corrects; −1 elsewhere. With
    D = R(y~) − R(y) > 0 and A = R − mean_g R (the group's rows, repairs included):
      A_{y~,t} = (1 − λ) A_{y~} + λ D T_{y~} 1[t ∈ E(y~)] / |E(y~)|
      A_{y,t}  = (1 − λ) A_y    − λ D T_y    1[t ∈ E(y)]  / |E(y)|
    A pair with D ≤ 0 (a failed repair) is no repair: both rows keep A on every token (*ours*),
    as does every row outside a pair. λ = 0 gives GRPO's unscaled advantage everywhere.
    """
    _check_rows(tokens, mask, group, rewards, "repair_advantages")
    B = tokens.shape[0]
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"repair_advantages: lam must be in [0, 1], got {lam}")
    if repair_of.shape != (B,) or repair_of.is_floating_point():
        raise ValueError(f"repair_advantages: repair_of must be a (B,) = ({B},) integer tensor, "
                         f"got {tuple(repair_of.shape)} {repair_of.dtype}")
    R = rewards if rewards.is_floating_point() else rewards.float()
    gid, sizes = group_index(group)
    mean = R.new_zeros(sizes.numel()).index_add_(0, gid, R) / sizes.to(R.dtype)
    A = (R - mean[gid]).unsqueeze(-1).expand(B, tokens.shape[1])  # (B, T)
    pairs = _repair_pairs(repair_of.tolist(), group.tolist(), B)
    out = A.clone()
    T_i = mask.sum(-1)
    for fix, orig in pairs:
        D = float(R[fix] - R[orig])
        if D <= 0 or lam == 0:
            continue
        al = edited_tokens(tokens[orig][mask[orig]], tokens[fix][mask[fix]])
        for row, edited, sign in ((fix, al.edited_b, 1.0), (orig, al.edited_a, -1.0)):
            pos = mask[row].nonzero().squeeze(-1)[edited.to(mask.device)]  # edited positions
            out[row] = (1 - lam) * A[row]
            out[row, pos] += sign * lam * D * float(T_i[row]) / max(pos.numel(), 1)
    return torch.where(mask, out, 0)


def _repair_pairs(ref: list[int], group: list, B: int) -> list[tuple[int, int]]:
    """(corrected row, original row) pairs; ValueError naming the row for a bad `repair_of`."""
    pairs, seen = [], {}
    for fix, orig in enumerate(ref):
        if orig == -1:
            continue
        if not 0 <= orig < B or orig == fix:
            raise ValueError(f"repair_of[{fix}] = {orig}: must be −1 or another row in [0, {B})")
        if group[orig] != group[fix]:
            raise ValueError(f"repair_of[{fix}] = {orig}: the rows are in different groups "
                             f"({group[fix]} and {group[orig]})")
        if orig in seen:
            raise ValueError(f"row {orig} is repaired twice (rows {seen[orig]} and {fix}); "
                             "one repair per row")
        seen[orig] = fix
        pairs.append((fix, orig))
    return pairs


def reward_scale(rewards: Tensor, group: Tensor, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """(B,) divisor of `gradlab.advantages` for a scale: std of the row's group (unbiased) + eps,
    std of all rewards + eps, or 1 ("none")."""
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"reward_scale: unknown scale {scale!r}; valid: {ADVANTAGE_SCALES}")
    R = rewards if rewards.is_floating_point() else rewards.float()
    if scale == "none":
        return torch.ones_like(R)
    if scale == "batch":
        std = R.std() if R.numel() > 1 else R.new_zeros(())
        return (std + eps).expand_as(R)
    gid, sizes = group_index(group)
    n = sizes.to(R.dtype)
    mean = torch.zeros_like(n).index_add_(0, gid, R) / n
    ss = torch.zeros_like(n).index_add_(0, gid, (R - mean[gid]) ** 2)
    return (ss / (n - 1).clamp(min=1)).sqrt()[gid] + eps


def _check_rows(tokens: Tensor, mask: Tensor, group: Tensor, rewards: Tensor, who: str) -> None:
    B, T = tokens.shape
    for name, v, shape in (("mask", mask, (B, T)), ("group", group, (B,)),
                           ("rewards", rewards, (B,))):
        if tuple(v.shape) != shape:
            raise ValueError(f"{who}: {name} has shape {tuple(v.shape)}, expected {shape}")
    if mask.dtype != torch.bool:
        raise ValueError(f"{who}: mask must be bool, got {mask.dtype}")
    bad = ~torch.isfinite(rewards.float())
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{who}: reward of row {i} (group {int(group[i])}) is {rewards[i].item()}")
