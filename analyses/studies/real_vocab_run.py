"""gradlab's own tandem on a real-vocabulary model, end to end through the CLI.

Builds locally (no download) a random-init Qwen3 folder with the real 151,936-row embedding
and a 151,669-id tokenizer (Qwen's real gap: the embedding is longer than the tokenizer, the
extra ids must never be sampled), then runs

    python -m gradlab.cli tandem --model <folder> --prompts 16 --G 8 --max-new-tokens 64 \\
        --micro-batch 16 --steps 2 --objectives gspo,dfpo-min

in a child process and reports its peak RSS (getrusage RUSAGE_CHILDREN, ru_maxrss) and wall
time, plus the run's own per-phase times (metrics.jsonl, time_* keys, summed over steps).

    python -m analyses.studies.real_vocab_run                 # the run above (hidden 256, 4 layers)
    python -m analyses.studies.real_vocab_run --hidden 64 --layers 2 --prompts 4 --max-new-tokens 16

The tokenizer is gradlab's toy character WordLevel vocabulary (so the arithmetic task encodes)
padded with synthetic tokens "<|s{i}|>" to 151,669 ids; a random-init model samples them freely
(responses are gibberish: this measures time and memory, not learning).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradlab import jsonio

ROOT = Path(__file__).resolve().parents[2]

VOCAB = 151_936  # Qwen3's embedding rows
TOKENIZER_IDS = 151_669  # Qwen3's tokenizer length


def real_vocab_tokenizer(n_ids: int = TOKENIZER_IDS):
    """The toy character tokenizer (gradlab.loop.setup.policy.build_tokenizer: <pad>, <eos>, <unk>,
    one id per character) padded with synthetic word tokens to `n_ids` ids; left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gradlab.loop.setup.policy import CHARS, SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + sorted(set(CHARS)))}
    for i in range(n_ids - len(vocab)):
        vocab[f"<|s{i}|>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char, one id
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>", padding_side="left")
    assert len(out) == n_ids, len(out)
    return out


def build_folder(folder: Path, hidden: int = 256, layers: int = 4, seed: int = 0) -> dict:
    """Save a random-init fp32 Qwen3ForCausalLM (V = 151,936, tied embeddings, SDPA) and the
    151,669-id tokenizer to `folder`; returns {"params": …, "vocab": …, "tokenizer_ids": …}."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = real_vocab_tokenizer()
    torch.manual_seed(seed)
    heads = max(2, hidden // 64)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                      tie_word_embeddings=True, max_position_embeddings=4096,
                      bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"params": sum(p.numel() for p in model.parameters()), "vocab": VOCAB,
            "tokenizer_ids": len(tok)}


def run_cli(folder: Path, out: Path, a: argparse.Namespace) -> dict:
    """The tandem CLI in a child process; its wall time (s), peak RSS (MiB) and return code."""
    cmd = [sys.executable, "-m", "gradlab.cli", "tandem", "--model", str(folder),
           "--out", str(out), "--prompts", str(a.prompts), "--G", str(a.G),
           "--max-new-tokens", str(a.max_new_tokens), "--micro-batch", str(a.micro_batch),
           "--steps", str(a.steps), "--objectives", a.objectives, "--no-progress"] + a.extra
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux: KiB -> MiB
    return {"cmd": " ".join(cmd[1:]), "rc": proc.returncode, "wall_s": wall, "peak_rss_mib": peak}


def phase_times(out: Path) -> dict:
    """time_* keys of the run's metrics.jsonl, summed over steps and objectives (s)."""
    tot: dict = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for k, v in json.loads(line).items():
            if k.startswith("time_") and isinstance(v, (int, float)):
                tot[k] = tot.get(k, 0.0) + v
    return tot


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--objectives", default="gspo,dfpo-min")
    p.add_argument("--keep", default=None, help="build the model folder here and keep it")
    p.add_argument("extra", nargs="*", help="more tandem options, after --")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.keep) if a.keep else Path(tmp) / "qwen3-real-vocab"
        info = build_folder(folder, a.hidden, a.layers)
        info.update(hidden=a.hidden, layers=a.layers)
        print(f"model folder {folder}: {info}", file=sys.stderr, flush=True)
        res = run_cli(folder, Path(tmp) / "run", a)
        if res["rc"] == 0:
            res["phases_s"] = {k: round(v, 1) for k, v in phase_times(Path(tmp) / "run").items()}
    res["model"] = info
    print(jsonio.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["rc"] == 0 else 1)
