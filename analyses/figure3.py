"""Figure 3: training curves of DFPO (both transforms), GSPO and GRPO at matched compute.

Trains the tandem loop once per seed (`gradlab.loop.train.train` → runs/figure3/seed{k}: every
objective starts from the same weights and sees the same prompt stream), reads the folders with
`gradlab.load_run` (the tidy table: run, objective, seed, step, tokens, metric, value), puts each
seed's curve on a common rollout-token grid (linear interpolation: seeds consume different
token counts) and draws mean and 95 % bootstrap band over seeds with
`gradlab.viz.curves.training_curves`:

  figure3.png              accuracy and reward vs rollout tokens (the paper's Figure 3)
  figure3_diagnostics.png  beyond the paper: ρ per step (full-group and trie nodes), the
                           learning-tax drift (cumulative KL at fixed shared probe contexts),
                           ‖g_tax‖/‖g_total‖, token entropy, equal-solution log-odds
  figure3.csv              the tidy table behind both: plotted metrics, raw (before interpolation)
  and a markdown table: last-5-steps accuracy per objective, mean [95 % bootstrap] over seeds.

    python analyses/figure3.py                 # full: 5 seeds × 150 steps × 8 prompts × G=8
    python analyses/figure3.py --quick         # seconds: runs/figure3-quick, for tests
Finished seed folders are reused (delete runs/figure3 to retrain).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from analyses.common import (
    FIGURES,
    QUICK,
    ROOT,
    align_tokens,
    bootstrap_ci,
    fmt_ci,
    load_seeds,
    run_seeds,
    set_threads,
)
from gradlab import viz as plots

OBJECTIVES = ["dfpo-min", "dfpo-orth", "gspo", "grpo"]
FULL = dict(steps=150, prompts=8, G=8, minibatches=4, tax_every=5, progress=True)
MAIN = [("accuracy", "accuracy (training samples, temperature 1)"),
        ("reward", "reward")]
BEYOND = [("rho_prefix", "cancellation ratio ρ, full-group nodes"),
          ("rho_trie", "cancellation ratio ρ, trie nodes"),
          ("probe_kl", "learning-tax drift: cumulative KL at shared probe contexts (nats)"),
          ("tax_share", "‖g_tax‖ / ‖g_total‖"),
          ("entropy", "token entropy (nats)"),
          ("logodds", "equal-solution log-odds log π(a)/π(b)")]


def final_table(tidy: pd.DataFrame, metric: str = "accuracy", last: int = 5) -> pd.DataFrame:
    """Per objective: mean of `metric` over each seed's last `last` rollout steps, then mean and
    95 % bootstrap interval over seeds. Columns: objective, seeds, value (formatted, in %)."""
    d = tidy[tidy["metric"] == metric]
    rows = []
    for obj, o in d.groupby("objective", sort=False):
        per_seed = o[o["step"] > o["step"].max() - last].groupby("seed")["value"].mean()
        rows.append({"objective": obj, "seeds": len(per_seed),
                     f"{metric}, last {last} steps (%)": fmt_ci(*bootstrap_ci(per_seed))})
    return pd.DataFrame(rows)


def make(runs: Path, out: Path, seeds, size: dict, smooth: int = 1) -> pd.DataFrame:
    """Train (or reuse) the seeds, draw both figures, write the CSV; returns the tidy table."""
    run_seeds(runs, seeds, objectives=OBJECTIVES, **size)
    tidy = load_seeds(runs)
    tidy = tidy[tidy["seed"].isin(list(seeds))]
    aligned = align_tokens(tidy, n=min(40, size["steps"] * 4))
    out.mkdir(parents=True, exist_ok=True)
    plots.save(plots.training_curves(aligned, MAIN, smooth=smooth), out / "figure3.png")
    plots.save(plots.training_curves(aligned, BEYOND, smooth=smooth),
               out / "figure3_diagnostics.png")
    # the data behind the figures: the plotted metrics (the full tables stay in the run folders)
    plotted = [m for m, _ in MAIN + BEYOND] + ["logodds_abs", "forms_entropy"]
    tidy[tidy["metric"].isin(plotted)].to_csv(out / "figure3.csv", index=False)
    return tidy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--seeds", type=int, help="number of seeds 0..n-1 (default 5; quick: 2)")
    p.add_argument("--runs", help="run folders (default runs/figure3, quick: runs/figure3-quick)")
    p.add_argument("--out", help="output folder (default figures/, quick: the runs folder)")
    p.add_argument("--steps", type=int, help="override the rollout steps")
    a = p.parse_args(argv)
    set_threads(1)
    a.seeds = a.seeds or (2 if a.quick else 5)
    size = dict(QUICK) if a.quick else dict(FULL)
    if a.steps:
        size["steps"] = a.steps
    runs = Path(a.runs or ROOT / ("runs/figure3-quick" if a.quick else "runs/figure3"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    t0 = time.time()
    tidy = make(runs, out, range(a.seeds), size, smooth=1 if a.quick else 3)
    print(final_table(tidy).to_markdown(index=False))
    print(f"figure3: {a.seeds} seeds × {size['steps']} steps × {size['prompts']} prompts × "
          f"G={size['G']} → {out}/figure3.png, figure3_diagnostics.png, figure3.csv "
          f"in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
