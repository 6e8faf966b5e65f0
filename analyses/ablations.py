"""The paper's ablations as tables, on the built-in task: Table 2 and Table 3.

Table 2 — DFPO Min-Replace, GSPO, DFPO without stop-gradient, DFPO "scale by 0.5": one tandem
run per seed (runs/ablations/table2/seed{k}; same initial weights and prompt stream for all four).
Table 3 — DFPO Min-Replace − GSPO at G = 2, 4, 8, 16: a two-objective tandem per (G, seed)
(runs/ablations/table3/G{g}/seed{k}); prompts per step fixed, so compute grows with G alike for
both objectives; the difference is paired by seed.

Score: held-out accuracy of each objective's final policy (`evaluate`: `--eval-n` fresh problems,
one sample each at temperature 1 — the analogue of the paper's avg@k), and the training
accuracy of the last 5 rollout steps. Mean and 95 % percentile-bootstrap interval over seeds
(with few seeds the interval is crude). Printed as markdown next to the paper's numbers (Qwen3-32B,
AIME25 / LiveCodeBench / HMMT25 — a trend to compare with, not a target at this scale) and
written to <out>/ablations.md and <out>/ablations.csv (one row per table, row label, G, seed,
objective, metric, value).

    python analyses/ablations.py            # full: 5 seeds, 150 steps × 8 prompts, G=8 (T2)
    python analyses/ablations.py --quick    # seconds: runs/ablations-quick, for tests
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
    bootstrap_ci,
    final_accuracy,
    fmt_ci,
    load_seeds,
    run_seeds,
    set_threads,
)

# objective name in the run → (row label, objective_params)
TABLE2 = {"dfpo-min": ("DFPO (Min-Replace)", {}), "gspo": ("GSPO (baseline)", {}),
          "dfpo": ("DFPO (no stop-grad)", {"stop_grad": False}),
          "dfpo-scale": ("DFPO (scale by 0.5)", {"factor": 0.5})}
PAPER2 = {"DFPO (Min-Replace)": "82.5 / 71.6 / 61.4", "GSPO (baseline)": "76.9 / 64.7 / 55.8",
          "DFPO (no stop-grad)": "75.6 / 63.8 / 54.9", "DFPO (scale by 0.5)": "75.1 / 63.2 / 54.1"}
PAPER3 = {2: 3.1, 4: 4.2, 8: 5.6, 16: 5.7}
GROUP_SIZES = (2, 4, 8, 16)
FULL = dict(steps=150, prompts=8, G=8, minibatches=4, tax_every=0, progress=True)


def scores(root: Path, seeds, names, eval_n: int) -> pd.DataFrame:
    """Long table: seed, objective, metric (heldout_acc | train_acc_last5), value (0..1)."""
    tidy = load_seeds(root)
    rows = []
    for k in seeds:
        run = root / f"seed{k}"
        d = tidy[(tidy["run"] == f"seed{k}") & (tidy["metric"] == "accuracy")]
        for n in names:
            o = d[d["objective"] == n]
            last = o[o["step"] > o["step"].max() - 5]["value"].mean()
            rows += [{"seed": k, "objective": n, "metric": "train_acc_last5", "value": last},
                     {"seed": k, "objective": n, "metric": "heldout_acc",
                      "value": final_accuracy(run, n, n=eval_n)}]
    return pd.DataFrame(rows)


def table2(root: Path, seeds, size: dict, eval_n: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    params = {n: p for n, (_, p) in TABLE2.items() if p}
    run_seeds(root, seeds, objectives=list(TABLE2), objective_params=params, **size)
    long = scores(root, seeds, list(TABLE2), eval_n).assign(table="table2", G=size["G"])
    long["label"] = long["objective"].map(lambda n: TABLE2[n][0])
    rows = []
    for label, d in long.groupby("label", sort=False):
        rows.append({"variant": label, "seeds": d["seed"].nunique(),
                     "held-out acc. (%)": fmt_ci(*bootstrap_ci(d[d.metric == "heldout_acc"].value)),
                     "train acc., last 5 steps (%)": fmt_ci(
                         *bootstrap_ci(d[d.metric == "train_acc_last5"].value)),
                     "paper: AIME25 / LCB / HMMT25": PAPER2[label]})
    return pd.DataFrame(rows), long


def table3(root: Path, seeds, size: dict, eval_n: int, Gs) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, longs = [], []
    for G in Gs:
        sub = root / f"G{G}"
        run_seeds(sub, seeds, objectives=["dfpo-min", "gspo"], **{**size, "G": G})
        long = scores(sub, seeds, ["dfpo-min", "gspo"], eval_n).assign(table="table3", G=G)
        long["label"] = f"G={G}"
        longs.append(long)
        row = {"G": G, "seeds": len(list(seeds))}
        for metric, col in (("heldout_acc", "held-out"), ("train_acc_last5", "train, last 5")):
            w = long[long.metric == metric].pivot(index="seed", columns="objective", values="value")
            diff = w["dfpo-min"] - w["gspo"]  # paired by seed: same start, same prompts
            row[f"DFPO − GSPO, {col} (points)"] = fmt_ci(*bootstrap_ci(diff))
        row["paper (AIME25, points)"] = f"+{PAPER3[G]}" if G in PAPER3 else "—"
        rows.append(row)
    return pd.DataFrame(rows), pd.concat(longs, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--seeds", type=int, help="number of seeds 0..n-1 (default 5; quick: 2)")
    p.add_argument("--runs", help="default runs/ablations (quick: runs/ablations-quick)")
    p.add_argument("--out", help="folder for ablations.md/.csv (default figures/; quick: runs)")
    p.add_argument("--eval-n", type=int, help="held-out problems per policy (default 256)")
    p.add_argument("--only", choices=("table2", "table3"))
    a = p.parse_args(argv)
    set_threads(1)
    a.seeds = a.seeds or (2 if a.quick else 5)
    size = dict(QUICK) if a.quick else dict(FULL)
    eval_n = a.eval_n or (16 if a.quick else 256)
    runs = Path(a.runs or ROOT / ("runs/ablations-quick" if a.quick else "runs/ablations"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    seeds = range(a.seeds)
    t0, md, longs = time.time(), [], []
    if a.only in (None, "table2"):
        t2, l2 = table2(runs / "table2", seeds, size, eval_n)
        md += ["### Table 2 (ablations), mean [95 % bootstrap CI] over seeds", "",
               t2.to_markdown(index=False), ""]
        longs.append(l2)
    if a.only in (None, "table3"):
        t3, l3 = table3(runs / "table3", seeds, size, eval_n, GROUP_SIZES)
        md += ["### Table 3 (group size), DFPO Min-Replace − GSPO, paired by seed", "",
               t3.to_markdown(index=False), ""]
        longs.append(l3)
    md.append(f"{len(seeds)} seeds × {size['steps']} rollout steps × {size['prompts']} prompts, "
              f"{size['minibatches']} minibatches, held-out n={eval_n}; "
              f"{time.time() - t0:.0f} s.")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablations.md").write_text("\n".join(md) + "\n")
    cols = ["table", "label", "G", "seed", "objective", "metric", "value"]
    pd.concat(longs, ignore_index=True)[cols].to_csv(out / "ablations.csv", index=False)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
