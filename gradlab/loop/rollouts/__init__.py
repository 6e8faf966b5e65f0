"""Sampling groups of responses: the first stage of a step's data flow.

What is sampled, as one `SamplingSpec` for every layout (spec); the KV-cached sampler with
hashed per-row noise and the `Rollout` it returns (rollout); tree
groups re-sampled from shared prefixes (tree); groups with repaired responses (repair); the
`--rollout` dispatch and its token accounting (layouts).

Imports: faults, config, numerics.
"""
