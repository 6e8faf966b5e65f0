"""Benchmark: the instrumented optimizer step of the loop against the bare step.

    python -m analyses.benchmarks.bench_probes            # tiny policy and a ~25M Qwen3, 64×8 × 128
    python -m analyses.benchmarks.bench_probes --quick    # small sizes (used by the tests)

Same batch, same objective (GSPO), same model, measured side by side and interleaved:
  bare   forward → loss → backward → clip → AdamW step (what a trainer does)
  loop   gradlab's own step with --no-probes: bare + the per-token entropy every step logs
         (from the log-softmax's own logits chunk: one dot product per token, no gradient),
         the non-finite guard and the micro-batch bookkeeping
  cheap  + hook-measured W, W deviation from closed form, residuals at prefix and trie nodes,
         entropy, drift at the step's shared nodes (gradlab's every-step tier)
  traced cheap + the token traces of 2 groups written to Parquet (a step the loop traces:
         every `--trace-every` rollout steps; amortised share = (traced − cheap) / trace_every)
  heavy  + parameter-space tax g_tax (one extra backward), mechanism attribution, drift at
         every position (the scheduled tier, `--tax-every`)
Prints medians (s) and the ratios to bare.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import gradlab
from gradlab import objectives
from gradlab.loop.config import RunConfig
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.rollouts.rollout import Rollout
from gradlab.loop.runs.traces import TraceWriter
from gradlab.loop.scale.dist import Dist
from gradlab.loop.setup.policy import build_tokenizer, load_policy, n_params, new_model
from gradlab.loop.train import Learner
from gradlab.loop.update.metrics import StepMetrics
from gradlab.loop.update.step import StepWork, loop_instruments, optimizer_step


def make_rollout(vocab: int, groups: int, G: int, T: int, seed: int = 0) -> Rollout:
    """Right-padded responses: a 16-token shared template, then binary branching (a deep trie)."""
    g = torch.Generator().manual_seed(seed)
    N = groups * G
    group = torch.arange(groups).repeat_interleave(G)
    prompt = torch.randint(3, vocab, (groups, 8), generator=g)[group]
    resp = torch.randint(3, 5, (N, T), generator=g)
    resp[:, :16] = torch.randint(3, vocab, (groups, 16), generator=g)[group]
    lengths = torch.randint(T // 2, T + 1, (N,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    return Rollout(prompt, torch.ones_like(prompt, dtype=torch.bool), resp.masked_fill(~mask, 0),
                   mask, torch.zeros(N, T), group, [""] * N, [None] * N)


def bare_step(L: Learner, ro: Rollout, adv: torch.Tensor) -> None:
    logps = token_logps(L.model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    b = gradlab.TokenBatch(ro.response_ids, ro.response_mask, logps, ro.old_logps, adv, ro.group,
                           validate=False)
    L.objective.loss(b).backward()
    torch.nn.utils.clip_grad_norm_(L.model.parameters(), 1.0)
    L.opt.step()
    L.opt.zero_grad(set_to_none=True)


def step(L: Learner, cfg: RunConfig, ro: Rollout, adv: torch.Tensor, rows: torch.Tensor,
         acc: StepMetrics, heavy: bool) -> None:
    """The loop's optimizer step at rollout step 0 (heavy: every scheduled instrument is due,
    with tax_every = 5) or 1 (the every-step instruments only)."""
    optimizer_step(L, cfg, StepWork(ro, adv, rows, 0 if heavy else 1), acc, loop_instruments(cfg),
                   Dist())


def traced_step(L: Learner, cfg, ro, adv, rows, tracer) -> None:
    """The cheap tier on a traced step: the loop's tracer records and writes 2 groups."""
    L.tracer = tracer
    tracer.begin(L.name, 0)
    step(L, cfg, ro, adv, rows, StepMetrics(), heavy=False)
    tracer.end()
    L.tracer = None


