"""Per-token log-probs of a causal LM over response positions: the one function that
training, the learning tax, drift and the probe set all call.

Layout: prompts left-padded (N, P), responses right-padded (N, T); position ids come from the
attention mask, so a left-padded row sees the positions of the unpadded sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
):
    """Log-probs (nats) of the response tokens, with gradient, from one forward pass.

    prompt_ids/prompt_mask: (N, P), left-padded; response_ids/response_mask: (N, T).
    Returns logps (N, T) float32, 0 at masked positions. With return_entropy and/or
    return_logprobs returns a tuple (logps, [entropy (N, T), 0 masked], [log-softmax (N, T, V)])
    in that order, all at `temperature` (logits / temperature).
    """
    T = response_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (N, P + T)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    out = model(
        input_ids=ids,
        attention_mask=mask.long(),
        position_ids=positions(mask),
        use_cache=False,
        logits_to_keep=T + 1,
    )
    logits = out.logits[:, :-1].float() / temperature  # (N, T, V): position t predicts token t
    logprobs = F.log_softmax(logits, dim=-1)
    logps = logprobs.gather(-1, response_ids[..., None]).squeeze(-1)
    logps = logps.masked_fill(~response_mask, 0.0)
    if not (return_entropy or return_logprobs):
        return logps
    result = [logps]
    if return_entropy:
        ent = -(logprobs.exp() * logprobs).sum(-1)
        result.append(ent.masked_fill(~response_mask, 0.0))
    if return_logprobs:
        result.append(logprobs)
    return tuple(result)
