"""Mixed precision (`--amp`): the one autocast every forward of the loop runs under, and the
FSDP2 policy that goes with it.

What `--amp` changes, on any device (CPU included):
- forwards (sampling, the optimizer step's micro-batches, the learning tax, drift, the probe
  set, held-out evaluation) run under `torch.autocast(device, torch.bfloat16)`: matrix
  products in bf16, autocast's float32 list (softmax, norms, losses) in float32;
- parameters never change dtype: the master weights, their gradients and AdamW's moments are
  float32, and checkpoints are written in float32;
- log-probs are float32: `loop/numerics/logprobs.py` upcasts the (bf16) logits before the
  log-softmax, so W, the residuals, the tax and drift are all computed from float32 log-probs;
- under `--fsdp` each unit gets `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`:
  the all-gathered weights are bf16 copies of the float32 shards, gradients are
  reduce-scattered in float32 into the float32 shards the optimizer steps.

How close to float32 (`amp_gap`, the bounds below; tests/test_amp.py): the hook-measured W
equals the closed form evaluated at the autocast log-probs to float32 rounding (the loss
itself is float32); against a float32 forward the log-probs, W and the gradient differ by bf16
rounding, within AMP_* below. FSDP2's policy casts whole modules (the residual stream runs in
bf16) where autocast casts per op, so it sits further from float32 than one process's autocast,
within the same bounds.
"""

from __future__ import annotations

import contextlib

import torch

# How far a bf16 forward may sit from the float32 one (tiny policies, measured in
# tests/test_amp.py; bf16 keeps 8 mantissa bits, relative spacing 2^-8 ≈ 4e-3). Log-probs move
# most at unlikely tokens (large |logit| gaps), so the per-token bound is loose and the mean
# tight; W follows the log-probs through the ratio r = exp(l − l_old); the policy gradient sums
# terms that cancel (Σ A = 0 in a group), so its bf16 noise is judged by direction.
AMP_LOGP_ATOL = 0.75  # nats: max over tokens of |l_amp − l_fp32|
AMP_LOGP_MEAN = 0.05  # nats: mean over tokens of |l_amp − l_fp32|
AMP_W_L1 = 0.1  # Σ|W_amp − W_fp32| / Σ|W_fp32| over the batch
AMP_GRAD_COS = 0.95  # cosine of the amp policy gradient to the float32 one
# the hook-measured W against the closed form at the same (float32) log-probs: the loss is
# float32 arithmetic whatever the forward's precision, so float32 rounding
W_EXACT_RTOL = 1e-6  # max|W_hook − W_closed| / max|W|


def autocast(device: str | torch.device, amp: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` ("cpu", "cuda", "cuda:1", a torch.device) when `amp`, else a
    no-op context."""
    if not amp:
        return contextlib.nullcontext()
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16)


def amp_context(cfg) -> contextlib.AbstractContextManager:
    """`autocast(cfg.device, cfg.amp)`: the context every forward of a run uses."""
    return autocast(cfg.device, cfg.amp)


def fsdp_policy(amp: bool):
    """FSDP2's `MixedPrecisionPolicy` for `--amp` (bf16 compute and all-gather, float32
    gradient reduction), or None for float32 throughout."""
    if not amp:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def bf16_autocast_ok(device: str | torch.device) -> bool:
    """True when a bf16 autocast matmul runs on `device` and returns bf16 (what --amp needs)."""
    try:
        x = torch.ones(4, 4, device=device)
        with autocast(device, True):
            y = x @ x
        return y.dtype == torch.bfloat16 and bool(torch.isfinite(y.float()).all())
    except (RuntimeError, TypeError):
        return False


def amp_gap(ref_logps: torch.Tensor, logps: torch.Tensor, *, ref_W: torch.Tensor, W: torch.Tensor,
            ref_grad: torch.Tensor, grad: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far a reading (log-probs (B, T) nats, W (B, T), flat gradient (P,)) sits from a
    reference on the same tokens (mask (B, T) bool): the quantities the AMP_* bounds hold."""
    d = (logps - ref_logps)[mask].abs().double()
    w = (W - ref_W).abs().double().sum() / ref_W.abs().double().sum().clamp(min=1e-30)
    cos = torch.nn.functional.cosine_similarity(grad.double(), ref_grad.double(), dim=0)
    return {"logp_max": float(d.max()) if d.numel() else 0.0,
            "logp_mean": float(d.mean()) if d.numel() else 0.0,
            "w_l1": float(w), "grad_cos": float(cos)}


def amp_failures(gap: dict[str, float]) -> list[str]:
    """The AMP_* bounds `gap` (from `amp_gap`) breaks, one line each; [] when within all."""
    bad = []
    if not gap["logp_max"] <= AMP_LOGP_ATOL:
        bad.append(f"log-prob gap {gap['logp_max']:.3g} nats > {AMP_LOGP_ATOL}")
    if not gap["logp_mean"] <= AMP_LOGP_MEAN:
        bad.append(f"mean log-prob gap {gap['logp_mean']:.3g} nats > {AMP_LOGP_MEAN}")
    if not gap["w_l1"] <= AMP_W_L1:
        bad.append(f"W L1 gap {gap['w_l1']:.3g} > {AMP_W_L1}")
    if not gap["grad_cos"] >= AMP_GRAD_COS:
        bad.append(f"gradient cosine {gap['grad_cos']:.4f} < {AMP_GRAD_COS}")
    return bad
