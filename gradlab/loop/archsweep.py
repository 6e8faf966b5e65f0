"""Every causal-LM architecture transformers can build, tiny, through gradlab's loop.

The list comes from transformers' causal-LM auto mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`),
not from a typed list. `tiny_model(model_type)` builds one from one shared recipe: the
architecture's default configuration with every size field it has made tiny (`TINY`: 2
layers, width 32, 4 heads of 8, 4 experts, a ~100-token vocabulary). `sweep_one` runs what
the loop needs on it: load from a saved folder, the load-time self-check, a training step
with a non-zero gradient, and the W hook against the closed form.

    python -m gradlab.loop.archsweep          # the table of docs/guides/architectures.md
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
import warnings

import torch

MAX_PARAMS = 2_000_000  # "tiny": a recipe that leaves more than this does not build tiny
TINY = {
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "dim": 32, "hidden_dim": 32,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "ffn_hidden_size": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
    "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4, "v_head_dim": 8, "rotary_dim": 4, "word_embed_proj_dim": 32,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "sliding_window": 64,
    "state_size": 4, "time_step_rank": 4, "mamba_d_state": 4, "mamba_n_heads": 4,
    "mamba_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "global_attn_every_n_layers": 2,
    "attention_dropout": 0.0, "tie_word_embeddings": True,
    # final-logit transforms made far from the identity, so a path that skipped one would show
    "logit_scale": 0.25, "logits_scaling": 4.0, "final_logit_softcapping": 3.0,
}


def causal_lm_types() -> list[str]:
    """Every model type of transformers' causal-LM auto mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, vocab: int):
    """The architecture's default config with `TINY` applied to every field it has; token
    ids 0 (pad), 1 (eos). Fields the constructor rejects are dropped one by one."""
    from transformers import AutoConfig

    cls = type(AutoConfig.for_model(model_type))
    base = cls()
    kw = {k: v for k, v in TINY.items() if k in base.to_dict() or hasattr(base, k)}
    kw.update(vocab_size=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if "kv_lora_rank" in kw:  # multi-head latent attention: as many KV heads as heads, and
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)  # rotary on the rope dims
        kw["head_dim"] = kw.get("qk_rope_head_dim", 4)
    if getattr(base, "is_encoder_decoder", False):
        raise ValueError("encoder-decoder (not a decoder-only LM)")
    kw["is_decoder"] = True  # encoder families (BERT, RoBERTa, ...) as causal LMs
    for _ in range(len(kw)):
        try:
            return cls(**kw)
        except Exception as e:  # a field this config computes itself: drop it, retry
            bad = [k for k in kw if k in str(e) and k not in ("vocab_size",)]
            if not bad:
                raise
            kw.pop(bad[0])
    return cls(**kw)


def tiny_model(model_type: str, vocab: int, seed: int = 0):
    """A randomly initialised tiny causal LM of `model_type` (eval mode, float32); ValueError
    with the reason when the shared recipe cannot make it tiny."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, vocab)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the shared tiny recipe leaves {n / 1e6:.1f}M parameters")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def sweep_one(model_type: str, folder) -> dict:
    """Build `model_type` tiny, save it to `folder`, then through gradlab: load (attention per
    architecture), self-check, one GRPO step's gradient, and W from the hook vs the closed
    form. Returns {status: pass | refused | no-tiny | error, reason, gaps, grad_norm, w_gap,
    seconds}."""
    from ..core import objectives
    from ..core.batch import TokenBatch, advantages
    from ..probes import ModulationProbe
    from .arch import choose_attn
    from .logprobs import token_logps
    from .policy import build_tokenizer, load_policy
    from .rollout import generate
    from .selfcheck import ModelRefused, self_check
    from .task import ArithmeticTask

    t0, out = time.time(), {"type": model_type}
    tok = build_tokenizer()
    try:
        with _quiet():
            model = tiny_model(model_type, len(tok))
            choose_attn(model.config)  # the mapping knows it
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - the reason is the row of the table
        return {**out, "status": "no-tiny", "reason": _line(e), "seconds": time.time() - t0}
    try:
        with _quiet():
            model, tok = load_policy(folder)
            task = ArithmeticTask()
            out["gaps"] = self_check(model, tok, task)
            ro = generate(model, tok, task.problems(2, seed=1), G=4, max_new_tokens=6,
                          row_keys=torch.arange(8), task=task)
            ro.rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 0, 0])  # mixed groups: W ≠ 0
            model.train()
            lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                             ro.response_mask)
            batch = TokenBatch(tokens=ro.response_ids, mask=ro.response_mask, logps=lp,
                               old_logps=ro.old_logps, group=ro.group, rewards=ro.rewards,
                               advantages=advantages(ro.rewards, ro.group))
            obj = objectives.get("grpo")
            with ModulationProbe() as probe:
                probe.watch(lp)
                obj.loss(batch).backward()
                w_gap = float(probe.deviation(obj, batch))
            grad = sum(float(p.grad.norm() ** 2) for p in model.parameters()
                       if p.grad is not None) ** 0.5
        out.update(grad_norm=grad, w_gap=w_gap)
        ok = grad > 0 and w_gap < 1e-6
        out.update(status="pass" if ok else "error",
                   reason="" if ok else f"gradient norm {grad:.3g}, W gap {w_gap:.3g}")
    except ModelRefused as e:
        out.update(status="refused", reason=str(e).split("refused before any step: ")[-1])
    except Exception as e:  # noqa: BLE001
        out.update(status="error", reason=_line(e))
    out["seconds"] = time.time() - t0
    return out


def _line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:160]}"


@contextlib.contextmanager
def _quiet():
    """Silence transformers' warnings and prints while a tiny model is built and run."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


if __name__ == "__main__":  # the sweep over the whole mapping, as a markdown table
    import tempfile

    torch.set_num_threads(1)
    rows = []
    for t in (sys.argv[1:] or causal_lm_types()):
        with tempfile.TemporaryDirectory() as d:
            r = sweep_one(t, d)
        rows.append(r)
        print(f"| `{t}` | {r['status']} | {r.get('reason', '')} | {r['seconds']:.1f} |",
              flush=True)
