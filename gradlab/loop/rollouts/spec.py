"""What a rollout sampler is asked for (`SamplingSpec`), and the constants of one decoding loop
(`Decoding`: the spec's length and temperature plus the model's stop ids, `stop_ids`, and its
tokenizer's vocabulary size).

One `SamplingSpec` serves the three layouts (`layouts.sample`): the independent sampler reads G,
max_new_tokens, temperature, amp and max_prompt_len; the tree sampler also roots, branches,
branch_at and branch_token; the repair sampler also repair, repair_tries and branch_token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import BRANCH_AT, BRANCH_TOKEN, LAYOUTS, REPAIR_MODES


@dataclass(frozen=True)
class SamplingSpec:
    """How the responses of a rollout are sampled (the `--rollout` family of options).

    G               responses per prompt (a repair layout adds its repairs on top)
    max_new_tokens  response tokens at most per row, the stop id included
    temperature     sampling temperature (> 0; 0 = greedy, independent layout only); the
                    recorded old log-probs are log-softmax(logits / temperature), in nats
    layout          "independent", "tree" or "repair" (docs/guides/rollouts.md)
    roots           tree: independent starts per group (1 ≤ roots ≤ G)
    branches        tree: children per path (≥ 1)
    branch_at       tree: branch positions drawn ∝ token entropy ("entropy") or "uniform"
    branch_token    tree/repair: a branch's first token is sampled ("sample") or may not be the
                    parent's own token ("alternative")
    repair          repair: "resample", "splice" or "local" (loop/rollouts/repair.py)
    repair_tries    repair resample/local: tries per incorrect response (≥ 1)
    amp             bf16 autocast for the sampler's forwards
    max_prompt_len  longest prompt in tokens (longer: a ConfigError naming it); None: no limit
                    beyond the model's context
    """

    G: int
    max_new_tokens: int
    temperature: float = 1.0
    layout: str = "independent"
    roots: int = 2
    branches: int = 2
    branch_at: str = "entropy"
    branch_token: str = "sample"
    repair: str = "resample"
    repair_tries: int = 4
    amp: bool = False
    max_prompt_len: int | None = None

    def __post_init__(self) -> None:
        for name, valid in (("layout", LAYOUTS), ("branch_at", BRANCH_AT),
                            ("branch_token", BRANCH_TOKEN), ("repair", REPAIR_MODES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"SamplingSpec.{name} {getattr(self, name)!r}; valid: {valid}")
        if self.G < 1 or self.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec needs G ≥ 1 and max_new_tokens ≥ 1; got G {self.G}, "
                             f"max_new_tokens {self.max_new_tokens}")

    @classmethod
    def from_config(cls, cfg, task) -> SamplingSpec:
        """The spec of a `RunConfig`'s training rollouts: max_new_tokens is the config's, else
        the task's. max_prompt_len stays unset: the loop's sampler never checked it (prompts
        are checked when a real model's task encodes them)."""
        return cls(G=cfg.G, max_new_tokens=cfg.max_new_tokens or task.max_new_tokens,
                   temperature=cfg.temperature, layout=cfg.rollout, roots=cfg.roots,
                   branches=cfg.branches, branch_at=cfg.branch_at, branch_token=cfg.branch_token,
                   repair=cfg.repair, repair_tries=cfg.repair_tries, amp=cfg.amp)

    @property
    def alternative(self) -> bool:
        """A branch's (or a re-sampled repair's) first token may not be its parent's."""
        return self.branch_token == "alternative"


@dataclass(frozen=True)
class Decoding:
    """The constants of one decoding loop (tree.decode): max_new_tokens (response positions
    T), temperature, the stop ids (`rollout.stop_ids`) and n_vocab (ids < n_vocab may be
    sampled: the tokenizer's length)."""

    max_new_tokens: int
    temperature: float
    stops: tuple[int, ...]
    n_vocab: int

    @classmethod
    def of(cls, spec: SamplingSpec, model, tokenizer) -> Decoding:
        return cls(spec.max_new_tokens, spec.temperature, tuple(stop_ids(model, tokenizer)),
                   len(tokenizer))


def stop_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's
    generation_config.eos_token_id (an int or a list; Qwen3 chat models add <|im_end|>)."""
    ids = [tokenizer.eos_token_id]
    gc = getattr(model, "generation_config", None)
    extra = getattr(gc, "eos_token_id", None) if gc is not None else None
    ids += [extra] if isinstance(extra, int) else list(extra or [])
    return sorted({int(i) for i in ids if i is not None})
