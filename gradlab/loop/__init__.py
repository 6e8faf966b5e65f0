"""gradlab's own trainer: one folder per concern, imports flowing one way.

A step's data flow (docs/architecture.md draws it):

    setup (task, policy) → rollouts (groups) → core.batch (TokenBatch) → update (loss, W, tax,
    drift) → update.metrics → runs (store, traces) → viz and `gradlab view`

    faults/     bad input, non-finite steps, durable writes, exit codes, pre-emption
    config.py   RunConfig: every option of a run, validated
    numerics/   log-probs through the model's own forward, precision, attention and dropout
    rollouts/   the sampler and the independent, tree and repair layouts
    setup/      tasks and verifiers, the held-out split, policies, the load-time self-check
    scale/      torchrun data parallelism and FSDP2
    runs/       the run folder: store, traces, lock, resume, live logs
    update/     one optimizer step in its phases, what its instruments see; metrics; probe contexts
    train.py    the loop, written out
    recipes/    loops built on train: the main job, its check, eval, variance, Prop. 3.1

A module imports only from the packages listed before its own (`LAYERS`; gradlab.core,
gradlab.probes and the rest of gradlab from anywhere).
"""

from __future__ import annotations

LAYERS = ("faults", "config", "numerics", "rollouts", "setup", "scale", "runs", "update",
          "train", "recipes")
