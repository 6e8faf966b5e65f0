"""Gradient-noise statistics of K policy gradients drawn at one fixed policy (docs/concepts/variance.md). Pure numpy on Gram matrices: every statistic below is a function of
the inner products of the K batch gradients with each other and with a reference gradient, so a
bootstrap over batches never touches the (K, P) gradients again.

Notation: g_1..g_K (P,) batch gradients of one objective, ḡ = mean_k g_k, g_ref the mean of R
further independent batch gradients (the reference), G_ab = ⟨g_a, g_b⟩ (K, K), d_k = ⟨g_k, g_ref⟩.

- tr Cov(g) = Σ_k ‖g_k − ḡ‖² / (K − 1)                         (unbiased, one batch's noise)
- ‖E g‖²   ≈ ⟨ḡ, g_ref⟩ = mean_k d_k                            (unbiased: ḡ and g_ref are
  independent; the plug-in ‖ḡ‖² is biased up by tr Cov / K and caps the ratio near K)
- gradient noise = tr Cov(g) / ⟨ḡ, g_ref⟩                        (dimensionless; the number of
  batches whose mean has a signal-to-noise ratio of one, cf. the "simple noise scale" of
  McCandlish et al. 2018, with batches as the unit)
- cos_k = d_k / (‖g_k‖ ‖g_ref‖)

Bootstrap: resample the K batches with replacement; one (n_boot, K) matrix of counts is shared by
every objective measured on the same batches, so ratios between objectives are paired.
"""

from __future__ import annotations

import numpy as np


def gram(grads: np.ndarray) -> np.ndarray:
    """(K, K) float64 inner products of K gradients; grads (K, P) (any float dtype)."""
    g = np.asarray(grads, dtype=np.float64)
    if g.ndim != 2:
        raise ValueError(f"gram: grads must be (K, P), got shape {g.shape}")
    return g @ g.T


def resample_counts(K: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """(n_boot, K) float64 counts of each batch in n_boot bootstrap resamples (rows sum to K)."""
    if K < 2:
        raise ValueError(f"resample_counts: need K ≥ 2 batches, got {K}")
    idx = np.random.default_rng(seed).integers(0, K, (n_boot, K))
    return np.stack([np.bincount(r, minlength=K) for r in idx]).astype(np.float64)


def _counts(K: int, w: np.ndarray | None) -> np.ndarray:
    """(n, K) counts; None = the sample itself (one row of ones)."""
    return np.ones((1, K)) if w is None else np.atleast_2d(np.asarray(w, dtype=np.float64))


def trace_cov(G: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """(n,) tr Cov(g) (squared gradient units) of each (re)sample: w (n, K) counts or None.

    With counts c (Σ c = K): ḡ = Σ c_k g_k / K and tr Cov = (Σ c_k G_kk − K ‖ḡ‖²) / (K − 1)."""
    K = G.shape[0]
    c = _counts(K, w)
    mean_sq = np.einsum("na,ab,nb->n", c, G, c) / K ** 2
    return np.maximum(c @ np.diag(G) - K * mean_sq, 0.0) / (K - 1)  # ≥ 0 (round-off aside)


def signal(ref_dot: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """(n,) ⟨ḡ, g_ref⟩ of each (re)sample: ref_dot (K,) = ⟨g_k, g_ref⟩, w (n, K) counts or None."""
    d = np.asarray(ref_dot, dtype=np.float64)
    return _counts(d.size, w) @ d / d.size


def gradient_noise(G: np.ndarray, ref_dot: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """(n,) tr Cov(g) / ⟨ḡ, g_ref⟩ of each (re)sample (module docstring). A non-positive signal
    (noise so large that ḡ points away from g_ref) gives inf: the noise is beyond measurement."""
    s = signal(ref_dot, w)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, trace_cov(G, w) / s, np.inf)


def cosines(ref_dot: np.ndarray, G: np.ndarray, ref_sq: float) -> np.ndarray:
    """(K,) cos(g_k, g_ref) = d_k / (‖g_k‖ ‖g_ref‖); ref_sq = ‖g_ref‖² (0 norms give 0)."""
    den = np.sqrt(np.diag(G) * float(ref_sq))
    d = np.asarray(ref_dot, dtype=np.float64)
    return np.divide(d, den, out=np.zeros_like(d), where=den > 0)


def reference_noise(sum_g: np.ndarray, sum_sq: float, R: int) -> tuple[float, float]:
    """(tr Cov, ‖E g‖²) of the reference sample from its running sums: sum_g = Σ_r g_r (P,),
    sum_sq = Σ_r ‖g_r‖², R batches (≥ 2). ‖E g‖² = ‖ḡ_R‖² − tr Cov / R (unbiased)."""
    if R < 2:
        raise ValueError(f"reference_noise: need R ≥ 2 reference batches, got {R}")
    m = np.asarray(sum_g, dtype=np.float64) / R
    msq = float(m @ m)
    tc = (float(sum_sq) - R * msq) / (R - 1)
    return tc, msq - tc / R


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of bootstrap samples (inf allowed: it sorts last)."""
    q = (1 - level) / 2
    s = np.asarray(samples, dtype=np.float64)
    return float(np.quantile(s, q, method="lower")), float(np.quantile(s, 1 - q, method="higher"))
