"""The token-flip ledger: what one optimizer step did to every sampled token (docs/concepts/token-flips.md).

For a step θ → θ′ and every masked-in token y_{i,t} of the batch that made it, context fixed,

    Δ_{i,t} = log π_θ′(y_{i,t} | x, y_{i,<t}) − log π_θ(y_{i,t} | x, y_{i,<t})   (nats).

Each token falls in one cell of sign × kind × confidence:
  sign  "pos", "neg", "zero": the sign of its advantage A_{i,t} (the objective's token advantage;
        A_i broadcast over the row for sequence-level objectives);
  kind  "group": shared by every row of its group in the batch (a full-group node);
        "subset": shared by ≥ 2 rows but not all (a trie node that is not full-group);
        "own": no other row of the batch has the same token under the same history;
  conf  π_θ(y_{i,t}) = exp(log-prob before the step) in fixed bins [c_k, c_{k+1}) (the last bin
        closed: [c_{K−1}, 1]); default edges 0, .5, .9, .99, 1.
Per cell the ledger keeps sums, so optimizer steps, rollout steps and ranks add:
  count (tokens), dlogp_sum (Σ Δ, nats), boosted (Δ > 0), suppressed (Δ < 0),
  flipped (Δ opposes the advantage: A > 0 and Δ < 0, or A < 0 and Δ > 0; never for A = 0).
Δ = 0 exactly counts as neither boosted nor suppressed. `flip_shares` turns sums into shares
(NaN where the cell is empty, and flipped_share NaN for A = 0: there is no sign to oppose).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.nodes import SharedNodes, shared_nodes

SIGNS = ("pos", "neg", "zero")
KINDS = ("group", "subset", "own")
CONF_BINS = (0.0, 0.5, 0.9, 0.99, 1.0)
FIELDS = ("count", "dlogp_sum", "boosted", "suppressed", "flipped")
PREFIX = "flips/"  # every ledger key: flips/<sign>/<kind>/<conf>/<field>
ALL = "all"  # a marginal over kinds or confidence bins
SIGNED = "signed"  # the marginal over pos and neg (tokens with a sign to oppose)


def conf_labels(conf_bins: tuple[float, ...] = CONF_BINS) -> list[str]:
    """'0-0.5', '0.5-0.9', … : one label per confidence bin (edges as given, %g)."""
    _check_bins(conf_bins)
    return [f"{a:g}-{b:g}" for a, b in zip(conf_bins, conf_bins[1:])]


def key(sign: str, kind: str, conf: str, field: str) -> str:
    """The metric name of one cell's field, e.g. flips/pos/group/0.5-0.9/flipped."""
    return f"{PREFIX}{sign}/{kind}/{conf}/{field}"


def _check_bins(conf_bins) -> None:
    b = [float(x) for x in conf_bins]
    if len(b) < 2 or b[0] != 0.0 or b[-1] != 1.0 or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"flip_ledger: conf_bins must rise strictly from 0 to 1, got {tuple(conf_bins)}")


def cells(before: Tensor, batch: TokenBatch, conf_bins: tuple[float, ...] = CONF_BINS,
          nodes: SharedNodes | None = None) -> Tensor:
    """(B, T) long: each token's cell index ((sign · 3 + kind) · n_conf + conf), −1 off the mask.

    before (B, T): log π_θ of the batch's tokens before the step (nats); nodes: the batch's trie
    nodes (`shared_nodes(batch, "trie")`, computed when None)."""
    _check_bins(conf_bins)
    sn = shared_nodes(batch, "trie") if nodes is None else nodes
    if sn.kind != "trie":
        raise ValueError("flip_ledger: nodes must be trie nodes (shared_nodes(batch, 'trie')), "
                         "a full-group structure cannot tell subset-shared tokens from own ones")
    A = batch.adv_tokens
    sign = torch.where(A > 0, 0, torch.where(A < 0, 1, 2))
    full = sn.full[sn.node.clamp(min=0)] if sn.n else torch.zeros_like(batch.mask)
    kind = torch.where(sn.node < 0, 2, torch.where(full, 0, 1))
    edges = torch.tensor(conf_bins[1:-1], dtype=before.dtype, device=before.device)
    conf = torch.bucketize(before.detach().exp(), edges, right=True)  # [c_k, c_{k+1})
    n_conf = len(conf_bins) - 1
    idx = (sign * len(KINDS) + kind) * n_conf + conf
    return torch.where(batch.mask, idx, -1)


