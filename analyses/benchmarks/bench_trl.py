"""Throughput: gradlab's loop vs TRL's GRPOTrainer, and gradlab's instrumentation on TRL.

Same tiny policy (the shipped default), task (2-digit additions, strict reward), prompts × G per
rollout, max new tokens, temperature 1, learning rate, AdamW, grad clip 1 and optimizer steps
per rollout (gradlab `minibatches` = TRL `steps_per_generation`, gradient_accumulation_steps=1).
Loss: gradlab "grpo" (token-mean PPO-clip, ε = 0.2) vs TRL loss_type "dapo" (the same).
Runners, interleaved round by round (order rotated each round) so that CPU contention from other
jobs hits all of them alike; a warm-up round is not counted:

  gradlab        gradlab.loop.train.train(RunConfig(..., instruments="off")): trainer metrics only
  gradlab+probes the same with the default probes (drift every step, tax every 5 rollouts)
  trl            trl.GRPOTrainer
  trl+gradlab    gradlab.integrations.trl.GradlabGRPOTrainer, instruments "cheap" (W, ρ and
                 the closed-form check every optimizer step; the run store every window)

Both run with the same torch thread count (default 1, see --threads).
Time = the training loop only, setup excluded (gradlab: Σ over `gradlab.loop.train.rollout_step`
calls, i.e. rollout + updates + probes; TRL: on_train_begin → on_train_end), as wall time and
as this process's CPU time (less sensitive to other jobs on shared cores). Prints medians,
ratios of medians, and the median of the per-round ratios (runs of a round are neighbours in
time, so they share the machine's load).

    python -m analyses.benchmarks.bench_trl [--rollouts 10] [--rounds 5] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

import gradlab.loop.train as gl_train
from gradlab import jsonio
from gradlab.integrations.audit.trl import WORKLOADS, grpo_args, make_trainer, quiet
from gradlab.integrations.trl import GradlabConfig
from gradlab.loop.config import RunConfig
from gradlab.loop.runs.store import load_run

RUNNERS = ("gradlab", "gradlab+probes", "trl", "trl+gradlab")


class _Clock(TrainerCallback):
    """Wall and CPU time of TRL's training loop."""

    def on_train_begin(self, args, state, control, **kw):
        self.t0 = (time.perf_counter(), time.process_time())

    def on_train_end(self, args, state, control, **kw):
        self.wall = time.perf_counter() - self.t0[0]
        self.cpu = time.process_time() - self.t0[1]


def run_gradlab(a, rollouts: int, probes: bool, tmp: str) -> dict:
    extra = {} if probes else {"instruments": "off"}
    cfg = RunConfig(out=os.path.join(tmp, "gl"), objectives=["grpo"], steps=rollouts,
                    prompts=a.prompts, G=a.G, minibatches=a.minibatches, lr=a.lr,
                    seed=a.seed, progress=False, ckpt_every=rollouts, **extra)
    inner, clock = gl_train.rollout_step, {"wall": 0.0, "cpu": 0.0}

    def timed(*args, **kw):  # the loop's per-rollout work, setup and checkpoints excluded
        t = (time.perf_counter(), time.process_time())
        try:
            return inner(*args, **kw)
        finally:
            clock["wall"] += time.perf_counter() - t[0]
            clock["cpu"] += time.process_time() - t[1]

    gl_train.rollout_step = timed
    try:
        with quiet():
            gl_train.train(cfg)
    finally:
        gl_train.rollout_step = inner
    df = load_run(cfg.out, wide=True)
    core = float((df["time_rollout"] + df["time_update"]).sum())  # without the loop's probes
    return {**clock, "core": core, "opt_steps": rollouts * a.minibatches,
            "tokens": float(df["tokens"].max())}


def run_trl(a, rollouts: int, instrumented: bool, tmp: str) -> dict:
    with quiet():
        args = grpo_args("dapo", "token", a.minibatches, rollouts * a.minibatches,
                         os.path.join(tmp, "trl"), prompts=a.prompts, G=a.G, lr=a.lr,
                         seed=a.seed, logging_steps=a.minibatches)
        gl = GradlabConfig(store=os.path.join(tmp, "trl", "gradlab"), instruments="cheap")
        tr = make_trainer(args, WORKLOADS["arithmetic"], gl, instrumented=instrumented,
                          n_prompts=a.prompts * rollouts)
        count = {"tokens": 0}
        reward = tr.reward_funcs[0]

        def counted(prompts, completions, completion_ids, **kw):  # sampled tokens, incl. EOS
            count["tokens"] += sum(len(c) for c in completion_ids)
            return reward(prompts, completions, completion_ids=completion_ids, **kw)

        tr.reward_funcs[0] = counted
        clock = _Clock()
        tr.add_callback(clock)
        tr.train()
    return {"wall": clock.wall, "cpu": clock.cpu, "opt_steps": rollouts * a.minibatches,
            "tokens": float(count["tokens"])}


