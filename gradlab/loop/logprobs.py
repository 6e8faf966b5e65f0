"""Per-token log-probs of a causal LM over response positions: the one function that
training, the learning tax, drift and the probe set all call.

Layout: prompts left-padded (N, P), responses right-padded (N, T); position ids come from the
attention mask, so a left-padded row sees the positions of the unpadded sequence.

Memory: logits never exceed LOGIT_BUDGET float32 entries (64 MiB) per chunk. The model body
runs once; when N × T × V fits the budget the LM head runs on the (N, T, V) grid (the numerics
of a plain forward, bit for bit). Otherwise the LM head and a selective log-softmax
(logsumexp minus the gathered logit) run over the response tokens only (mask True), `chunk`
tokens at a time, in float32 from bf16 logits under autocast, each chunk under
`torch.utils.checkpoint`, so its (chunk, V) logits are recomputed in backward instead of
stored: peak logits memory is O(chunk × V), not O(N T V).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOGIT_BUDGET = 1 << 24  # float32 logits per chunk (64 MiB): chunk = LOGIT_BUDGET // V tokens


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(N, L) position ids from a (N, L) attention mask: 0 at the first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logps(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    return_logprobs: bool = False,
    chunk: int | None = None,
    entropy_grad: bool = True,
):
    """Log-probs (nats) of the response tokens, with gradient, from one forward pass.

    prompt_ids/prompt_mask: (N, P), left-padded; response_ids/response_mask: (N, T).
    Returns logps (N, T) float32, 0 at masked positions. With return_entropy and/or
    return_logprobs returns a tuple (logps, [entropy (N, T), 0 masked], [log-softmax (N, T, V)])
    in that order, all at `temperature` (logits / temperature).
    chunk: logit rows per LM-head chunk (default LOGIT_BUDGET // V). return_logprobs=True
    materialises (N, T, V) by definition: call it on a few rows only (drift, probe set).
    entropy_grad=False: the entropy is a reading only (no graph). Why it matters: under the
    chunked path the checkpoint's backward then stops recomputing each chunk once lp's saved
    tensors are back, instead of redoing the V-wide softmax of the entropy (same values).
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (N, P + T)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    body, head = _body_and_head(model)
    if return_logprobs or head is None:
        return _full(model, ids, mask, response_ids, response_mask, temperature,
                     return_entropy, return_logprobs, entropy_grad)
    h = _hidden(model, body, ids, mask)[:, prompt_ids.shape[1] - 1 :]  # (N, T + 1, H)
    N, T = response_ids.shape
    c = chunk or max(1, LOGIT_BUDGET // head.out_features)
    if N * T <= c:  # fits one chunk: the plain computation on the (N, T, V) grid, same numerics
        return _from_logits(head(h), response_ids, response_mask, temperature, return_entropy,
                            False, entropy_grad)
    sel = response_mask.nonzero(as_tuple=True)  # only real response tokens reach the head
    hs, tok = h[:, :-1][sel], response_ids[sel]  # (M, H), (M,): position t predicts token t
    parts = []
    for s in range(0, tok.numel(), c):
        args = (head, hs[s : s + c], tok[s : s + c], temperature, return_entropy, entropy_grad)
        use_ckpt = torch.is_grad_enabled() and tok.numel() > c  # one chunk: nothing to save
        parts.append(checkpoint(_selective, *args, use_reentrant=False) if use_ckpt
                     else _selective(*args))
    out = []
    for k in range(2 if return_entropy else 1):  # scatter back to (N, T), 0 where masked
        vals = torch.cat([p[k] for p in parts]) if parts else h.new_zeros(0, dtype=torch.float32)
        out.append(h.new_zeros(response_ids.shape, dtype=torch.float32).index_put(sel, vals))
    return tuple(out) if return_entropy else out[0]


def _selective(head, hs: torch.Tensor, tok: torch.Tensor, temperature: float, entropy: bool,
               entropy_grad: bool = True):
    """(c,) log-probs of `tok` and (c,) entropies from (c, H) hidden states: the (c, V) logits
    live only inside this function (float32, logsumexp minus the gathered logit)."""
    logits = head(hs).float() / temperature  # (c, V)
    lse = logits.logsumexp(-1)
    lp = logits.gather(-1, tok[:, None]).squeeze(-1) - lse
    if not entropy:
        return (lp,)
    with _grad_if(entropy_grad):  # no graph: checkpoint's recompute never redoes this softmax
        ent = lse - (F.softmax(logits, -1) * logits).sum(-1)  # H = logsumexp - E_p[logit]
    return lp, ent


def _grad_if(keep: bool):
    """No-op context when `keep`, else no_grad (never turns grad on inside a no_grad region)."""
    return contextlib.nullcontext() if keep else torch.no_grad()


def _body_and_head(model):
    """(body, lm_head) of a Hugging Face causal LM (plain or DDP-wrapped), else (None, None).

    FSDP-sharded models take the plain path: their head parameters are only gathered inside
    the wrapped forward.
    """
    inner = getattr(model, "module", model)  # DDP keeps the model in .module
    body, head = getattr(inner, "model", None), getattr(inner, "lm_head", None)
    try:
        from torch.distributed.fsdp import FSDPModule
        if isinstance(inner, FSDPModule) or isinstance(head, FSDPModule):
            return None, None
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    if not isinstance(body, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        return None, None
    return body, head


def _hidden(model, body, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, L, H) final hidden states (after the body's last norm).

    The call goes through `model` itself (so DDP's forward bookkeeping runs) with
    logits_to_keep=1: its own LM head then builds (N, 1, V) logits only; a forward hook on the
    body hands over the hidden states.
    """
    got = []

    def grab(_module, _args, out):
        got.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    handle = body.register_forward_hook(grab)
    try:
        model(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
              use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return got[0]


def _full(model, ids, mask, response_ids, response_mask, temperature, return_entropy,
          return_logprobs, entropy_grad: bool = True):
    """The plain path: the model's own (N, T + 1, V) logits and a full log-softmax."""
    T = response_ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
                use_cache=False, logits_to_keep=T + 1)
    return _from_logits(out.logits, response_ids, response_mask, temperature, return_entropy,
                        return_logprobs, entropy_grad)


def _from_logits(logits, response_ids, response_mask, temperature, return_entropy,
                 return_logprobs, entropy_grad: bool = True):
    """logps (N, T) [, entropy (N, T)] [, log-softmax (N, T, V)] from (N, T + 1, V) logits."""
    logits = logits[:, :-1].float() / temperature  # (N, T, V): position t predicts token t
    logprobs = F.log_softmax(logits, dim=-1)
    logps = logprobs.gather(-1, response_ids[..., None]).squeeze(-1)
    logps = logps.masked_fill(~response_mask, 0.0)
    if not (return_entropy or return_logprobs):
        return logps
    result = [logps]
    if return_entropy:
        with _grad_if(entropy_grad):
            ent = -(logprobs.exp() * logprobs).sum(-1)
        result.append(ent.masked_fill(~response_mask, 0.0))
    if return_logprobs:
        result.append(logprobs)
    return tuple(result)
