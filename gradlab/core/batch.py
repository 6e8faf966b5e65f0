"""The batch every objective and probe reads, and group-relative advantages.

A `TokenBatch` holds B sequences of T *response* positions (prompt tokens are not in it;
rows with the same `group` value share a prompt). Responses are right-padded: `mask` is True
on response tokens. Notation: docs/concepts/index.md#setting-and-notation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

ADVANTAGE_SCALES = ("group", "batch", "none")


@dataclass
class TokenBatch:
    """B sequences × T response positions of a group-relative RL step.

    Fields (B = sequences, T = response positions):
      tokens      (B, T) long   — response token ids (padding anywhere the mask is False)
      mask        (B, T) bool   — True on response tokens that enter the loss
      logps       (B, T) float  — log π_θ(y_t | x, y_<t) of the current policy (may require grad)
      old_logps   (B, T) float  — log π_old of the behaviour policy
      advantages  (B,) or (B, T) float — A_i (see `advantages`), or token advantages A_{i,t}
                  (see `gradlab.process_advantages`); `adv_tokens` gives the (B, T) view either way
      group       (B,)   long   — rows with equal values belong to one prompt's group;
                                  rows of a group need not be contiguous
      ref_logps   (B, T) float or None — reference policy, only for a KL term (beta > 0)
      rewards     (B,)   float or None — terminal rewards R_i; objectives that build their own
                  token advantages from the group (IBPO) read them
      repair_of   (B,)   long or None — for a corrected (repair) response, the row it corrects;
                  −1 elsewhere (docs/concepts/ibpo.md#reading-2-credit-on-the-edited-tokens-of-a-repair). Only the IBPO `repair` form reads it
      n_seqs, n_tokens, width  int or None — the totals that loss normalisers use (number of
                  sequences B, masked-in tokens Σ T_i, padded width T_max). None = this batch's
                  own. Data-parallel training sets them to the global batch's totals so that
                  the per-rank losses add up to the single-process loss.

    Construction validates shapes, dtypes, devices and finiteness (on masked-in positions) and
    raises ValueError naming the field at fault. Set `validate=False` to skip the finiteness
    check (it syncs the device once) in a hot loop whose inputs are already trusted.
    """

    tokens: Tensor
    mask: Tensor
    logps: Tensor
    old_logps: Tensor
    advantages: Tensor
    group: Tensor
    ref_logps: Tensor | None = None
    rewards: Tensor | None = None
    repair_of: Tensor | None = None
    n_seqs: int | None = None
    n_tokens: int | None = None
    width: int | None = None
    validate: bool = True

    def __post_init__(self) -> None:
        _check_batch(self)

    @property
    def B(self) -> int:
        return self.tokens.shape[0]

    @property
    def T(self) -> int:
        return self.tokens.shape[1]

    @property
    def norm_seqs(self) -> int:
        """B used by the normalisers (global under data parallelism)."""
        return self.B if self.n_seqs is None else self.n_seqs

    @property
    def norm_width(self) -> int:
        """T_max used by constant normalisation (global under data parallelism)."""
        return self.T if self.width is None else self.width

    def norm_tokens(self) -> Tensor | int:
        """Σ_j T_j used by token-mean normalisation (≥ 1)."""
        return max(self.n_tokens, 1) if self.n_tokens is not None else self.mask.sum().clamp(min=1)

    @property
    def adv_tokens(self) -> Tensor:
        """(B, T) advantages: A_{i,t} as given, or A_i broadcast over the row (a view)."""
        a = self.advantages
        return a if a.dim() == 2 else a.unsqueeze(-1).expand(self.B, self.T)

    @property
    def lengths(self) -> Tensor:
        """(B,) long — T_i, the number of masked-in response tokens of each row."""
        return self.mask.sum(-1)

    def replace(self, **changes) -> TokenBatch:
        """A copy with some fields replaced (validated again)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update(changes)
        return TokenBatch(**kw)

    def inert(self) -> TokenBatch:
        """A copy whose logps, old_logps and ref_logps are 0 outside the mask (B, T).

        Padded positions may hold anything (NaN, ±inf, garbage); every objective reads the
        batch through this, so such values never reach a loss, W or a report. `torch.where`
        keeps the graph: the gradient reaches `logps` inside the mask and is 0 outside.
        """
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("logps", "old_logps", "ref_logps"):
            v = kw[name]
            if v is not None:
                kw[name] = torch.where(self.mask, v, torch.zeros((), dtype=v.dtype, device=v.device))
        kw["validate"] = False  # the masked-in values are the ones validated at construction
        return TokenBatch(**kw)

    def rows(self, idx: Tensor | Sequence[int], *, relabel: bool = False) -> TokenBatch:
        """The batch of rows `idx`: a (k,) long tensor (or int sequence) of row indices in
        [0, B), in the order wanted, or a (B,) bool mask (its True rows, in order).

        Every per-row field is selected: tokens, mask, logps, old_logps, ref_logps (B, T) →
        (k, T) (T is kept); advantages (B,) or (B, T) → (k,) or (k, T); group, rewards (B,) →
        (k,); repair_of (B,) → (k,) renumbered into the selection (the position in `idx` of
        the row each repair corrects; −1 when that row is not selected). The per-batch fields
        n_seqs, n_tokens, width and validate are copied unchanged (a subset of a global batch
        keeps the global normalisers; None stays "this batch's own"). Groups keep their labels;
        `relabel=True` maps them to 0..n_groups−1 in increasing label order. The finiteness
        check is not repeated (the rows were checked when this batch was built); `logps` keeps
        its graph. ValueError for an index out of range, a mask of the wrong shape, or a
        repeated index when repair_of has to be renumbered.
        """
        kw = select_rows(self, TOKEN_BATCH_FIELDS, idx, self.B, "TokenBatch", relabel=relabel)
        out = TokenBatch(**(kw | {"validate": False}))
        out.validate = self.validate
        return out

    def to(self, device: torch.device | str) -> TokenBatch:
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in kw.items():
            if isinstance(v, Tensor):
                kw[k] = v.to(device)
        return TokenBatch(**kw)


def select_rows(obj, kinds: dict[str, str], idx, n: int, who: str, *, t: int | None = None,
                relabel: bool = False) -> dict:
    """The constructor keywords of `obj` (a dataclass of n rows) at rows `idx`, each field
    treated as `kinds` says: "batch" copied, "row" selected, "row-token" selected and cut to
    the first `t` positions, "list" selected entry by entry, "row-ref" renumbered into the
    selection (`renumber_rows`); None stays None. relabel: groups to 0..n_groups−1. A field
    missing from `kinds` raises KeyError (a new field must be classified)."""
    pick, host = row_index(idx, n, f"{who}.rows")
    kw = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        kind = kinds[f.name]
        if kind == "batch" or v is None:
            kw[f.name] = v
        elif kind == "list":
            kw[f.name] = [v[i] for i in host]
        elif kind == "row-ref":
            kw[f.name] = renumber_rows(v, pick, f"{who}.{f.name}", host)
        elif kind == "row-token" and t is not None:
            kw[f.name] = v[pick, :t]
        else:
            kw[f.name] = v[pick]
    if relabel:
        kw["group"] = group_index(kw["group"])[0]
    return kw


TOKEN_BATCH_FIELDS = {  # how `TokenBatch.rows` treats each field
    "tokens": "row", "mask": "row", "logps": "row", "old_logps": "row", "advantages": "row",
    "group": "row", "ref_logps": "row", "rewards": "row", "repair_of": "row-ref",
    "n_seqs": "batch", "n_tokens": "batch", "width": "batch", "validate": "batch",
}


def row_index(idx: Tensor | Sequence[int], n: int, who: str) -> tuple[Tensor, list[int]]:
    """Row indices from `idx`: a (k,) integer tensor or int sequence of indices in [0, n), or
    an (n,) bool mask. Returns ((k,) long tensor on idx's device (CPU for a sequence), the same
    k indices as a list: one host copy of idx, also used for the check). ValueError naming the
    first index out of range, or the mask's shape when it is not (n,)."""
    if not isinstance(idx, Tensor):
        idx = torch.as_tensor(list(idx), dtype=torch.long)
    if idx.dtype == torch.bool:
        if tuple(idx.shape) != (n,):
            raise ValueError(f"{who}: a bool mask must have shape ({n},), got {tuple(idx.shape)}")
        idx = idx.nonzero().squeeze(-1)
        return idx, idx.tolist()
    if idx.dim() != 1 or idx.is_floating_point() or idx.is_complex():
        raise ValueError(f"{who}: idx must be a (k,) integer or ({n},) bool tensor, got {_desc(idx)}")
    host = idx.tolist()
    for j, i in enumerate(host):
        if not 0 <= i < n:
            raise ValueError(f"{who}: index {i} (position {j} of idx) is out of range for {n} rows")
    return idx.long(), host


def renumber_rows(ref: Tensor, rows: Tensor, who: str = "renumber_rows",
                  host: list[int] | None = None) -> Tensor:
    """A per-row reference to another row, ref (N,) long (−1: none), re-indexed for the
    selection `rows` (k,) long of distinct indices in [0, N): (k,) long, the position in `rows`
    of the row each selected row refers to, on ref's device; −1 when it refers to none or to an
    unselected row. host: rows as a list when the caller has it (saves a device sync).
    ValueError naming a repeated index (a reference to it would be ambiguous)."""
    host = rows.tolist() if host is None else host
    if len(set(host)) != len(host):
        seen = set()
        for r in host:
            if r in seen:
                raise ValueError(f"{who}: row {r} is selected twice, so references to it "
                                 "are ambiguous")
            seen.add(r)
    rows = rows.to(ref.device)
    pos = torch.full_like(ref, -1)
    pos[rows] = torch.arange(rows.numel(), device=ref.device, dtype=ref.dtype)
    referred = ref[rows]  # (k,) the row each selected row refers to, −1 none
    return torch.where(referred >= 0, pos[referred.clamp(min=0)], -1)


def _check_batch(b: TokenBatch) -> None:
    if not isinstance(b.tokens, Tensor) or b.tokens.dim() != 2:
        raise ValueError(f"TokenBatch.tokens must be a (B, T) tensor, got {_desc(b.tokens)}")
    B, T = b.tokens.shape
    if b.tokens.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"TokenBatch.tokens must be an integer tensor, got {b.tokens.dtype}")
    expect = {
        "mask": (B, T), "logps": (B, T), "old_logps": (B, T), "group": (B,),
        "advantages": (B, T) if getattr(b.advantages, "dim", lambda: 1)() == 2 else (B,),
    }
    for name, shape in (("ref_logps", (B, T)), ("rewards", (B,)), ("repair_of", (B,))):
        if getattr(b, name) is not None:
            expect[name] = shape
    for name, shape in expect.items():
        v = getattr(b, name)
        if not isinstance(v, Tensor):
            raise ValueError(f"TokenBatch.{name} must be a tensor of shape {shape}, got {_desc(v)}")
        if tuple(v.shape) != shape:
            raise ValueError(
                f"TokenBatch.{name} has shape {tuple(v.shape)}, expected {shape} "
                f"(tokens is {tuple(b.tokens.shape)})"
            )
        if v.device != b.tokens.device:
            raise ValueError(
                f"TokenBatch.{name} is on {v.device} but tokens is on {b.tokens.device}"
            )
    if b.mask.dtype != torch.bool:
        raise ValueError(f"TokenBatch.mask must be bool, got {b.mask.dtype}")
    for name in ("group", "repair_of"):
        v = getattr(b, name)
        if v is not None and v.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"TokenBatch.{name} must be an integer tensor, got {v.dtype}")
    for name in ("logps", "old_logps", "advantages", "ref_logps", "rewards"):
        v = getattr(b, name)
        if v is not None and not v.is_floating_point():
            raise ValueError(f"TokenBatch.{name} must be floating point, got {v.dtype}")
    if b.validate:
        _check_finite(b)


