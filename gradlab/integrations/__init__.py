"""gradlab inside other trainers (optional extras; nothing here is imported by `import gradlab`).

Each host hands gradlab's instruments what they read (W, the batch, forwards before and after the
optimizer step); the instruments measure.

    trl/     `GradlabGRPOTrainer` / `GradlabMixin` on TRL's `GRPOTrainer` (`pip install gradlab[trl]`)
    verl/    gradlab's policy losses and IBPO estimators in verl's registries
    audit/   `gradlab audit trl` and `gradlab audit verl`: which trainer settings break cancellation
"""
