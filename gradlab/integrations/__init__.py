"""gradlab inside other trainers (optional extras; nothing here is imported by `import gradlab`).

- `gradlab.integrations.trl`: `GradlabGRPOTrainer` (or `GradlabMixin` for your own
  `GRPOTrainer` subclass) measures W and the cancellation residual of TRL's own loss on a real
  run, and applies DFPO as a drop-in gradient transform. Needs `pip install gradlab[trl]`.
- `gradlab.integrations.trl_audit`: `gradlab audit trl`, the table of TRL's loss settings.
  `trl_audit_options`: its `--options` rows (masks, reward scaling, emulated vLLM importance
  sampling, steps_per_generation); `trl_audit_setup`: the workloads and trainer both use.
- `gradlab.integrations.verl_audit`: `gradlab audit verl`; `verl_audit_options`: its `--options`
  rows (verl's rollout IS weights and rejection sampling, emulated engine); `verl_audit_setup`.
- `gradlab.integrations.trl_tax`: the learning tax ‖g_tax‖/‖g‖ as a sampled probe of the TRL
  trainer (`GradlabConfig(tax_every=k)`).
"""
