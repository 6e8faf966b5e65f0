"""Drift of the policy at shared contexts, and entropy collapse (docs/concepts/drift.md).

Pure functions on log-prob tensors: the training loop does the forwards (before and after an
optimizer step, or on a fixed probe set) and hands the (…, V) log-softmax outputs here.
Everything is in nats; every figure is a 0-dim (or (K,)) tensor on the device, no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.nodes import SharedNodes


def entropy(logp: Tensor) -> Tensor:
    """Entropy −Σ_v p log p (nats) of log-probs (…, V) → (…)."""
    return -(logp.exp() * logp).sum(-1)


def kl_rows(logp_ref: Tensor, logp_now: Tensor) -> Tensor:
    """KL(π_ref ‖ π_now) per context (nats): (K, V), (K, V) → (K,) (any leading shape works).

    With logp_ref the initial policy on a fixed probe set: the cumulative drift over training.
    """
    if logp_ref.shape != logp_now.shape:
        raise ValueError(f"kl_rows: shapes differ, {tuple(logp_ref.shape)} vs {tuple(logp_now.shape)}")
    d = logp_ref - logp_now
    return d.mul_(logp_ref.exp()).sum(-1)  # p_ref · (log p_ref − log p_now), two temporaries


def _stats(prefix: str, dlogp: Tensor, kl: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """Mean and sum of dlogp and kl over `keep` (same shape, bool); a mean over no position
    is undefined: NaN (the sums are 0 and the count 0)."""
    n = keep.sum()
    den = torch.where(n > 0, n.to(dlogp.dtype), float("nan"))  # 0/NaN = NaN, no 0/0 warning
    s_d, s_k = (dlogp * keep).sum(), (kl * keep).sum()
    return {f"{prefix}_dlogp_mean": s_d / den, f"{prefix}_dlogp_sum": s_d,
            f"{prefix}_kl_mean": s_k / den, f"{prefix}_kl_sum": s_k, f"{prefix}_count": n}


def node_drift(logp_before: Tensor, logp_after: Tensor, batch: TokenBatch,
               sn: SharedNodes) -> dict[str, Tensor]:
    """How one optimizer step moved the policy at shared nodes and at divergent positions.

    logp_before, logp_after: (B, T, V) log-softmax of the policy before / after the step over
    the batch's response positions (position t = the distribution of token t). At each node n
    of `sn` (read at its representative (rep(n), t_n), whose history every member shares):
      node_dlogp_* : Δ log π(a*|h*) of the shared token, after − before
      node_kl_*    : KL(π_before(·|h*) ‖ π_after(·|h*))
    and the same at divergent positions (masked in, not in any node of `sn`), split by the
    row's advantage: div_pos_* (A > 0), div_neg_* (A < 0); rows with A = 0 are in neither.
    Each prefix gets _mean, _sum (0-dim float tensors; a mean over no position is NaN:
    undefined) and _count (0-dim long).
    """
    B, T = batch.tokens.shape
    if logp_before.shape != logp_after.shape or tuple(logp_before.shape[:2]) != (B, T):
        raise ValueError(f"node_drift: logps must both be ({B}, {T}, V), got "
                         f"{tuple(logp_before.shape)} and {tuple(logp_after.shape)}")
    tok = batch.tokens.long().unsqueeze(-1)
    dlogp = (logp_after.gather(-1, tok) - logp_before.gather(-1, tok)).squeeze(-1)  # (B, T)
    kl = kl_rows(logp_before, logp_after)  # (B, T)
    at_node = torch.zeros_like(batch.mask).index_put_(
        (sn.rep, sn.position), torch.ones_like(sn.rep, dtype=torch.bool))
    divergent = batch.mask & (sn.node < 0)
    A = batch.adv_tokens
    out = _stats("node", dlogp, kl, at_node)
    out.update(_stats("div_pos", dlogp, kl, divergent & (A > 0)))
    out.update(_stats("div_neg", dlogp, kl, divergent & (A < 0)))
    return out


def divergent_dlogp(logps_before: Tensor, logps_after: Tensor, batch: TokenBatch,
                    sn: SharedNodes) -> dict[str, Tensor]:
    """The divergent part of `node_drift` from the sampled tokens' log-probs alone.

    logps_before, logps_after (B, T): log π(y_t) of the batch's own tokens before / after the
    step. At masked-in positions in no node of `sn`, split by the row's advantage:
    div_pos_dlogp_sum / div_pos_count (A > 0) and div_neg_* (A < 0), 0-dim tensors. No KL:
    that needs the full distributions (see `node_drift`).
    """
    dlogp = logps_after - logps_before  # (B, T)
    divergent = batch.mask & (sn.node < 0)
    A = batch.adv_tokens
    out = {}
    for name, keep in (("div_pos", divergent & (A > 0)), ("div_neg", divergent & (A < 0))):
        out[f"{name}_dlogp_sum"] = (dlogp * keep).sum()
        out[f"{name}_count"] = keep.sum()
    return out


KL_BUDGET = 1 << 24  # float32 entries per KL chunk (64 MiB): rows = KL_BUDGET // V


def node_terms(logp_before: Tensor, logp_after: Tensor, token: Tensor,
               rows: int | None = None) -> tuple[Tensor, Tensor]:
    """Per node: (n,) Δ log π of its shared token (after − before) and (n,) KL(before ‖ after),
    from the (n, V) distributions at the nodes' contexts and the tokens (n,).

    The KL is taken `rows` nodes at a time (default KL_BUDGET // V), so its (rows, V)
    temporaries (exp, difference, product) never reach n × V: with a 512-row step of 64 groups
    and V = 151,936 three full (n, V) temporaries were ~0.5 GB. Each node's KL is the same row
    reduction as in one pass, so the values are unchanged.
    """
    tok = token.long().unsqueeze(-1)
    dlogp = (logp_after.gather(-1, tok) - logp_before.gather(-1, tok)).squeeze(-1)
    n, V = logp_before.shape[0], logp_before.shape[-1]
    step = rows or max(1, KL_BUDGET // max(V, 1))
    kl = [kl_rows(logp_before[s: s + step], logp_after[s: s + step]) for s in range(0, n, step)]
    return dlogp, (torch.cat(kl) if kl else kl_rows(logp_before, logp_after))


def kl_nodes(n: int, vocab: int, cap: int | None = None) -> Tensor:
    """(K,) long: which of n nodes keep their full (V,) distribution for the KL of the drift.

    K = min(n, cap), cap default KL_BUDGET // vocab (110 nodes, 64 MiB of float32, at
    V = 151,936). With n ≤ cap every node (0..n−1); else K nodes evenly spaced over the node
    order, floor(k · n / K) for k = 0..K−1 (a systematic sample: deterministic, spread over
    groups and positions). This caps the π_before(·) rows a step keeps across its optimizer
    step at K × V, whatever the batch; the Δ log π of the shared token needs no distribution
    and stays exact at every node.
    """
    k = min(n, cap if cap is not None else max(1, KL_BUDGET // max(vocab, 1)))
    return torch.arange(n) if k >= n else torch.arange(k) * n // k


def drift_sums(dlogp: Tensor, kl: Tensor) -> dict[str, Tensor]:
    """node_dlogp_sum, node_count over the (N,) Δ log π terms; node_kl_sum, node_kl_count over
    the (K,) KL terms (K = N unless the KL is taken at a sample of nodes, `kl_nodes`)."""
    return {"node_dlogp_sum": dlogp.sum(), "node_kl_sum": kl.sum(),
            "node_count": torch.tensor(dlogp.numel()), "node_kl_count": torch.tensor(kl.numel())}


def shared_drift(logp_before: Tensor, logp_after: Tensor, token: Tensor,
                 rows: int | None = None) -> dict[str, Tensor]:
    """The node part of `node_drift` from the (N, V) distributions at the N nodes' contexts
    and their shared tokens (N,): node_dlogp_sum, node_kl_sum, node_count (0-dim tensors).
    The KL runs `rows` nodes at a time (`node_terms`); the (N,) terms are summed once."""
    return drift_sums(*node_terms(logp_before, logp_after, token, rows))


def equal_solution_logodds(logp_a: Tensor, logp_b: Tensor) -> tuple[Tensor, Tensor]:
    """Log-odds and binary entropy between two equally correct solutions (docs/concepts/drift.md#entropy-collapse, Cor. 3.2).

    logp_a, logp_b: sequence log-probs log π(y_a), log π(y_b) (any equal shapes, nats).
    Returns (log_odds = log π(y_a) − log π(y_b), h(p) in nats with p = σ(log_odds)), computed
    stably (h → 0, never NaN, as |log_odds| grows).
    """
    x = logp_a - logp_b
    # −log σ(x) = softplus(−x), −log(1 − σ(x)) = softplus(x)
    h = torch.sigmoid(x) * F.softplus(-x) + torch.sigmoid(-x) * F.softplus(x)
    return x, h
