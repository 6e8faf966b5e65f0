"""gradlab's own trainer: rollout, optimizer step with probes, run store, resume."""
