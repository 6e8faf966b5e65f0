"""gradlab's loop against TRL's GRPOTrainer at the real vocabulary (151,936 rows).

Same random-init real-vocabulary Qwen3 for both (`analyses/studies/real_vocab_run.py`: built
locally, no download; hidden 256 and 4 layers = 42.0 M parameters by default, as `bench_scale.py`), same
arithmetic prompts, prompts × G per rollout, new tokens, learning rate, AdamW, grad clip 1,
optimizer steps per rollout (gradlab `minibatches` = TRL `steps_per_generation`, gradient
accumulation 1), one torch thread. Loss: gradlab "grpo" (token-mean PPO-clip) vs TRL loss_type
"dapo" (the same loss). Runners, each in its own child process (so peak RSS is per runner):

  gradlab        gradlab.loop.train.train(RunConfig(..., instruments="off"))
  gradlab+probes the same with the default probes (W, residuals, drift every step, probe set;
                 the tax on rollout 0, the warm-up)
  trl            trl.GRPOTrainer
  trl+gradlab    gradlab.integrations.trl.GradlabGRPOTrainer, instruments "cheap" (W, ρ and
                 the closed-form check every optimizer step; the run store)

Optimizer steps/s (wall, and per CPU second of the single-threaded child): rollouts 2..R of the training loop (rollout = sampling + its optimizer
steps; the first rollout is a warm-up and not counted; setup, checkpoints and evaluation are
excluded: gradlab's `rollout_step` calls, TRL's step ends). Peak memory: the child's ru_maxrss
(setup included), and its RSS when training starts (model, optimizer and trainer built). A random-init model almost never samples
EOS, so both run the full --tokens; TRL may sample the 267 embedding rows past the tokenizer
(decoded as nothing), gradlab masks them.

    OMP_NUM_THREADS=1 python -m analyses.benchmarks.bench_trl_real                  # 42 M, 2 × 8 × 32 tokens
    python -m analyses.benchmarks.bench_trl_real --hidden 32 --layers 1 --tokens 4 --rollouts 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradlab import jsonio

RUNNERS = ("gradlab", "gradlab+probes", "trl", "trl+gradlab")


def _rss_mib() -> float:
    """Current resident set size of this process (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_gradlab(a: argparse.Namespace, folder: str, probes: bool, tmp: str,
                rss: list[float]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each rollout step (sampling + optimizer steps + probes);
    appends the RSS (MiB) at the first one (setup done) to `rss`."""
    import gradlab.loop.train as gl_train
    from gradlab.loop.config import RunConfig
    from gradlab.loop.runs.store import RunStore

    cfg = RunConfig(out=os.path.join(tmp, "gl"), model=folder, objectives=["grpo"],
                    steps=a.rollouts, prompts=a.prompts, G=a.G, minibatches=a.minibatches,
                    lr=a.lr, seed=a.seed, progress=False, max_new_tokens=a.tokens,
                    eval_every=0, instruments="default" if probes else "off", threads=1)
    inner, times = gl_train.rollout_step, []

    def timed(*args, **kw):
        if not times:
            rss.append(_rss_mib())
        t0 = (time.perf_counter(), time.process_time())
        try:
            return inner(*args, **kw)
        finally:
            times.append((time.perf_counter() - t0[0], time.process_time() - t0[1]))

    gl_train.rollout_step = timed
    RunStore.save_checkpoint = lambda *args, **kw: None  # TRL saves nothing either
    gl_train.train(cfg)
    return times


def run_trl(a: argparse.Namespace, folder: str, instrumented: bool, tmp: str,
            rss: list[float]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each rollout (steps_per_generation optimizer steps); appends
    the RSS (MiB) at train begin (setup done) to `rss`."""
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from gradlab.integrations.audit.trl import WORKLOADS, grpo_args
    from gradlab.integrations.audit.trl_setup import dataset_and_reward
    from gradlab.integrations.trl import GradlabConfig, GradlabGRPOTrainer
    from gradlab.loop.setup.policy import load_policy

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[tuple[float, float]] = []

        def on_train_begin(self, args, state, control, **kw):
            rss.append(_rss_mib())
            self.ends.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kw):
            self.ends.append((time.perf_counter(), time.process_time()))

    model, tok = load_policy(folder)
    args = grpo_args("dapo", "token", a.minibatches, a.rollouts * a.minibatches,
                     os.path.join(tmp, "trl"), prompts=a.prompts, G=a.G, lr=a.lr, seed=a.seed,
                     max_completion_length=a.tokens, logging_steps=a.minibatches)
    ds, reward = dataset_and_reward(WORKLOADS["arithmetic"], a.prompts * a.rollouts, a.seed)
    kw = {"model": model, "reward_funcs": reward, "args": args, "train_dataset": ds,
          "processing_class": tok}
    tr = (GradlabGRPOTrainer(**kw, gradlab=GradlabConfig(store=os.path.join(tmp, "store"),
                                                          instruments="cheap"))
          if instrumented else GRPOTrainer(**kw))
    tr.remove_callback(PrinterCallback)
    clock = Clock()
    tr.add_callback(clock)
    tr.train()
    e = clock.ends[:: a.minibatches]  # train begin, then the end of each rollout's last step
    return [(t1[0] - t0[0], t1[1] - t0[1]) for t0, t1 in zip(e, e[1:])]


def child(a: argparse.Namespace) -> dict:
    """One runner in this process: per-rollout times, steps/s over rollouts 2..R, memory."""
    import torch

    from gradlab.integrations.audit.trl import quiet

    torch.set_num_threads(1)
    start: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, quiet():
        fn = run_gradlab if a.runner.startswith("gradlab") else run_trl
        times = fn(a, a.folder, a.runner in ("gradlab+probes", "trl+gradlab"), tmp, start)
    timed = times[1:] or times  # the first rollout is a warm-up
    steps = a.minibatches * len(timed)
    return {"runner": a.runner, "rollout_s": [w for w, _ in times],
            "rollout_cpu_s": [c for _, c in times],
            "steps_per_s": steps / sum(w for w, _ in timed),
            "steps_per_cpu_s": steps / sum(c for _, c in timed), "rss_start_mib": start[0],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(a: argparse.Namespace, runner: str, folder: str) -> dict:
    """Run `child` for `runner` in a fresh process; its JSON result."""
    cmd = [sys.executable, "-m", "analyses.benchmarks.bench_trl_real", "--_child", runner,
           "--folder", folder]
    for k in ("prompts", "G", "tokens", "minibatches", "rollouts", "lr", "seed"):
        cmd += [f"--{k}", str(getattr(a, k))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{runner} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(res: dict[str, list[dict]], a: argparse.Namespace, info: dict) -> dict:
    """Markdown table of medians over rounds; ratios to TRL; returns the medians."""
    med = {k: {m: statistics.median(r[m] for r in v)
               for m in ("steps_per_s", "steps_per_cpu_s", "peak_rss_mib", "rss_start_mib")}
           for k, v in res.items()}
    t = med["trl"]
    print(f"\ngradlab vs TRL GRPOTrainer, random-init Qwen3 V=151,936 ({info['params'] / 1e6:.1f} M "
          f"parameters, hidden {a.hidden}, {a.layers} layers), {a.prompts} prompts × G={a.G} × "
          f"{a.tokens} tokens per rollout, {a.minibatches} optimizer steps per rollout, "
          f"{a.rollouts} rollouts (first not timed), {a.rounds} round(s), 1 thread\n")
    print("| runner | optimizer steps/s (wall) | ratio to TRL | steps per CPU-s | ratio to TRL | "
          "peak RSS (MiB) | ratio to TRL | RSS at train start (MiB) |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for k, m in med.items():
        c = m["steps_per_cpu_s"]
        print(f"| {k} | {m['steps_per_s']:.3f} | {m['steps_per_s'] / t['steps_per_s']:.2f}× | "
              f"{c:.3f} | {c / t['steps_per_cpu_s']:.2f}× | "
              f"{m['peak_rss_mib']:.0f} | {m['peak_rss_mib'] / t['peak_rss_mib']:.2f}× | "
              f"{m['rss_start_mib']:.0f} |")
    if "gradlab" in med:
        g = med["gradlab"]
        print(f"\ntargets: gradlab / trl steps/s ≥ 1.2 ({g['steps_per_s'] / t['steps_per_s']:.2f} "
              f"wall, {g['steps_per_cpu_s'] / t['steps_per_cpu_s']:.2f} CPU);"
              f" gradlab peak ≤ trl peak ({g['peak_rss_mib']:.0f} vs {t['peak_rss_mib']:.0f} MiB)")
    return med


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per response")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per rollout")
    p.add_argument("--rollouts", type=int, default=3, help="per run; the first is a warm-up")
    p.add_argument("--rounds", type=int, default=1, help="runs per runner, order rotated")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runners", default=",".join(RUNNERS), help="a subset, comma-separated")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--_child", dest="runner", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.runner:
        print(jsonio.dumps(child(a)))
        return {}
    from analyses.studies.real_vocab_run import build_folder

    runners = [k for k in RUNNERS if k in a.runners.split(",")]
    if "trl" not in runners:
        p.error("--runners: the ratios are to trl; include it")
    res: dict[str, list[dict]] = {k: [] for k in runners}
    with tempfile.TemporaryDirectory() as tmp:
        info = build_folder(Path(tmp), a.hidden, a.layers)
        for r in range(a.rounds):
            k = r % len(runners)
            for name in runners[k:] + runners[:k]:
                res[name].append(spawn(a, name, tmp))
                print(f"  round {r} {name}: {res[name][-1]}", file=sys.stderr, flush=True)
    med = report(res, a, info)
    if a.json:
        Path(a.json).write_text(jsonio.dumps({"args": vars(a), "model": info, "runs": res,
                                            "medians": med}, indent=1))
    return med


if __name__ == "__main__":
    main()
