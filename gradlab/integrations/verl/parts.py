"""The pure parts of the verl integration (tensor functions, no verl import): row advantages,
gradlab's closed form of a verl loss, DFPO's W̃ − W, and verl's global normaliser totals."""

from __future__ import annotations

import torch
from torch import Tensor

from ...core import objectives
from ...core.batch import TokenBatch
from ...core.dfpo import node_map, transform_weights


def row_advantages(advantages: Tensor, mask: Tensor, strict: bool, who: str,
                   tokens: bool = False) -> Tensor:
    """(B,) A_i from verl's (B, T) token advantages: the masked mean of each row.

    strict: raise when a row's advantage is not constant over its tokens (DFPO's w = W/A and
    its group structure need one A per sequence, as GRPO-type estimators give). tokens: where
    they are not constant (e.g. gradlab_ibpo's token advantages), return them (B, T), 0 off the
    mask, as the loss used them."""
    if advantages.dim() == 1:
        return advantages.detach()
    m = mask.to(advantages.dtype)
    A = (advantages.detach() * m).sum(-1) / m.sum(-1).clamp(min=1)
    if strict or tokens:
        spread = float(((advantages.detach() - A.unsqueeze(-1)).abs() * m).max()) if m.numel() else 0.0
        if spread > 1e-6 * (1 + (float(A.abs().max()) if A.numel() else 0.0)):
            if tokens and not strict:
                return advantages.detach() * m
            raise ValueError(f"{who}: advantages vary along a response (max spread "
                             f"{spread:.3g}); DFPO needs one advantage per sequence "
                             "(a GRPO-type estimator)")
    return A


def closed_form(base: str, agg: str, config, T: int):
    """gradlab's closed-form objective for verl's `base` loss with `agg`, or None where gradlab
    has none. Dual clip (clip_ratio_c) of vanilla is not modelled (ratios below 3 agree)."""
    lo = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    hi = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    if base == "vanilla":
        norm = {"token-mean": "token", "seq-mean-token-mean": "seq",
                "seq-mean-token-sum-norm": "const"}.get(agg)
        if norm is None:
            return None
        scale = config.global_batch_info.get("loss_scale_factor") or T
        return objectives.get("grpo", eps=(lo, hi), norm=norm,
                              max_len=scale if norm == "const" else None)
    if base == "gspo" and agg == "seq-mean-token-mean":
        return objectives.get("gspo", eps=(lo, hi))
    return None


def dfpo_delta(W: Tensor, batch: TokenBatch, transform: str, nodes: str = "prefix",
               scope: str = "shared") -> Tensor:
    """(B, T) W̃ − W = A(w̃ − w), w = W/A on rows with A ≠ 0 (others left out: the TRL drop-in's
    rule, `DFPOGradientTransform` without weight). W in the loss's units."""
    node, n = node_map(batch, scope, nodes)
    A = batch.advantages.to(W.dtype)
    node = torch.where((A != 0).unsqueeze(-1), node, -1)
    a = A.unsqueeze(-1)
    w = torch.where(a != 0, W / torch.where(a != 0, a, 1), 0)
    return a * (transform_weights(w, A, node, n, transform) - w)


def global_totals(config) -> dict:
    """TokenBatch normaliser totals from verl's `config.global_batch_info` (engine path), per
    process: verl scales each process's loss by dp_size because the gradient is averaged."""
    info = getattr(config, "global_batch_info", None) or {}
    dp = info.get("dp_size") or 1
    out = {}
    if info.get("batch_num_tokens") is not None:
        out["n_tokens"] = int(info["batch_num_tokens"]) // dp
    if info.get("global_batch_size") is not None:
        out["n_seqs"] = int(info["global_batch_size"]) // dp
    return out


def micro_rows_of(batch: TokenBatch, start: int, part: TokenBatch) -> TokenBatch:
    """Rows start … start + part.B of a mini-batch `batch` (B, T_mini), cut to the micro-batch's
    width part.T and carrying its normaliser totals: the micro-batch as verl's loss saw it."""
    rows, T = slice(start, start + part.B), part.T

    def cut(x):
        return None if x is None else x[rows, :T] if x.dim() == 2 else x[rows]

    return TokenBatch(tokens=cut(batch.tokens), mask=cut(batch.mask), logps=cut(batch.logps),
                      old_logps=cut(batch.old_logps), advantages=cut(batch.advantages),
                      group=cut(batch.group), n_seqs=part.n_seqs, n_tokens=part.n_tokens,
                      width=part.width, validate=False)


class DFPOForm:
    """gradlab_dfpo's closed form on a base closed form: W̃ = W_c + A(w̃ − w) with w = W_c/A
    (`dfpo_delta`, the rule the loss applies to verl's measured W), (B, T)."""

    def __init__(self, base, transform: str, nodes: str = "prefix", scope: str = "shared") -> None:
        self.base, self.transform, self.nodes, self.scope = base, transform, nodes, scope
        self.name = f"dfpo[{getattr(base, 'name', base)}, {transform}]"

    def prepare(self, batch: TokenBatch) -> TokenBatch:
        return batch

    def modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        Wc = self.base.modulation(batch, off)
        return Wc + dfpo_delta(Wc, batch, self.transform, self.nodes, self.scope)


class MiniBatchForm:
    """verl's loss over one mini-batch (one optimizer step) in gradlab's closed form: verl
    computes each micro-batch's loss on its own, so each micro-batch's rows go through its own
    closed form with its own normaliser totals. parts: (closed form, the micro-batch's
    TokenBatch) in the mini-batch's row order. `modulation(batch, off)` is (B, T_mini), 0 at
    padded positions; `off` switches mechanisms off (attribution)."""

    def __init__(self, parts: list[tuple[object, TokenBatch]], name: str) -> None:
        self.parts, self.name = parts, name

    def prepare(self, batch: TokenBatch) -> TokenBatch:
        return batch

    def modulation(self, batch: TokenBatch, off: tuple = ()) -> Tensor:
        out = torch.zeros(batch.logps.shape, dtype=torch.float64, device=batch.logps.device)
        start = 0
        for form, part in self.parts:
            out[start:start + part.B, :part.T] = form.modulation(micro_rows_of(batch, start, part), off)
            start += part.B
        return out
