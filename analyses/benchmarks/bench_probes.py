"""Benchmark: the instrumented optimizer step of the loop against the bare step.

    python -m analyses.benchmarks.bench_probes            # tiny policy and a ~25M Qwen3, 64×8 × 128
    python -m analyses.benchmarks.bench_probes --quick    # small sizes (used by the tests)

Same batch, same objective (GSPO), same model, measured side by side and interleaved:
  bare     forward → loss → backward → clip → AdamW step (what a trainer does, no gradlab code)
  off      gradlab's own step, `RunConfig(instruments="off")`: bare + the per-token entropy
           every step logs, the non-finite guard, the micro-batch bookkeeping, and the step's
           metrics reduced to floats (`StepMetrics.finish`, as a rollout step of one optimizer step)
  cheap    `instruments="cheap"`: + hook-measured W, its deviation from the closed form, residuals
           at the full-group and trie nodes (every step)
  default  `instruments="default"`: cheap + drift at the step's nodes (every step); at a step
           where its every-5th instruments are due (`default@5`) + the learning tax (one extra
           backward), mechanism attribution and drift at divergent tokens
  full     default + the token-flip ledger (every 5th step: `full@5`)
Prints medians (s) and the ratios to bare, CPU time and wall.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradlab
from gradlab import objectives
from gradlab.instruments import PRESETS
from gradlab.loop.config import RunConfig
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.rollouts.rollout import Rollout
from gradlab.loop.scale.dist import Dist
from gradlab.loop.setup.policy import build_tokenizer, load_policy, n_params, new_model
from gradlab.loop.train import Learner
from gradlab.loop.update.metrics import StepMetrics
from gradlab.loop.update.step import StepWork, optimizer_step
from gradlab.loop.update.view import loop_instruments


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


def step(L: Learner, cfg: RunConfig, ro: Rollout, adv: torch.Tensor, rows: torch.Tensor, *,
         acc: StepMetrics, scheduled: bool, instruments=None) -> None:
    """The loop's optimizer step at rollout step 0 (`scheduled`: every instrument of the set is
    due, the presets' every-`tax_every` ones included) or 1 (the every-step instruments only)."""
    optimizer_step(L, cfg, StepWork(ro, adv, rows, 0 if scheduled else 1), acc,
                   loop_instruments(cfg) if instruments is None else instruments, Dist())


# the tiers: (name, preset, scheduled step?) — the every-step cost of each preset, and the step
# where the presets' every-5th instruments (tax, attribution, divergent drift, flips) are due.
# "full" between its scheduled steps runs default's every-step set (flips is every-5th only),
# so only its scheduled step is a tier of its own.
TIERS: tuple[tuple[str, str, bool], ...] = (
    ("off", "off", False), ("cheap", "cheap", False), ("default", "default", False),
    ("default@5", "default", True), ("full@5", "full", True))


def bench(model, groups: int, G: int, T: int, *, repeats: int, tok=None,
          tiers: tuple[tuple[str, str, bool], ...] = TIERS) -> dict[str, float]:
    """Medians (s) of the bare optimizer step and of the loop's step under each instrument
    preset (`gradlab.instruments.PRESETS`, built as `RunConfig(instruments=preset)`), on one
    batch of groups × G rows × T tokens, interleaved repeat by repeat. Keys: "<tier>" wall
    medians, "cpu_<tier>" CPU-time medians (user + sys of this process), "min_<tier>" wall
    minima, "probes_phase_<tier>" the step's own `time_probes` (wall s in the instruments' code)."""
    vocab = model.config.vocab_size
    ro = make_rollout(vocab, groups, G, T)
    with torch.no_grad():  # behaviour log-probs a little off the current policy
        ro.old_logps = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                                   ro.response_mask) + 0.05 * torch.randn(ro.response_ids.shape)
    adv = gradlab.advantages(torch.randint(0, 2, (ro.group.numel(),)).float(), ro.group)
    L = Learner("gspo", objectives.get("gspo", eps=(0.2, 0.2)), model,
                torch.optim.AdamW(model.parameters(), lr=1e-6), torch.Generator())
    rows = torch.arange(ro.group.numel())
    phase: dict[str, list[float]] = {name: [] for name, _, _ in tiers}

    def tier(name: str, preset: str, scheduled: bool):
        cfg = RunConfig(progress=False, instruments=preset)
        inst = loop_instruments(cfg)  # built once, as the loop builds it once per run

        def run() -> None:
            acc = StepMetrics()
            step(L, cfg, ro, adv, rows, acc=acc, scheduled=scheduled, instruments=inst)
            acc.finish()  # the step's metrics to floats: one rollout step of one optimizer step
            phase[name].append(acc.times.get("time_probes", 0.0))
        return run

    fns = {"bare": lambda: bare_step(L, ro, adv)}
    fns.update({name: tier(name, preset, sched) for name, preset, sched in tiers})
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"cpu_{k}": statistics.median(v) for k, v in cpu.items()})
    out.update({f"min_{k}": min(v) for k, v in times.items()})  # least-disturbed repeat
    out.update({f"probes_phase_{k}": statistics.median(v[1:]) for k, v in phase.items()})
    return out


def table(t: dict[str, float], tiers: tuple[tuple[str, str, bool], ...] = TIERS) -> str:
    """A Markdown table of `bench`'s medians: one row per tier, CPU time and wall, each over bare."""
    lines = ["| tier | instruments | CPU time (s) | CPU / bare | wall (s) | wall / bare | "
             "instruments' code (wall s) |", "|---|---|---:|---:|---:|---:|---:|",
             f"| bare optimizer step | — | {t['cpu_bare']:.3f} | 1.00× | {t['bare']:.3f} | 1.00× | — |"]
    for name, preset, sched in tiers:
        what = ", ".join(f"{n}@{k}" if k > 1 else n for n, k in PRESETS[preset]) or "none"
        label = "loop, instruments off" if preset == "off" else \
            f"{preset} ({'a step where the every-5th are due' if sched else 'every step'})"
        lines.append(f"| {label} | {what} | {t['cpu_' + name]:.3f} | "
                     f"{t['cpu_' + name] / t['cpu_bare']:.2f}× | {t[name]:.3f} | "
                     f"{t[name] / t['bare']:.2f}× | {t['probes_phase_' + name]:.3f} |")
    return "\n".join(lines)


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
    torch.set_num_threads(1)
    tok = build_tokenizer()
    for name in a.models.split(","):
        model = load_policy()[0] if name == "tiny" else new_model(tok, name)
        model.train()
        t = bench(model, a.groups, a.G, a.T, repeats=a.repeats, tok=tok)
        print(f"\n{name} ({n_params(model) / 1e6:.2f} M parameters), torch {torch.__version__}, "
              f"1 thread; {a.groups}×{a.G} sequences × {a.T} response tokens, GSPO, medians of "
              f"{a.repeats}, interleaved\n")
        print(table(t))


if __name__ == "__main__":
    main()