def flip_ledger(before: Tensor, after: Tensor, batch: TokenBatch,
                conf_bins: tuple[float, ...] = CONF_BINS,
                nodes: SharedNodes | None = None) -> dict[str, Tensor]:
    """The ledger's sums for one optimizer step: {flips/<sign>/<kind>/<conf>/<field>: 0-dim}.

    before, after (B, T): log π of the batch's own tokens before / after the step (nats; the
    values off `batch.mask` are ignored). batch: the step's TokenBatch (tokens, mask, group and
    the advantages that were trained: `objective.prepare(batch)` for token advantages).
    conf_bins: confidence edges, 0 < … < 1 inclusive of both ends. nodes: the batch's trie
    nodes (computed when None). Every cell is present (count 0 when empty); counts are long,
    dlogp_sum float64. Boolean-mask indexing syncs with the host on CUDA, and float64
    `index_add_` is not bitwise reproducible there (atomics); on the CPU it is.
    """
    B, T = batch.tokens.shape
    for name, x in (("before", before), ("after", after)):
        if tuple(x.shape) != (B, T):
            raise ValueError(f"flip_ledger: {name} must be ({B}, {T}) like the batch, got {tuple(x.shape)}")
    idx = cells(before, batch, conf_bins, nodes)
    m = batch.mask
    d = torch.where(m, after.detach().double() - before.detach().double(), 0.0)
    A = batch.adv_tokens
    flipped = ((A > 0) & (d < 0)) | ((A < 0) & (d > 0))
    n_cells = len(SIGNS) * len(KINDS) * (len(conf_bins) - 1)
    at = idx[m]
    cols = torch.stack([torch.ones_like(d[m]), d[m], (d[m] > 0).double(), (d[m] < 0).double(),
                        flipped[m].double()], -1)  # (n, 5)
    tab = torch.zeros(n_cells, len(FIELDS), dtype=torch.float64, device=d.device)
    tab.index_add_(0, at, cols)
    out = {}
    labels = conf_labels(conf_bins)
    for c in range(n_cells):
        s, rest = divmod(c, len(KINDS) * len(labels))
        k, b = divmod(rest, len(labels))
        for f, name in enumerate(FIELDS):
            v = tab[c, f]
            out[key(SIGNS[s], KINDS[k], labels[b], name)] = v if name == "dlogp_sum" else v.long()
    return out


def _parse(k: str) -> tuple[str, str, str, str]:
    sign, kind, conf, field = k[len(PREFIX):].split("/")
    return sign, kind, conf, field


def flip_shares(sums: dict[str, float]) -> dict[str, float]:
    """Shares and means of the ledger's cells and of its marginals, from summed cells (floats).

    For every cell, and for the marginals sign × all × all (sign in pos, neg, zero, signed),
    signed × kind × conf, signed × kind × all and signed × all × conf ("signed" = pos + neg):
      <…>/boosted_share, <…>/suppressed_share (of the cell's tokens), <…>/dlogp_mean (nats),
      <…>/flipped_share (of the cell's tokens; NaN for sign "zero": no sign to oppose).
    Every one is NaN when its cell holds no token. Marginals' sums are returned too
    (<…>/count, …), so a reader can weigh them. Keys other than flips/… are ignored.
    """
    cell = {}
    for k, v in sums.items():
        if k.startswith(PREFIX) and k.rsplit("/", 1)[-1] in FIELDS:
            sign, kind, conf, field = _parse(k)
            if sign in SIGNS and kind in KINDS and conf != ALL:
                cell[(sign, kind, conf, field)] = float(v)
    kinds = [k for k in KINDS if any(c[1] == k for c in cell)]
    confs = list(dict.fromkeys(c[2] for c in cell))
    signs = {s: [s] for s in SIGNS}
    signs[SIGNED] = ["pos", "neg"]
    out: dict[str, float] = {}
    groups = [(s, kd, cf) for s in SIGNS for kd in kinds for cf in confs]
    groups += [(s, ALL, ALL) for s in signs]
    groups += [(SIGNED, kd, cf) for kd in kinds + [ALL] for cf in confs + [ALL]
               if (kd, cf) != (ALL, ALL)]
    for s, kd, cf in groups:
        tot = {f: sum(cell.get((s2, k2, c2, f), 0.0) for s2 in signs[s]
                      for k2 in (kinds if kd == ALL else [kd])
                      for c2 in (confs if cf == ALL else [cf])) for f in FIELDS}
        if s == SIGNED or ALL in (kd, cf):
            out.update({key(s, kd, cf, f): v for f, v in tot.items()})
        n = tot["count"]
        out[key(s, kd, cf, "boosted_share")] = _div(tot["boosted"], n)
        out[key(s, kd, cf, "suppressed_share")] = _div(tot["suppressed"], n)
        out[key(s, kd, cf, "dlogp_mean")] = _div(tot["dlogp_sum"], n)
        out[key(s, kd, cf, "flipped_share")] = math.nan if s == "zero" else _div(tot["flipped"], n)
    return out


def _div(a: float, b: float) -> float:
    """a / b; NaN when b = 0 (an empty cell: undefined, not 0) or either side is NaN."""
    return math.nan if b == 0 or math.isnan(a) or math.isnan(b) else a / b
