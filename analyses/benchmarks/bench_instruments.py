"""Benchmark: what each instrument and each preset adds to the loop's optimizer step.

    python -m analyses.benchmarks.bench_instruments                   # tiny and ~25M policies
    python -m analyses.benchmarks.bench_instruments --quick           # small sizes (tests)
    python -m analyses.benchmarks.bench_instruments --write           # + figures/ and the docs table

Same batch, objective (GSPO), model and optimizer, measured side by side, interleaved round
by round: the loop's step with no instrument (`off`: no W hook either), then with one
instrument alone, then each preset at a step where all its instruments are due (step 0) and,
for `default`, at a step where only the every-step ones are (step 1). Reports the median CPU
time of this process per step (robust to other jobs) and its ratio to `off`, per model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import gradlab
import gradlab.instruments as gi
from analyses.benchmarks.bench_probes import make_rollout
from analyses.tools.common import provenance
from analyses.tools.quoted_data import replace_table
from gradlab import jsonio, objectives
from gradlab.loop.config import RunConfig
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.scale.dist import Dist
from gradlab.loop.setup.policy import build_tokenizer, load_policy, n_params, new_model
from gradlab.loop.train import Learner
from gradlab.loop.update.metrics import StepMetrics
from gradlab.loop.update.step import StepWork, optimizer_step
from gradlab.provenance import in_process_row

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "concepts" / "instruments.md"
SINGLE = ("modulation", "residual", "attribution", "tax", "drift", "drift_divergent", "flips",
          "fisher")


def configs() -> dict[str, tuple[list, int]]:
    """name → (instruments, rollout step): every instrument alone (due at step 0), the presets."""
    out = {"off": ([], 0)}
    out.update({n: ([gi.available()[n]()], 0) for n in SINGLE})
    out.update({"cheap": (gi.resolve("cheap"), 0), "default, light step": (gi.resolve("default"), 1),
                "default, heavy step": (gi.resolve("default"), 0), "full, heavy step": (gi.resolve("full"), 0)})
    return out


def bench(model, groups: int, G: int, T: int, repeats: int) -> dict[str, float]:
    """Median CPU seconds per optimizer step of every configuration (`configs`)."""
    ro = make_rollout(model.config.vocab_size, groups, G, T)
    with torch.no_grad():  # behaviour log-probs a little off the current policy
        ro.old_logps = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                                   ro.response_mask) + 0.05 * torch.randn(ro.response_ids.shape)
    adv = gradlab.advantages(torch.randint(0, 2, (ro.group.numel(),)).float(), ro.group)
    learner = Learner("gspo", objectives.get("gspo", eps=(0.2, 0.2)), model,
                      torch.optim.AdamW(model.parameters(), lr=1e-6), torch.Generator())
    rows = torch.arange(ro.group.numel())
    cfg, bare = RunConfig(progress=False, G=G), RunConfig(progress=False, G=G, instruments="off")
    runs = {}
    for name, (insts, step) in configs().items():
        c = bare if name == "off" else cfg
        runs[name] = lambda c=c, s=step, i=insts: optimizer_step(
            learner, c, StepWork(ro, adv, rows, s), StepMetrics(), gi.InstrumentSet(i), Dist())
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in runs.items():
            c0 = time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
    return {k: statistics.median(v) for k, v in cpu.items()}


def table(data: dict) -> str:
    """The overhead table (markdown) from the benchmark's JSON."""
    models = data["models"]
    head = "| instruments | " + " | ".join(f"{m['name']} ({m['params_m']:.2f} M)" for m in models) + " |"
    lines = [head, "|---|" + "---|" * len(models)]
    for name in models[0]["cpu_s"]:
        cells = [f"{m['cpu_s'][name]:.3f} s" + ("" if name == "off" else
                 f", {m['cpu_s'][name] / m['cpu_s']['off']:.2f}×") for m in models]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    p = data["provenance"]
    lines.append("")
    lines.append(f"Median CPU time per optimizer step and its ratio to `off`, {data['batch']}; "
                 f"`{p['command']}`, {p['cpu_model']}, torch {p['torch']}, {p['threads']} "
                 f"thread(s), code {p['code_hash']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--models", default="tiny,25m")
    ap.add_argument("--write", action="store_true",
                    help="write figures/instrument_overhead.json and the table in the docs")
    a = ap.parse_args(argv)
    if a.quick:
        a.groups, a.G, a.T, a.repeats, a.models = 2, 4, 16, 1, "tiny"
    torch.set_num_threads(1)
    tok = build_tokenizer()
    data = {"batch": f"{a.groups} groups × G = {a.G} × {a.T} response tokens, "
                     f"medians of {a.repeats} interleaved rounds",
            "provenance": provenance("analyses.benchmarks.bench_instruments", argv), "models": []}
    data["runs"] = [in_process_row(data["provenance"])]  # measured in this process
    for name in a.models.split(","):
        torch.manual_seed(0)
        model = (load_policy()[0] if name == "tiny" else new_model(tok, name)).train()
        data["models"].append({"name": name, "params_m": n_params(model) / 1e6,
                               "cpu_s": bench(model, a.groups, a.G, a.T, repeats=a.repeats)})
    out = table(data)
    print(out)
    if a.write:
        (ROOT / "figures" / "instrument_overhead.json").write_text(jsonio.dumps(data, indent=1) + "\n")
        PAGE.write_text(replace_table(PAGE.read_text(), "instrument-overhead", out))


if __name__ == "__main__":
    main()
