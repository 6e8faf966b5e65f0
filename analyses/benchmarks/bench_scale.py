"""Benchmarks of the real-scale loop, on a random-init Qwen3 with the real
151,936-token vocabulary built from a config (no download).

    python -m analyses.benchmarks.bench_scale memory                       # 64 and 512 seqs × 256 tokens
    python -m analyses.benchmarks.bench_scale memory --sizes 16,64 --tokens 32 --micro-batch 16  # quick

Sections: MEMORY (below) — peak RSS and time of one optimizer step at a fixed micro-batch as
the step's number of sequences grows (target: 64 → 512 sequences ≤ 1.15× peak RSS).
SAMPLING — ms per generated token of gradlab's rollout against `model.generate(do_sample=True)`
on the same real-vocabulary model (target ≤ 1.3×). PROBES — the loop's optimizer step under each
instrument preset (off, cheap, default, full) over the bare optimizer step at the real
vocabulary (target: cheap ≤ 1.05×, CPU-time medians).

    python -m analyses.benchmarks.bench_scale sampling --hidden 256 --layers 4 --prompts 4 --tokens 64
    python -m analyses.benchmarks.bench_scale probes --hidden 256 --layers 4 --prompts 2 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from gradlab import jsonio

VOCAB = 151_936


def tiny_qwen3(vocab: int = VOCAB, hidden: int = 64, layers: int = 2, seed: int = 0):
    """A random-init Qwen3ForCausalLM, fp32, tied embeddings (as Qwen3-0.6B), eval-free."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=hidden // 2, tie_word_embeddings=True, max_position_embeddings=4096)
    return Qwen3ForCausalLM(cfg).train()


