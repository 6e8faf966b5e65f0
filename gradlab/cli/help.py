"""The --help text of every run option (`gradlab run/tandem/reproduce --help`)."""

HELP = {
    "out": "run folder", "objectives": "comma-separated objective names, each optionally with parameters: "
                  "'gspo,dfpo-orth[nodes=trie],gspo[eps=1e9]' (labelled by the whole string), "
                  "and your own losses, path/file.py:fn or module:fn, labelled by fn or "
                  "[name=label] (docs/guides/loss-contract.md)",
    "objective_params": 'JSON, e.g. \'{"gspo": {"eps": [0.0003, 0.0004]}}\'',
    "mode": "tandem: each objective trains its own policy; same-batch: the first objective "
            "trains, the others' W and residuals are computed on its batches",
    "task": "'arithmetic', 'scaffold' (long shared preamble, large tax) or a .jsonl file of {prompt, answer}", "model": "local HF model folder",
    "steps": "rollout batches", "prompts": "prompts per rollout batch", "G": "responses per prompt",
    "minibatches": "optimizer steps per rollout batch", "split_groups": "let groups straddle steps",
    "balance_polarity": "give every optimizer step its share of positive- and negative-advantage "
                        "responses (whole groups, or single responses with --split-groups; "
                        "docs/concepts/token-flips.md)",
    "micro_batch": "sequences per forward/backward in an optimizer step (a multiple of G; "
                   "gradient accumulation, same update; default: the whole step)",
    "fsdp": "shard the policy with FSDP2 under torchrun (≥ 2 ranks; sampling and probes "
            "gather the full weights, see docs/guides/real-models.md)",
    "amp": "bf16 autocast for every forward on any device (CPU included); float32 master "
           "weights, AdamW state, log-probs and checkpoints; FSDP2 gathers bf16, reduces fp32",
    "tax_every": "the presets' heavy instruments (tax, attribution, drift at divergent tokens, "
                 "flips) every k rollout steps (0 = never)",
    "eval_every": "held-out evaluation (greedy and sampled at --temperature; keys eval_accuracy, "
                  "eval_accuracy_greedy) every k rollout steps and at the end (0 = off)",
    "eval_size": "held-out problems per evaluation (disjoint from training prompts)",
    "trace_every": "token traces every k rollout steps (0 = none; gradlab.load_traces)",
    "trace_groups": "groups traced per traced rollout step",
    "log": "live logging while training: tensorboard and/or trackio (comma-separated)",
    "max_prompt_len": "longest prompt in tokens (longer: an error naming the prompt)",
    "chat_template": "wrap prompts in the tokenizer's chat template",
    "grad_checkpointing": "recompute activations in backward (model.gradient_checkpointing_enable)",
    "attn": "attention implementation: auto (SDPA where the architecture supports it, else "
            "eager), eager or sdpa",
    "dropout": "keep the model's dropout in training and probe forwards (default: off, so the "
               "training forward is the sampler's and the on-policy ratio is 1)",
    "verifier": "JSONL answers: exact (text after the last '=') or math (math-verify; "
                "pip install gradlab[math])",
    "on_nonfinite": "a non-finite loss, gradient or parameter: stop (exit code 3) or skip the "
                    "update (counted as nonfinite_steps)",
    "threads": "torch intra-op threads (0 = torch's current count); recorded in config.json: "
               "results are bitwise identical at a fixed thread count",
    "rollout": "group layout: independent (G samples), tree (roots re-sampled from chosen "
               "prefixes, KV cache reused) or repair (G samples + a corrected path per incorrect "
               "one); compare layouts at equal generated_tokens (docs/guides/rollouts.md)",
    "roots": "tree: independent starts per group", "branches": "tree: children per path",
    "branch_at": "tree: branch positions drawn by token entropy or uniformly",
    "branch_token": "tree/repair: the branch token is sampled, or an alternative (the "
                    "parent's token excluded; old_logps stay the policy's own log-probs)",
    "repair": "repair: resample the continuation from the departure, splice the reference, or "
              "local (re-sample from the response's last positions first, walking back)",
    "repair_tries": "repair resample/local: tries per incorrect response (first correct one "
                    "kept; local: each from one position earlier)",
    "instruments": "what each step measures: presets off (plain trainer metrics), cheap, "
                   "default, full (default + the token-flip ledger, docs/concepts/token-flips.md); "
                   "instrument names (gradlab instruments) with @k for "
                   "every k-th step; your own as module:Class, e.g. 'cheap,tax@10,my.mod:Spread' "
                   "(docs/guides/own-instrument.md)",
}
