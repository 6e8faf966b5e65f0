"""Run options for real checkpoints: chat template, prompt-length limit, gradient
checkpointing, math verifier. `prepare_run(cfg, model, tok, task)` applies them once, right
after `load_policy`, and returns the task the loop should draw prompts from.

What gradlab does with a real model folder (docs/guides/real-models.md):
- weights load as float32 master weights (bf16 folders included); `--amp` autocasts the
  forward passes to bf16 (any device, loop/numerics/precision.py), so AdamW updates fp32 weights;
- attention is PyTorch SDPA where the architecture supports it, eager otherwise (`--attn`
  forces one, loop/numerics/arch.py); the KV cache and left padding are gradlab's own (rollout.py);
- dropout is off in every training and probe forward unless `--dropout`;
- before any step, the sampler's and the training forward's log-probs must equal the model's
  own forward within 1e-4 nats, or the model is refused in one line (loop/setup/selfcheck.py);
- sampling is at `--temperature` over the full tokenizer vocabulary: the model's
  generation_config top-k / top-p / temperature are ignored (old_logps must be the model's own
  log-probs); every generation_config.eos_token_id ends a response.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ConfigError
from ..rollouts.rollout import check_prompt_lengths


class PromptTask:
    """A task whose prompts go through the tokenizer's chat template (when asked) and are
    checked against the prompt-length limits before any model call. Everything else (rewards,
    solutions, keys) is the wrapped task's."""

    def __init__(self, task, tokenizer, chat_template: bool, max_prompt_len: int | None,
                 max_positions: int | None, max_new_tokens: int):
        self.task, self.tokenizer, self.chat_template = task, tokenizer, chat_template
        self.limits = (max_prompt_len, max_positions, max_new_tokens)

    def __getattr__(self, name):  # reward, is_correct, solutions, key, max_new_tokens, ...
        return getattr(self.task, name)

    def format(self, prompt: str) -> str:
        """The text the model sees for a user prompt."""
        if not self.chat_template:
            return prompt
        msgs = [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def problems(self, n: int, seed: int) -> list:
        out = [replace(p, prompt=self.format(p.prompt)) for p in self.task.problems(n, seed)]
        self.check(out)
        return out

    def check(self, problems: list) -> None:
        """ConfigError naming the first over-long prompt (its index in `problems`, its start)."""
        texts = [p.prompt for p in problems]
        enc = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        try:
            check_prompt_lengths([len(e) for e in enc], *self.limits, prompts=texts)
        except ValueError as e:  # a bad option/input: the CLI's one-line error, exit code 2
            raise ConfigError(str(e)) from None


def format_problems(task, problems: list) -> list:
    """`problems` as `task` shows them to the model (chat template applied when `task` is a
    `PromptTask`; unchanged otherwise)."""
    if not isinstance(task, PromptTask):
        return problems
    return [replace(p, prompt=task.format(p.prompt)) for p in problems]


def prepare_run(cfg, model, tokenizer, task):
    """Apply cfg's real-model options to a loaded (model, tokenizer, task); returns the task to
    use (a `PromptTask` when a chat template or a prompt limit is in play, else `task`).

    Checks every prompt of a JSONL task up front (the error names its 0-based line index among
    the file's problems), so an over-long prompt fails before the first rollout. Then applies
    `--attn` and `--dropout` and runs the load-time self-check (`ModelRefused`, a ConfigError,
    when the model's log-probs cannot be reproduced).
    """
    _apply_arch_options(cfg, model)
    if getattr(cfg, "verifier", "exact") != "exact":
        from .task import set_verifier
        try:
            set_verifier(getattr(task, "task", task), cfg.verifier)  # through TrainSplit
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if getattr(cfg, "grad_checkpointing", False):
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"--grad-checkpointing: {type(model).__name__} does not support it")
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    chat = bool(getattr(cfg, "chat_template", False))
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--chat-template: the tokenizer has no chat template "
                          "(use --no-chat-template)")
    max_new = cfg.max_new_tokens or task.max_new_tokens
    limit = getattr(cfg, "max_prompt_len", None)
    wrapped = PromptTask(task, tokenizer, chat, limit,
                         getattr(model.config, "max_position_embeddings", None), max_new)
    items = getattr(task, "_items", None)
    if items is not None:  # a JSONL task: all its prompts, before any allocation
        wrapped.check([replace(p, prompt=wrapped.format(p.prompt)) for p in items])
    out = wrapped if (chat or limit is not None) else task
    from .selfcheck import self_check

    self_check(model, tokenizer, out, cfg.temperature, keep_dropout=cfg.dropout)
    return out


def _apply_arch_options(cfg, model) -> None:
    """--attn (when forced: the loaded model switches implementation) and --dropout."""
    from ..numerics.arch import choose_attn, set_dropout

    attn = getattr(cfg, "attn", "auto")
    if attn != "auto":
        try:
            impl = choose_attn(model.config, attn)
            model.set_attn_implementation(impl)
        except (ValueError, ImportError) as e:
            msg = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(msg if msg.startswith("--attn") else f"--attn {attn}: {msg}") \
                from None
    set_dropout(model, keep=bool(getattr(cfg, "dropout", False)))