def _check_finite(b: TokenBatch) -> None:
    for name in ("logps", "old_logps", "ref_logps"):
        v = getattr(b, name)
        if v is None:
            continue
        bad = ~torch.isfinite(v.detach()) & b.mask
        if bool(bad.any()):
            i, t = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"TokenBatch.{name} is not finite at row {i}, position {t} "
                f"(value {v[i, t].item()}, group {int(b.group[i])})"
            )
    for name in ("advantages", "rewards"):
        v = getattr(b, name)
        if v is None:
            continue
        bad = ~torch.isfinite(v.detach())
        if v.dim() == 2:  # token advantages: only masked-in positions must be finite
            bad &= b.mask
        if bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            raise ValueError(f"TokenBatch.{name} is not finite at row {i} (group {int(b.group[i])})")


def _desc(v: object) -> str:
    if isinstance(v, Tensor):
        return f"tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    return type(v).__name__


def group_index(group: Tensor) -> tuple[Tensor, Tensor]:
    """Map arbitrary group labels to 0..n_groups-1.

    Returns (gid (B,) long, sizes (n_groups,) long).
    """
    _, gid = torch.unique(group, return_inverse=True)
    sizes = torch.bincount(gid)
    return gid, sizes


def split_share(group: Tensor, part: Tensor) -> float:
    """Share of groups (group, part: (B,) long) whose rows fall into more than one part — an
    optimizer step, a micro-batch (NaN with no group: undefined)."""
    gid, sizes = group_index(group)
    lo = torch.full_like(sizes, torch.iinfo(torch.long).max).scatter_reduce(0, gid, part, "amin")
    hi = torch.full_like(sizes, -1).scatter_reduce(0, gid, part, "amax")
    return float((hi != lo).float().mean()) if sizes.numel() else math.nan


