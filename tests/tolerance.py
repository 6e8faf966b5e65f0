"""Float32 tolerances that follow from round-off, for every float32 gradient / log-prob comparison.

Two float32 computations of one quantity that add in different orders — chunked vs full logits,
micro-batches vs one pass, two processes vs one, a backward hook vs a closed form, the vectorised
kernels of one CPU vs another's (or torch's portable ones, `ATEN_CPU_CAPABILITY=default`) — differ
by round-off. Each addition rounds to half an ulp of the running sum, so the gap scales with the
magnitudes summed, not with the entry compared: an entry near 0 of a gradient whose large entries
are ~12 can be off by a few ulps of 12. The tolerance is therefore set relative to the tensor's
largest magnitude,

    |actual − expected| ≤ ulps · ε₃₂ · max|expected|        (ε₃₂ = 2⁻²³ ≈ 1.19e-7)

with `ulps` = 256 by default (≈ 3e-5 of the largest entry): far above the 1–10 ulps the reduction
orders measured here differ by, far below what a real bug does (a wrong position, scale or
transform moves entries by their own size). Pass `scale=` where the magnitude that sets the
round-off is not the compared tensor's own (log-probs: the logits'). Where the two sides are
computed in the same order, compare bitwise (`torch.equal`), not with this helper.
"""

from __future__ import annotations

import numpy as np
import torch

EPS32 = float(torch.finfo(torch.float32).eps)
ULPS = 256


def _tensor(x) -> torch.Tensor:
    return x.detach() if torch.is_tensor(x) else torch.as_tensor(np.asarray(x))


def f32_atol(expected, ulps: int = ULPS, scale: float | None = None) -> float:
    """The absolute tolerance `ulps · ε₃₂ · scale`, scale = max|expected| over its finite entries
    unless given (a tiny floor keeps an all-zero tensor exact up to denormals)."""
    if scale is None:
        e = _tensor(expected).double()
        e = e[torch.isfinite(e)]
        scale = float(e.abs().max()) if e.numel() else 0.0
    return ulps * EPS32 * max(float(scale), 1e-30)


def assert_close_f32(actual, expected, *, ulps: int = ULPS, scale: float | None = None,
                     msg: str | None = None) -> None:
    """Assert two tensors (or arrays) agree to float32 round-off of their largest magnitude; the
    same shape, NaN where the other is NaN. The message names the worst entry and the ulps used."""
    a, e = _tensor(actual).double(), _tensor(expected).double()
    atol = f32_atol(e, ulps, scale)
    assert a.shape == e.shape, f"{msg or 'tensors'}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    both_nan = torch.isnan(a) & torch.isnan(e)
    gap = (a - e).abs().masked_fill(both_nan, 0.0)
    worst = float(gap.max()) if gap.numel() else 0.0
    if not worst <= atol:  # also fails on a NaN gap
        where = tuple(int(i) for i in np.unravel_index(int(gap.nan_to_num(float("inf")).argmax()),
                                                       tuple(gap.shape))) if gap.dim() else ()
        raise AssertionError(
            f"{msg or 'tensors'}: max |Δ| {worst:.3g} at {where} > {atol:.3g} "
            f"(= {ulps} float32 ulps of {atol / (ulps * EPS32):.3g})")
