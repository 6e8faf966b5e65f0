"""The model's numbers: how a causal LM's log-probs are computed and at what precision.

Per-token log-probs through the model's own forward, chunked (logprobs); the one autocast and
its tolerances (precision); the attention kernel and dropout per architecture (arch).

Imports: faults, config.
"""