def bench(model, groups: int, G: int, T: int, repeats: int, tok=None) -> dict[str, float]:
    vocab = model.config.vocab_size
    ro = make_rollout(vocab, groups, G, T)
    with torch.no_grad():  # behaviour log-probs a little off the current policy
        ro.old_logps = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                                   ro.response_mask) + 0.05 * torch.randn(ro.response_ids.shape)
    adv = gradlab.advantages(torch.randint(0, 2, (ro.group.numel(),)).float(), ro.group)
    L = Learner("gspo", objectives.get("gspo", eps=(0.2, 0.2)), model,
                torch.optim.AdamW(model.parameters(), lr=1e-6), torch.Generator())
    cfg = RunConfig(progress=False, drift=True)
    off = RunConfig(progress=False, probes=False)
    rows = torch.arange(ro.group.numel())
    tracer = TraceWriter(tempfile.mkdtemp(prefix="bench_traces"), 1, cfg.trace_groups, tok)
    phase: dict[str, list[float]] = {"cheap": [], "heavy": []}

    def probed(heavy: bool) -> None:
        """The instrumented step; keeps its own `time_probes` (s spent in the probes' code:
        readings, drift forwards, tax) — a within-step share, robust to a loaded machine."""
        acc = StepMetrics()
        step(L, cfg, ro, adv, rows, acc, heavy)
        phase["heavy" if heavy else "cheap"].append(acc.times.get("time_probes", 0.0))

    tiers = {
        "bare": lambda: bare_step(L, ro, adv),
        "loop": lambda: step(L, off, ro, adv, rows, StepMetrics(), heavy=False),
        "cheap": lambda: probed(False),
        "traced": lambda: traced_step(L, cfg, ro, adv, rows, tracer),
        "heavy": lambda: probed(True),
    }
    times: dict[str, list[float]] = {k: [] for k in tiers}
    cpu: dict[str, list[float]] = {k: [] for k in tiers}
    for fn in tiers.values():
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in tiers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    # wall medians under the tier names; CPU-time medians (user + sys of this process, what a
    # single-threaded step costs however contended the machine is) under "cpu_<tier>"
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"cpu_{k}": statistics.median(v) for k, v in cpu.items()})
    out.update({f"min_{k}": min(v) for k, v in times.items()})  # least-disturbed repeat
    out.update({f"probes_phase_{k}": statistics.median(v[1:]) for k, v in phase.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--models", default="tiny,25m")
    a = ap.parse_args()
    if a.quick:
        a.groups, a.G, a.T, a.repeats = 4, 4, 32, 2
    tok = build_tokenizer()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {a.groups}×{a.G} "
          f"sequences × {a.T} response tokens; medians of {a.repeats}")
    print("| model | params | bare (s) | loop (s) | cheap (s) | traced (s) | heavy (s) | "
          "loop / bare | cheap / bare | traced / bare | heavy / bare |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        model = load_policy()[0] if name == "tiny" else new_model(tok, name)
        model.train()
        t = bench(model, a.groups, a.G, a.T, a.repeats, tok)
        print(f"| {name} | {n_params(model) / 1e6:.2f} M | {t['bare']:.3f} | {t['loop']:.3f} | "
              f"{t['cheap']:.3f} | {t['traced']:.3f} | {t['heavy']:.3f} | "
              f"{t['loop'] / t['bare']:.2f}× | {t['cheap'] / t['bare']:.2f}× | "
              f"{t['traced'] / t['bare']:.2f}× | {t['heavy'] / t['bare']:.2f}× |")
        c = {k: t[f"cpu_{k}"] for k in ("bare", "loop", "cheap", "traced", "heavy")}
        print(f"|   CPU time | | {c['bare']:.3f} | {c['loop']:.3f} | {c['cheap']:.3f} | "
              f"{c['traced']:.3f} | {c['heavy']:.3f} | {c['loop'] / c['bare']:.2f}× | "
              f"{c['cheap'] / c['bare']:.2f}× | {c['traced'] / c['bare']:.2f}× | "
              f"{c['heavy'] / c['bare']:.2f}× |")
        print(f"  (second row: CPU-time medians of this process, less sensitive to other jobs; "
              f"time_probes (wall, the probes' own code) {t['probes_phase_cheap']:.3f} s of the cheap step, "
              f"{t['probes_phase_heavy']:.3f} s of the heavy one)")


if __name__ == "__main__":
    main()
