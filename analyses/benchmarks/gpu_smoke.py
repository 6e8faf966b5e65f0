"""The GPU recipe's helper (analyses/benchmarks/gpu_smoke.sh): a Qwen3-0.6B-shaped random-init model
folder built from a config (no download), and one tandem run with its step time, peak GPU
memory and probe overhead printed.

    python -m analyses.benchmarks.gpu_smoke build DIR          # Qwen3-0.6B shape, fp32 weights, V=151,936
    python -m analyses.benchmarks.gpu_smoke build DIR --small  # a CPU-sized shape (tests, dry runs)
    python -m analyses.benchmarks.gpu_smoke run DIR OUT [gradlab tandem options...]

The tokenizer is the shipped default policy's (a small character-level one): its ids are all
< 151,936, so the arithmetic task's prompts encode; the embedding rows beyond it are what a
real Qwen folder has too (151,669 tokenizer ids vs 151,936 rows).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from gradlab import jsonio

# Qwen/Qwen3-0.6B's config.json (architecture fields only)
QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40_960, rope_theta=1_000_000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
SMALL = dict(QWEN3_06B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def build(out: str | Path, small: bool = False, seed: int = 0) -> Path:
    """Save a random-init Qwen3ForCausalLM (fp32) + the default policy's tokenizer to `out`."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from gradlab.loop.setup.policy import DEFAULT_POLICY_DIR

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(DEFAULT_POLICY_DIR)
    cfg = Qwen3Config(**(SMALL if small else QWEN3_06B), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(cfg)
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run(model_dir: str, out: str, extra: list[str]) -> dict:
    """One `gradlab tandem` in this process; prints and returns the summary figures."""
    from gradlab.cli.main import build_parser, config_from_args
    from gradlab.loop.runs.store import load_run
    from gradlab.loop.train import train

    a = build_parser().parse_args(["tandem", "--model", model_dir, "--out", out, *extra])
    cfg = config_from_args(a)
    cuda = cfg.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    df = load_run(out, wide=True)
    upd, prb, ro = (float(df[f"time_{k}"].sum()) for k in ("update", "probes", "rollout"))
    summary = {
        "wall_s": wall, "rollout_steps": int(len(df)),
        "step_time_s": float(df["time_step"].mean()),  # one rollout step of one objective
        "rollout_s": ro, "update_s": upd, "probes_s": prb,
        "probe_overhead": (upd + prb) / upd if upd > 0 else float("nan"),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    print(jsonio.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "build":
        print(build(argv[1], small="--small" in argv[2:]))
        return 0
    if len(argv) >= 3 and argv[0] == "run":
        run(argv[1], argv[2], argv[3:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