def run_one(name: str, a, rollouts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if name.startswith("gradlab"):
            return run_gradlab(a, rollouts, name == "gradlab+probes", tmp)
        return run_trl(a, rollouts, name == "trl+gradlab", tmp)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers
    import trl

    return (f"{cpu}; {os.cpu_count()} CPUs visible, torch threads {torch.get_num_threads()}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"trl {trl.__version__}; load average {os.getloadavg()[0]:.2f}")


def _ratios(v: dict[str, float]) -> dict[str, float]:
    """The headline ratios from per-runner steps/s (or tokens/s) values."""
    return {"gradlab / trl": v["gradlab"] / v["trl"],
            "gradlab+probes / trl": v["gradlab+probes"] / v["trl"],
            "trl+gradlab / trl (time)": v["trl"] / v["trl+gradlab"]}


def report(results: dict[str, list[dict]]) -> dict:
    """Print medians and ratios (of medians, and median of per-round ratios); return them."""
    med = {}
    print("\n| runner | median wall s | steps/s (wall) | tokens/s (wall) | steps/s (CPU) | runs |"
          "\n|---|---|---|---|---|---|")
    for name, rs in results.items():
        m = {"wall": statistics.median(r["wall"] for r in rs),
             "steps_wall": statistics.median(r["opt_steps"] / r["wall"] for r in rs),
             "tokens_wall": statistics.median(r["tokens"] / r["wall"] for r in rs),
             "steps_cpu": statistics.median(r["opt_steps"] / r["cpu"] for r in rs)}
        med[name] = m
        print(f"| {name} | {m['wall']:.2f} | {m['steps_wall']:.2f} | {m['tokens_wall']:.0f} | "
              f"{m['steps_cpu']:.2f} | {len(rs)} |")
    core = statistics.median(r["opt_steps"] / r["core"] for r in results["gradlab"])
    print(f"| gradlab, rollout + update only (its store's time_rollout + time_update) | — | "
          f"{core:.2f} | — | — | {len(results['gradlab'])} |")
    n = len(results["trl"])
    per_round = [_ratios({k: results[k][i]["opt_steps"] / results[k][i]["wall"] for k in results})
                 for i in range(n)]
    table = {
        "ratio of medians, steps/s (wall)": _ratios({k: v["steps_wall"] for k, v in med.items()}),
        "ratio of medians, tokens/s (wall)": _ratios({k: v["tokens_wall"] for k, v in med.items()}),
        "ratio of medians, steps/s (CPU)": _ratios({k: v["steps_cpu"] for k, v in med.items()}),
        "median of per-round ratios (wall)": {
            k: statistics.median(r[k] for r in per_round) for k in per_round[0]},
    }
    cols = list(per_round[0])
    print(f"\n| measure | {' | '.join(cols)} |\n|---|{'---|' * len(cols)}")
    for k, v in table.items():
        print(f"| {k} | {' | '.join(f'{v[c]:.2f}' for c in cols)} |")
    table["gradlab rollout + update only / trl, steps/s (wall)"] = core / med["trl"]["steps_wall"]
    print(f"| gradlab rollout + update only / trl, steps/s (wall) | "
          f"{table['gradlab rollout + update only / trl, steps/s (wall)']:.2f} | | |")
    print("targets: gradlab / trl ≥ 1.5; trl+gradlab / trl (time) ≤ 1.10")
    return {"medians": med, "ratios": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=10, help="rollout batches per run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--minibatches", type=int, default=4, help="optimizer steps per rollout")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for both (default 1: with tiny ops, 2+ OpenMP threads on "
                        "shared cores stall in barriers and times swing 10-30x; 0 = torch's)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"machine: {machine()}")
    print(f"workload: {a.prompts} prompts × G={a.G} per rollout, {a.minibatches} optimizer steps "
          f"per rollout, {a.rollouts} rollouts per run, {a.rounds} rounds (+1 warm-up)")
    for name in RUNNERS:  # warm-up: imports, first-call costs
        run_one(name, a, 2)
    results = {n: [] for n in RUNNERS}
    for r in range(a.rounds):
        order = RUNNERS[r % len(RUNNERS):] + RUNNERS[: r % len(RUNNERS)]
        for name in order:
            res = run_one(name, a, a.rollouts)
            results[name].append(res)
            print(f"  round {r} {name:15s} {res['wall']:.2f} s wall, {res['cpu']:.2f} s CPU",
                  flush=True)
    out = report(results)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(jsonio.dumps({"machine": machine(), "args": vars(a),
                                            "runs": results, **out}, indent=1))


if __name__ == "__main__":
    main()
