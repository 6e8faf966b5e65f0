"""The main job (`gradlab reproduce`) at several seeds: its committed summary and the reference
behind `gradlab reproduce --check`.

Trains the main job's configuration (RunConfig defaults, one torch thread) at seeds 0..n-1
(runs/main_job/seed{k}; a folder is reused only when the current code made it), summarises each
with `gradlab.loop.recipes.reproduce.summarize`, and writes
  figures/main_job.md    seed 0 (what `gradlab reproduce` prints on this machine) and the
                         seed spread (mean, sd) of every number, with the machine
  figures/main_job.csv   the per-seed summaries (tidy: seed, objective, metric, value)
  figures/main_job.json  provenance: the command, code hash, machine, and every run used
  gradlab/data/reproduce_reference.json   the bands of `gradlab reproduce --check`
                         (gradlab.loop.recipes.reference: 99.9 % prediction intervals of the spread)

    python -m analyses.studies.main_job              # 5 seeds (~6 min of one core here)
    python -m analyses.studies.main_job --quick      # seconds: 3 seeds of a 3-step job, for tests
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from analyses.tools.common import FIGURES, QUICK, ROOT, provenance, run_seeds, set_threads, stamp
from gradlab import jsonio
from gradlab.loop.recipes.reference import REFERENCE, make_reference
from gradlab.loop.recipes.reproduce import summarize
from gradlab.loop.runs.store import load_run
from gradlab.provenance import machine

SHOWN = ["acc_first", "acc_last5", "eval_accuracy_expected_final", "rho_prefix", "rho_trie",
         "shared_frac_prefix", "tax_share", "entropy", "tokens"]


def markdown(per_seed: dict, prov: dict, seconds: float) -> str:
    seed0 = per_seed[min(per_seed)].set_index("objective")
    long = pd.concat([s.assign(seed=k) for k, s in per_seed.items()])
    g = long.groupby("objective", sort=False)[[c for c in SHOWN if c in long]]
    spread = g.mean().combine(g.std(), lambda m, s: m.map("{:.3g}".format) + " ± " + s.map("{:.2g}".format))
    cols = [c for c in SHOWN if c in seed0.columns]
    return "\n".join([
        "# The main job (`gradlab reproduce`)", "",
        "Seed 0 — what `gradlab reproduce --threads 1` prints on this machine, bitwise (same CPU "
        "model, torch build and thread count give the same numbers; another CPU parts within "
        "tens of steps and lands inside the seed spread below):", "",
        seed0[cols].to_markdown(floatfmt=".3g"), "",
        f"Spread over seeds {sorted(per_seed)} (mean ± sd):", "",
        spread.T.to_markdown(), "",
        f"{seconds:.0f} s; {stamp(prov)}. The bands of `gradlab reproduce --check` come from this "
        "spread (gradlab/data/reproduce_reference.json)."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 seeds of a 3-step job, for tests")
    p.add_argument("--seeds", type=int, help="seeds 0..n-1 (default 5; quick 3)")
    p.add_argument("--runs", help="default runs/main_job (quick: runs/main_job-quick)")
    p.add_argument("--out", help="folder for main_job.* (default figures/; quick: the runs folder)")
    p.add_argument("--reference", help=f"where the reference goes (default {REFERENCE}; quick: "
                   "the runs folder)")
    p.add_argument("--reuse-any-code", action="store_true",
                   help="reuse finished runs whatever code made them (recorded in the .json)")
    a = p.parse_args(argv)
    set_threads(1)
    n = a.seeds or (3 if a.quick else 5)
    runs = Path(a.runs or ROOT / ("runs/main_job-quick" if a.quick else "runs/main_job"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    ref_path = Path(a.reference or (runs / "reproduce_reference.json" if a.quick else REFERENCE))
    size = dict(QUICK, steps=3, eval_every=3, eval_size=16) if a.quick else {"progress": False}
    t0, prov, ledger = time.time(), provenance("analyses.studies.main_job", argv), []
    run_seeds(runs, range(n), ledger=ledger, reuse_any_code=a.reuse_any_code, threads=1, **size)
    per_seed = {k: summarize(load_run(runs / f"seed{k}")) for k in range(n)}
    seconds = time.time() - t0
    ref = make_reference(list(per_seed.values()), list(range(n)),
                         {**machine(), "code_hash": prov["code_hash"], "commit": prov["commit"]})
    out.mkdir(parents=True, exist_ok=True)
    ref_path.parent.mkdir(parents=True, exist_ok=True)
    ref_path.write_text(jsonio.dumps(ref, indent=1) + "\n")
    long = pd.concat([s.assign(seed=k) for k, s in per_seed.items()]).melt(
        id_vars=["seed", "objective"], var_name="metric")
    long.to_csv(out / "main_job.csv", index=False)
    md = markdown(per_seed, prov, seconds)
    (out / "main_job.md").write_text(md + "\n")
    (out / "main_job.json").write_text(jsonio.dumps(
        {"provenance": prov, "seeds": n, "seconds": round(seconds), "runs": ledger,
         "reference": str(ref_path)}, indent=1, default=str))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
