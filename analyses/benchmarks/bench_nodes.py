"""Benchmark: shared_nodes + cancellation, and IBPO's trie advantages, on 64 groups × 8
responses × T tokens (CPU), side by side in one run.

    python -m analyses.benchmarks.bench_nodes          # T = 256, 1024, 4096; prints a markdown table
    python -m analyses.benchmarks.bench_nodes --quick  # small sizes (used by the tests)

Medians over repeats; the time per token column shows whether cost is linear in T.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradlab
from gradlab import objectives


def make_batch(n_groups: int, G: int, T: int, seed: int = 0) -> gradlab.TokenBatch:
    """Groups with a 32-token shared template, then binary branching (deep tries), vectorised."""
    g = torch.Generator().manual_seed(seed)
    B = n_groups * G
    group = torch.arange(n_groups).repeat_interleave(G)
    tokens = torch.randint(0, 2, (B, T), generator=g)
    tokens[:, : min(32, T)] = 7
    tokens += 10 * group.unsqueeze(-1)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    logps = -torch.rand(B, T, generator=g)
    old = logps + 0.1 * torch.randn(B, T, generator=g)
    adv = gradlab.advantages(torch.randint(0, 2, (B,), generator=g).float(), group)
    perm = torch.randperm(B, generator=g)
    return gradlab.TokenBatch(tokens, mask, logps, old, adv, group, validate=False).rows(perm)


def time_once(b: gradlab.TokenBatch, W: torch.Tensor) -> float:
    t0 = time.perf_counter()
    trie = gradlab.shared_nodes(b, "trie")  # the prefix nodes are the trie's full-group nodes
    gradlab.cancellation(W, b, sn=trie)
    gradlab.cancellation(W, b, sn=trie.full_group())
    return time.perf_counter() - t0


def time_advantages(b: gradlab.TokenBatch, R: torch.Tensor) -> float:
    """IBPO's trie advantages (form ga+la) from the same batch: one `prefix_grid`, no loop."""
    t0 = time.perf_counter()
    gradlab.process_advantages(b.tokens, b.mask, b.group, R, "ga+la")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    sizes = [(4, 4, 32), (4, 4, 64)] if args.quick else [(64, 8, 256), (64, 8, 1024), (64, 8, 4096)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| groups × G × T | nodes+cancellation, both kinds (median ms) | µs per 1k tokens "
          "| IBPO trie advantages (median ms) | ratio to nodes+cancellation |")
    print("|---|---|---|---|---|")
    for n, G, T in sizes:
        b = make_batch(n, G, T)
        W = objectives.get("gspo").modulation(b)
        R = torch.randint(0, 2, (b.B,), generator=torch.Generator().manual_seed(1)).float()
        time_once(b, W), time_advantages(b, R)  # warm-up
        ms = statistics.median(time_once(b, W) for _ in range(args.repeats)) * 1e3
        ms_a = statistics.median(time_advantages(b, R) for _ in range(args.repeats)) * 1e3
        print(f"| {n} × {G} × {T} | {ms:.1f} | {ms * 1e3 / (n * G * T / 1e3):.1f} | {ms_a:.1f} "
              f"| {ms_a / ms:.2f} |")


if __name__ == "__main__":
    main()
