"""What a run trains: the task, its held-out split, and the policy.

Tasks and their verifiers (task, answers); the held-out split and its scoring during training
(heldout); tokenizer, tiny policies, warm start, save and load (policy); real checkpoints'
options and the load-time self-check that refuses a model whose log-probs differ from its own
forward (realmodel, selfcheck); every transformers causal LM through that check (archsweep).

Imports: faults, config, numerics, rollouts (warm start and the self-check sample).
"""
