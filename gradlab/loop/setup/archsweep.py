"""Every causal-LM architecture transformers can build, tiny, through gradlab's loop.

The list comes from transformers' causal-LM auto mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`),
not from a typed list. `tiny_model(model_type)` builds one from one shared recipe: the
architecture's default configuration with every size field it has made tiny (`TINY`: 2
layers, width 32, 4 heads of 8, 4 experts, a ~100-token vocabulary). `sweep_one` runs what
the loop needs on it: load from a saved folder, the load-time self-check, a training step
with a non-zero gradient, and the W hook against the closed form.

    python -m gradlab.loop.setup.archsweep          # the table of docs/guides/architectures.md
"""

from __future__ import annotations

import contextlib
import io
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
    from ...core import objectives
    from ...core.batch import advantages
    from ...probes import ModulationProbe
    from ..numerics.arch import choose_attn
    from ..numerics.logprobs import token_logps
    from ..rollouts.rollout import generate
    from .policy import build_tokenizer, load_policy
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
            batch = ro.token_batch(lp, advantages(ro.rewards, ro.group))
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


STATUS = {"pass": "runs", "refused": "refused at load", "no-tiny": "not swept"}


def page(rows: list[dict]) -> str:
    """The architectures page (docs/guides/architectures.md) from `sweep_one` rows."""
    import transformers

    n = {k: sum(r["status"] == k for r in rows) for k in ("pass", "refused", "no-tiny", "error")}
    head = PAGE.format(version=transformers.__version__, total=len(rows), **n)
    lines = ["| model type | status | why |", "|---|---|---|"]
    for r in rows:
        why = r.get("reason", "").replace("|", "\\|")
        lines.append(f"| `{r['type']}` | {STATUS.get(r['status'], r['status'])} | {why} |")
    return head + "\n".join(lines) + "\n"


PAGE = """# Architectures

gradlab's loop takes any decoder-only causal LM that transformers builds, or refuses it in one
line before any step. This page lists every model type of transformers' causal-LM auto mapping
(transformers {version}: {total} types) and what happens when a tiny random-weight model of that
type goes through `gradlab tandem --model`: **{pass} run**, **{refused} are refused at load**,
{no-tiny} are not swept (encoder-decoder models, or configurations the shared tiny recipe cannot
make small).

"runs" means, on the tiny model saved as a model folder and loaded as `--model` loads it:
the load-time self-check passes (the sampler's log-probs and the training log-probs, on the
(N, T, V) grid and chunked, equal the model's own forward within 1e-4 nats), a GRPO step has a
non-zero gradient, and W measured by the backward hook equals the closed form. The table is
the outcome of `tests/test_architectures.py`, which runs every row; regenerate the page with
`python -m gradlab.loop.setup.archsweep --page docs/guides/architectures.md`.

## What gradlab does per architecture

- **Logits are the model's own.** The training log-probs come from the model's own output
  computation: the decoder runs once (found with `get_decoder()`, so OPT's
  `model.decoder` and GPT-2's `transformer` are found too), and every chunk of hidden states
  goes back through the model's forward after the decoder, so Cohere's `logit_scale`,
  Granite's `logits_scaling` and Gemma 2's `final_logit_softcapping` are applied by the
  model's code itself.
- **Attention**: PyTorch SDPA where the architecture supports it, eager otherwise (Gemma 2,
  gpt-oss, BLOOM, ...); `--attn eager|sdpa` forces one (`--attn sdpa` on an architecture
  without SDPA support is an error naming it).
- **Dropout is off** in every training and probe forward (every `nn.Dropout` and every
  dropout rate of the modules and the config: `attention_dropout`, `resid_pdrop`, OPT's
  `layerdrop`, ...), as RL trainers do: the training forward is then the same function as the
  sampler's and the on-policy ratio is 1 to float precision. `--dropout` keeps the model's
  rates; the training forward is then a random perturbation of the sampler's: on a tiny
  GPT-2 with its 0.1 rates the on-policy token ratio is off by 2.8 % on average and up to
  25 % (4e-8 and 5e-7 with dropout off), so the clip and the residual measure dropout noise.
- **The load-time self-check** (always on, a few forwards on 2 prompts × 2 responses of up to
  6 tokens): the sampler's log-probs, the training log-probs (grid and chunked) and the
  model's own forward on each unpadded row must agree within 1e-4 nats in float32. Otherwise,
  or when the model's code fails on one of them, the run stops with exit code 2 and one line:

        gradlab tandem: error: --model: mamba (MambaForCausalLM) refused before any step: its
        sampler log-probs differ from the model's own forward by 0.756 nats (> 0.0001); ...

  Recurrent and hybrid models (Mamba, RWKV, Jamba, Qwen3-Next, ...) are refused this way:
  gradlab's sampler carries a KV cache, not their recurrent state. Some encoder families run
  as decoders (RoBERTa, XLM-R, CamemBERT) are refused on their sampler's log-probs.
- **The learning tax's split** (`tax_share/<group>`) reads module types, not parameter names:
  embedding, attention (and other sequence mixers), MLP (and mixture-of-experts blocks), norm,
  LM head; a parameter under no module of a known role is counted in "other"
  (`gradlab.probes.tax.unknown_modules` names their module types).

## Every type of the mapping

"""


if __name__ == "__main__":  # the sweep over the whole mapping, as a markdown table
    import argparse
    import tempfile
    from pathlib import Path

    ap = argparse.ArgumentParser(description="tiny models of every causal-LM type, through gradlab")
    ap.add_argument("types", nargs="*", help="model types (default: the whole mapping)")
    ap.add_argument("--page", help="write the architectures page here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for t in (a.types or causal_lm_types()):
        with tempfile.TemporaryDirectory() as d:
            r = sweep_one(t, d)
        rows.append(r)
        print(f"| `{t}` | {r['status']} | {r.get('reason', '')} | {r['seconds']:.1f} |",
              flush=True)
    if a.page:
        Path(a.page).write_text(page(rows))
