"""Tokenizer, tiny Qwen3 policies, supervised warm start, save/load and evaluation.

The default policy (`load_policy()`) is a tiny Qwen3 warm-started on `ArithmeticTask(2)` until
its temperature-1 accuracy lies in the 20-60 % band, shipped in `gradlab/data/default_policy/`.
Regenerate it with:  python -m gradlab.policy  (calls `make_default_policy`).
"""

from __future__ import annotations

import json
import os
import string
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from gradlab.rollout import generate
from gradlab.task import ArithmeticTask

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_POLICY_DIR = DATA_DIR / "default_policy"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# Printable ASCII without the exotic whitespace: covers the arithmetic task and most JSONL tasks.
CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
ACCURACY_BAND = (0.2, 0.6)  # warm-start target: accuracy at temperature 1.0


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """Char-level WordLevel tokenizer: ids 0..2 = <pad>, <eos>, <unk>, then one id per char.

    Left padding (generation appends on the right). Unknown chars map to <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + sorted(set(chars)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char = one token
    tok.decoder = decoders.Fuse()  # join chars back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )


# ----------------------------------------------------------------------------- model

_SIZES = {
    # ~0.1M parameters with the default vocab: fast CPU default.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128),
    # ~25M parameters: for speed benchmarks.
    "25m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, intermediate_size=1536),
}


def tiny_config(vocab_size: int, size: str = "tiny") -> Qwen3Config:
    """Qwen3 config of a given size ("tiny" or "25m"); eager attention (exact under left padding)."""
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; valid values: {', '.join(_SIZES)}")
    cfg = Qwen3Config(
        vocab_size=vocab_size, max_position_embeddings=256, tie_word_embeddings=True,
        attention_dropout=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        **_SIZES[size],
    )
    cfg._attn_implementation = "eager"
    return cfg


def new_model(tokenizer, size: str = "tiny", seed: int = 0) -> Qwen3ForCausalLM:
    """A freshly initialised Qwen3ForCausalLM; init is seeded without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(tiny_config(len(tokenizer), size))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
