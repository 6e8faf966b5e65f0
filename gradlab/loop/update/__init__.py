"""One optimizer step per objective, with its measurements.

How a rollout batch is cut into steps and micro-batches (batches); loss and backward with
the W hook, learning tax and drift (step); the step's
metrics, reduced over ranks once per rollout step (metrics); the fixed probe contexts the
drift is measured on (probeset).

Imports: faults, config, numerics, rollouts, setup, scale, runs.
"""
