"""Several processes: data parallelism (dist) and FSDP2 sharding (fsdp) under torchrun.

Imports: faults, config, numerics.
"""
