"""The load-time check that gradlab's log-probs are the model's own.

Three computations of the same response log-probs must agree before any step:
  reference  the model's own forward, one row at a time, unpadded, in eval mode;
  sampler    `generate`'s behaviour log-probs (KV cache, left-padded batch) — old_logps;
  training   `token_logps` as the loop calls it (train mode, left-padded batch, position ids
             from the mask), both on the (N, T, V) grid and chunked through the selective
             log-softmax.
A gap beyond `TOLERANCE` nats (float32) refuses the model with one line naming the
architecture, the computation that disagrees and the gap: no model is ever trained with
log-probs gradlab cannot reproduce (a sampler whose samples are not the model's, or ratios
that are not 1 on-policy).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..faults.errors import ConfigError
from ..numerics.logprobs import token_logps
from ..rollouts.rollout import Rollout, generate

TOLERANCE = 1e-4  # nats, float32
PROBE_SEED = 9_177  # the check's prompts: task.problems(PROBE_PROMPTS, PROBE_SEED)
PROBE_PROMPTS, PROBE_G, PROBE_TOKENS = 2, 2, 6

_WHY = {
    "sampler": "gradlab's sampler (KV cache, left padding, position ids from the mask) does "
               "not reproduce it",
    "training": "the batched training forward (left padding, position ids from the mask) "
                "does not reproduce it",
    "training-chunked": "the chunked training log-probs do not reproduce it",
}


class ModelRefused(ConfigError):
    """The model's log-probs cannot be reproduced by gradlab's sampler or training forward."""


def architecture(model) -> str:
    """'<model_type> (<class name>)' of a Hugging Face model."""
    inner = getattr(model, "module", model)
    kind = getattr(getattr(inner, "config", None), "model_type", "?")
    return f"{kind} ({type(inner).__name__})"


def reference_logps(model, ro: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """(N, T) float32 log-probs (nats, at `temperature`) of the rollout's response tokens from
    the model's own forward on each row alone: no padding, default positions, eval mode;
    0 at masked positions."""
    out = torch.zeros(ro.response_ids.shape, dtype=torch.float32, device=ro.response_ids.device)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(ro.response_ids.shape[0]):
                p = ro.prompt_ids[i][ro.prompt_mask[i]]
                r = ro.response_ids[i][ro.response_mask[i]]
                logits = model(input_ids=torch.cat([p, r])[None], use_cache=False).logits[0]
                lp = F.log_softmax(logits[len(p) - 1 : -1].float() / temperature, dim=-1)
                out[i, : len(r)] = lp.gather(-1, r[:, None]).squeeze(-1)
    finally:
        model.train(was)
    return out


def _gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a − b| (nats) where the model's own forward b is finite; inf where a is not. A
    model whose own forward is not finite (a diverged checkpoint) is not a reproduction
    failure: the non-finite guard meets it at the first step (exit 3, or --on-nonfinite skip)."""
    d = (a - b).abs()[mask & torch.isfinite(b)]
    if d.numel() and not torch.isfinite(d).all():
        return float("inf")
    return float(d.max()) if d.numel() else 0.0


def measure(model, tokenizer, task, temperature: float = 1.0,
            keep_dropout: bool = False) -> dict[str, float]:
    """{computation: max |log-prob − reference| in nats} on a small probe batch (2 prompts of
    `task` × 2 responses of up to 6 tokens). The sampler draws with hashed noise (no RNG
    state is touched); the training forwards run in train mode as the loop does (eval mode
    when `keep_dropout`: dropout makes them a different random function by design)."""
    problems = task.problems(PROBE_PROMPTS, seed=PROBE_SEED)
    new = min(PROBE_TOKENS, getattr(task, "max_new_tokens", PROBE_TOKENS) or PROBE_TOKENS)
    keys = torch.arange(PROBE_PROMPTS * PROBE_G) + PROBE_SEED
    with _fails("sampler", model):
        ro = generate(model, tokenizer, problems, G=PROBE_G, max_new_tokens=new,
                      temperature=temperature, row_keys=keys)
    batch = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    with _fails("reference", model):
        ref = reference_logps(model, ro, temperature)
    was = model.training
    model.train(not keep_dropout)
    try:
        with torch.no_grad(), _fails("training", model):
            grid = token_logps(model, *batch, temperature)
            chunked = token_logps(model, *batch, temperature, chunk=3)
    finally:
        model.train(was)
    m = ro.response_mask
    return {"sampler": _gap(ro.old_logps, ref, m), "training": _gap(grid, ref, m),
            "training-chunked": _gap(chunked, ref, m)}


@contextlib.contextmanager
def _fails(path: str, model):
    """An exception inside `path`'s computation: `ModelRefused`, one line."""
    try:
        yield
    except ModelRefused:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the model's code refuses it
        line = (str(e).strip().splitlines() or [""])[0][:200]
        raise ModelRefused(f"--model: {architecture(model)} refused before any step: its "
                           f"{path} forward fails ({type(e).__name__}: {line})") from None


def self_check(model, tokenizer, task, temperature: float = 1.0, keep_dropout: bool = False,
               tolerance: float = TOLERANCE) -> dict[str, float]:
    """`measure`, then `ModelRefused` (one line: architecture, computation, gap) when any gap
    exceeds `tolerance` nats or is not finite. Returns the gaps."""
    gaps = measure(model, tokenizer, task, temperature, keep_dropout)
    for path, gap in gaps.items():
        if not gap <= tolerance:  # NaN refuses too
            raise ModelRefused(
                f"--model: {architecture(model)} refused before any step: its {path} log-probs "
                f"differ from the model's own forward by {gap:.3g} nats (> {tolerance:g}); "
                f"{_WHY[path]}")
    return gaps