def advantages(
    rewards: Tensor, group: Tensor, scale: str = "group", eps: float = 1e-4
) -> Tensor:
    """Group-relative advantages A_i = (R_i − mean_g R) / (std + eps)  (docs/concepts/index.md#setting-and-notation).

    rewards (B,) float, group (B,) int → (B,) float in the dtype of rewards.
    scale: "group" (std of the row's group, unbiased as in TRL), "batch" (std of all rewards),
    "none" (no division). A group of one gets A = 0 (its own mean; our convention).
    Raises ValueError naming the row and group of a NaN/inf reward.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantages: unknown scale {scale!r}; valid: {ADVANTAGE_SCALES}")
    if rewards.dim() != 1 or group.shape != rewards.shape:
        raise ValueError(
            f"advantages: rewards and group must both be (B,), got {tuple(rewards.shape)} "
            f"and {tuple(group.shape)}"
        )
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"advantages: reward of row {i} (group {int(group[i])}) is {rewards[i].item()}"
        )
    gid, sizes = group_index(group)
    n = sizes.to(rewards.dtype)
    mean = torch.zeros_like(n).index_add_(0, gid, rewards) / n  # (n_groups,)
    centred = rewards - mean[gid]  # (B,)
    if scale == "none":
        return centred
    if scale == "group":
        ss = torch.zeros_like(n).index_add_(0, gid, centred**2)
        std = (ss / (n - 1).clamp(min=1)).sqrt()[gid]  # unbiased; a group of one has std 0
    else:
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    return centred / (std + eps)
