"""Per-architecture load settings: the attention implementation and dropout.

`choose_attn` picks PyTorch SDPA where the architecture supports it and eager attention
otherwise (`--attn` forces one); `set_dropout` turns every dropout of a loaded model off (or
back on), whatever its architecture calls it. The load-time check that the loop's log-probs
are the model's own is loop/setup/selfcheck.py.
"""

from __future__ import annotations

import torch

ATTN = ("auto", "eager", "sdpa")  # --attn: auto = SDPA where the architecture supports it


def choose_attn(config, attn: str = "auto") -> str | None:
    """The attention implementation to load a model of `config` with: `attn` itself when
    forced; "auto": "sdpa" when the architecture supports PyTorch SDPA, else "eager" (Gemma 2,
    gpt-oss, BLOOM; recurrent models such as Mamba have no attention and take "eager").
    ValueError naming the architecture when SDPA is forced where it is not supported. None:
    a configuration outside transformers' causal-LM mapping (remote code) under "auto", which
    leaves the choice to transformers."""
    if attn not in ATTN:
        raise ValueError(f"--attn: unknown {attn!r}; valid: {', '.join(ATTN)}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # remote code or an unmapped config: let transformers decide for "auto"
        return None if attn == "auto" else attn
    sdpa = bool(getattr(cls, "_supports_sdpa", False))
    if attn == "sdpa" and not sdpa:
        raise ValueError(f"--attn sdpa: {config.model_type} does not support SDPA attention "
                         "(use --attn eager or auto)")
    return attn if attn != "auto" else ("sdpa" if sdpa else "eager")


_DROP_KEYS = ("dropout", "pdrop", "layerdrop")  # attention_dropout, resid_pdrop, OPT's layerdrop


def _is_rate(name: str, value) -> bool:
    return (any(k in name for k in _DROP_KEYS) and isinstance(value, (int, float))
            and not isinstance(value, bool))


def set_dropout(model: torch.nn.Module, keep: bool = False) -> int:
    """Dropout off (keep=False: every nn.Dropout's p, every dropout-rate attribute of a module
    or of the config — attention_dropout, resid_pdrop, OPT's layerdrop, ... — set to 0) or
    back to the model's own rates (keep=True). Returns how many rates are non-zero now.

    RL trainers turn dropout off: with it the training forward is a different random function
    from the sampler's, so the on-policy ratio is not 1 (GPT-2's 0.1 moves it by ~0.6 %).
    The original rates are kept on the model, so the call is reversible.
    """
    saved = model.__dict__.setdefault("_gradlab_dropout", {})
    configs = [c for c in {id(c): c for c in _configs(model)}.values()]
    targets = [(f"m{id(m)}", m) for m in model.modules()] + [(f"c{id(c)}", c) for c in configs]
    live = 0
    for key, obj in targets:
        names = ["p"] if isinstance(obj, torch.nn.Dropout) else [
            n for n, v in vars(obj).items() if _is_rate(n, v)]
        for n in names:
            orig = saved.setdefault((key, n), getattr(obj, n))
            setattr(obj, n, orig if keep else type(orig)(0))
            live += bool(getattr(obj, n))
    return live


def _configs(model: torch.nn.Module) -> list:
    """The model's config objects (a multimodal config's text config included)."""
    out = []
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "to_dict"):
            out.append(c)
            sub = getattr(c, "get_text_config", None)
            if callable(sub):
                out.append(sub())
    return out
