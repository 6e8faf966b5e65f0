"""Where an instrumented optimizer step's time goes at the real vocabulary: cProfile of a
bare step and of the loop's step under instrument presets (default: off and cheap) on the
random-init V = 151,936 Qwen3 of bench_scale, then torch.profiler's op table of each.

    OMP_NUM_THREADS=1 python -m analyses.benchmarks.profile_probes --hidden 64 --layers 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    import gradlab
    from analyses.benchmarks import bench_probes as bp
    from analyses.benchmarks.bench_scale import real_vocab_model
    from gradlab import objectives
    from gradlab.loop.config import RunConfig
    from gradlab.loop.numerics.logprobs import token_logps
    from gradlab.loop.scale.dist import Dist
    from gradlab.loop.train import Learner
    from gradlab.loop.update.metrics import StepMetrics
    from gradlab.loop.update.step import StepWork, optimizer_step
    from gradlab.loop.update.view import loop_instruments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--presets", default="off,cheap", help="instrument presets to profile")
    ap.add_argument("--top", type=int, default=30, help="cProfile rows per step")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = real_vocab_model(a.hidden, a.layers)
    model.train()
    ro = bp.make_rollout(model.config.vocab_size, a.groups, a.G, a.tokens)
    with torch.no_grad():
        ro.old_logps = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                                   ro.response_mask) + 0.05 * torch.randn(ro.response_ids.shape)
    n = a.groups * a.G
    adv = gradlab.advantages(torch.randint(0, 2, (n,)).float(), ro.group)
    L = Learner("gspo", objectives.get("gspo", eps=(0.2, 0.2)), model,
                torch.optim.AdamW(model.parameters(), lr=1e-6), torch.Generator())
    rows = torch.arange(n)

    def loop(preset: str):
        cfg = RunConfig(progress=False, instruments=preset)
        inst = loop_instruments(cfg)

        def run() -> None:  # rollout step 1: the every-step instruments; then its metrics
            acc = StepMetrics()
            optimizer_step(L, cfg, StepWork(ro, adv, rows, 1), acc, inst, Dist())
            acc.finish()
        return run

    steps = {"bare": lambda: bp.bare_step(L, ro, adv)}
    steps.update({p: loop(p) for p in a.presets.split(",")})
    for fn in steps.values():
        fn()  # warm-up
    for name, fn in steps.items():
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.runcall(fn)
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(a.top)
        print(f"===== {name}: {time.perf_counter() - t0:.2f} s wall\n{s.getvalue()}")
    for name, fn in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as p:
            fn()
        print(f"===== {name}: torch ops\n"
              + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