def fake_rollout(n: int, tokens: int, G: int, *, prompt_len: int = 16, vocab: int = VOCAB,
                 shared: int = 4, seed: int = 0):
    """A Rollout of n rows (n/G groups) without sampling: random prompts and responses, the
    first `shared` response tokens equal within each group (full-group nodes for the probes),
    lengths in [tokens/2, tokens], old log-probs ≈ a uniform policy's, rewards 0/1."""
    from gradlab.loop.rollouts.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    groups = n // G
    prompt = torch.randint(0, vocab, (groups, prompt_len), generator=g).repeat_interleave(G, 0)
    resp = torch.randint(0, vocab, (n, tokens), generator=g)
    resp[:, :shared] = resp[::G, :shared].repeat_interleave(G, 0)
    lengths = torch.randint(tokens // 2, tokens + 1, (n,), generator=g)
    mask = torch.arange(tokens) < lengths[:, None]
    old = (-torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(n, tokens, generator=g))
    ro = Rollout(prompt, torch.ones_like(prompt, dtype=torch.bool), resp.masked_fill(~mask, 0),
                 mask, old * mask, torch.arange(groups).repeat_interleave(G), [""] * n, [None] * n)
    ro.rewards = torch.randint(0, 2, (n,), generator=g).float()
    return ro


# ======================================================================================== #
# MEMORY: one optimizer step, peak RSS (each size in its own child process)
# ======================================================================================== #

def memory_child(n: int, tokens: int, *, micro_batch: int, G: int, hidden: int, layers: int,
                 instruments: str, objective: str) -> dict:
    """One optimizer step of `objective` on n rows × `tokens` in this process; returns the peak
    RSS (MiB) after setup and after the step, and the step's wall time (s)."""
    from gradlab.core import objectives
    from gradlab.core.batch import advantages
    from gradlab.loop.config import RunConfig
    from gradlab.loop.scale.dist import Dist
    from gradlab.loop.train import Learner
    from gradlab.loop.update.metrics import StepMetrics
    from gradlab.loop.update.step import StepWork, optimizer_step
    from gradlab.loop.update.view import loop_instruments

    model = tiny_qwen3(hidden=hidden, layers=layers)
    ro = fake_rollout(n, tokens, G)
    adv = advantages(ro.rewards, ro.group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    L = Learner(objective, objectives.get(objective), model, opt, torch.Generator())
    cfg = RunConfig(G=G, prompts=n // G, minibatches=1, micro_batch=micro_batch,
                    instruments=instruments, progress=False,
                    max_new_tokens=tokens)
    rows = torch.arange(n)
    setup = _peak_mib()
    t0 = time.perf_counter()
    optimizer_step(L, cfg, StepWork(ro, adv, rows, 1), StepMetrics(), loop_instruments(cfg),
                   Dist())  # rollout step 1: the every-step instruments, no tax
    return {"n": n, "tokens": tokens, "micro_batch": micro_batch, "instruments": instruments,
            "time_s": time.perf_counter() - t0, "peak_setup_mib": setup, "peak_mib": _peak_mib()}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def memory_table(a: argparse.Namespace) -> list[dict]:
    """Run each size in a fresh child (peak RSS is per process); print a Markdown table."""
    rows = []
    for n in (int(s) for s in a.sizes.split(",")):
        cmd = [sys.executable, "-m", "analyses.benchmarks.bench_scale", "_memory_child",
               "--n", str(n), "--tokens", str(a.tokens), "--micro-batch", str(a.micro_batch), "--G", str(a.G),
               "--hidden", str(a.hidden), "--layers", str(a.layers), "--objective", a.objective]
        cmd += ["--instruments", a.instruments]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  n={n}: {rows[-1]}", file=sys.stderr, flush=True)
    base = rows[0]
    print(f"\nOne optimizer step ({a.objective}, instruments {a.instruments}), random-init "
          f"Qwen3 V={VOCAB}, hidden {a.hidden}, {a.layers} layers, {a.tokens} tokens/row, "
          f"--micro-batch {a.micro_batch}, G={a.G}\n")
    print("| sequences | peak RSS (MiB) | ratio | after setup (MiB) | step time (s) | time ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']} | {r['peak_mib']:.0f} | {r['peak_mib'] / base['peak_mib']:.2f}× | "
              f"{r['peak_setup_mib']:.0f} | {r['time_s']:.1f} | {r['time_s'] / base['time_s']:.2f}× |")
    return rows


# ======================================================================================== #
# SAMPLING: gradlab's rollout against transformers' generate(do_sample=True), same model
# ======================================================================================== #

def real_vocab_model(hidden: int, layers: int):
    """(model, tokenizer): the random-init real-vocabulary Qwen3 of
    analyses/studies/real_vocab_run.py (V = 151,936 embedding rows, 151,669 tokenizer ids), loaded as the loop loads a folder."""
    import tempfile

    from analyses.studies.real_vocab_run import build_folder
    from gradlab.loop.setup.policy import load_policy

    with tempfile.TemporaryDirectory() as tmp:
        build_folder(Path(tmp), hidden, layers)
        return load_policy(tmp)


def sampling_table(a: argparse.Namespace) -> dict:
    """Median wall time per generated position (ms; one position = one token for each of the
    N = prompts × G rows) of gradlab.loop.rollouts.rollout.generate (keyed O(1) noise, as the loop
    samples) and of model.generate(do_sample=True, top_k=0, top_p=1, temperature=1: the same
    distribution), interleaved, KV cache in both; both run the full --tokens (EOS masked out)."""
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.task import ArithmeticTask

    model, tok = real_vocab_model(a.hidden, a.layers)
    problems = ArithmeticTask().problems(a.prompts, seed=0)
    N = a.prompts * a.G
    keys = torch.arange(N)
    enc = tok([p.prompt for p in problems for _ in range(a.G)], padding=True, return_tensors="pt",
              add_special_tokens=False)
    # a random model would almost never emit EOS (1 in 151,669), but make both run full length
    bad = [[tok.eos_token_id]]

    def ours() -> int:
        ro = generate(model, tok, problems, a.G, a.tokens, 1.0, row_keys=keys)
        return ro.response_ids.shape[1]

    def theirs() -> int:
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, max_new_tokens=a.tokens,
                                 min_new_tokens=a.tokens, top_k=0, top_p=1.0, temperature=1.0,
                                 pad_token_id=tok.pad_token_id, bad_words_ids=bad)
        return out.shape[1] - enc["input_ids"].shape[1]

    times: dict[str, list[float]] = {"gradlab": [], "generate": []}
    fns = {"gradlab": ours, "generate": theirs}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(a.repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            n = fn()
            times[k].append(1e3 * (time.perf_counter() - t0) / n)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"\nSampling, random-init Qwen3 V={VOCAB} (tokenizer 151,669 ids), hidden {a.hidden}, "
          f"{a.layers} layers, {N} rows ({a.prompts} prompts × G={a.G}) × {a.tokens} tokens, "
          f"medians of {a.repeats}, 1 thread\n")
    print("| sampler | ms / position | ms / token (per row) | ratio to generate |")
    print("|---|---:|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} | {v / N:.2f} | {v / med['generate']:.2f}× |")
    return med


# ======================================================================================== #
# PROBES: each instrument preset / bare at the real vocabulary (analyses/benchmarks/bench_probes.py)
# ======================================================================================== #

def probes_table(a: argparse.Namespace) -> dict:
    """bench_probes.bench on the real-vocabulary model: the bare optimizer step and the loop's
    step under each instrument preset (`RunConfig(instruments=preset)`: off, cheap, default,
    full), on one fake batch of prompts × G rows × --tokens tokens, interleaved; a Markdown
    table of the medians and their ratios to bare."""
    from analyses.benchmarks.bench_probes import TIERS, bench, table
    from gradlab.loop.setup.policy import n_params

    model, tok = real_vocab_model(a.hidden, a.layers)
    model.train()
    names = [n for n, _, _ in TIERS]
    if bad := sorted(set(a.tiers.split(",")) - set(names)):
        raise SystemExit(f"bench_scale probes: --tiers {','.join(bad)} unknown; known: {','.join(names)}")
    tiers = tuple(x for x in TIERS if x[0] in a.tiers.split(","))
    t = bench(model, a.prompts, a.G, a.tokens, repeats=a.repeats, tok=tok, tiers=tiers)
    print(f"\nInstrument presets against the bare optimizer step, random-init Qwen3 V={VOCAB}, "
          f"{n_params(model) / 1e6:.1f} M parameters (hidden {a.hidden}, {a.layers} layers), "
          f"{a.prompts}×{a.G} sequences × {a.tokens} tokens, GSPO, medians of {a.repeats}, "
          "interleaved; CPU time = user + sys of the (single-threaded) process\n")
    print(table(t, tiers))
    print(f"\nall medians (s): {jsonio.dumps({k: round(v, 4) for k, v in t.items()})}")
    return t


def _tiers():
    from analyses.benchmarks.bench_probes import TIERS

    return TIERS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["memory", "sampling", "probes", "_memory_child"])
    p.add_argument("--sizes", default="64,512", help="sequences per optimizer step")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--objective", default="gspo")
    p.add_argument("--instruments", default="default", help="memory: the instrument preset or spec")
    p.add_argument("--prompts", type=int, default=4, help="sampling/probes: prompts (groups)")
    p.add_argument("--repeats", type=int, default=3, help="sampling/probes: timed repeats")
    p.add_argument("--tiers", default=",".join(n for n, _, _ in _tiers()),
                   help="probes: which tiers beside bare (default: all)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.what == "_memory_child":
        print(jsonio.dumps(memory_child(a.n, a.tokens, micro_batch=a.micro_batch, G=a.G,
                                        hidden=a.hidden, layers=a.layers,
                                        instruments=a.instruments, objective=a.objective)))
        return 0
    {"memory": memory_table, "sampling": sampling_table, "probes": probes_table}[a.what](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
