"""The paper's ablations as tables, on the built-in task: Table 2 and Table 3.

Table 2 — every variant against GSPO, paired by seed. The paper's rows (DFPO Min-Replace, GSPO,
DFPO without stop-gradient, DFPO "scale by 0.5") and ours: Orth-Proj, token-mean GRPO, clip-free
DFPO (`dfpo-min[clip=free]`), clip-free GSPO (`gspo[eps=1e9]`), Orth-Proj at trie nodes
(`dfpo-orth[nodes=trie]`). dfpo-min, dfpo-orth, gspo and grpo come from the Figure 3 tandem
(`--fig3-runs`, trained by analyses/figure3.py or here if missing); the other variants run in a
second tandem of the same size and seeds (runs/ablations/table2/seed{k}). Learners of a tandem
are independent of which other objectives run beside them (own model copy, own generators,
sampling noise hashed from seed, step and row; tests/test_analyses.py checks it), so the two
tandems are one experiment: same start, same prompt stream per seed.
Table 3 — DFPO Min-Replace − GSPO at G = 2, 4, 8, 16: a two-objective tandem per (G, seed)
(runs/ablations/table3/G{g}/seed{k}; G = 8 is the Figure 3 tandem); prompts per step fixed, so
compute grows with G alike for both objectives; the difference is paired by seed.

Score: held-out accuracy of each final policy (the store's `eval_accuracy` when the run has one,
else `--eval-n` fresh problems at temperature 1, the same problems and seed for every variant)
and the training accuracy of the last 5 rollout steps; mean [95 % t interval] over seeds, and the
paired difference to GSPO with its 95 % paired t interval and p-value (`gradlab.stats`). Each row
also gives its measured ρ (full-group and trie nodes), learning-tax share, drift (cumulative KL at
shared probe contexts) and rollout tokens (every row takes the same optimizer steps). Written to
<out>/ablations.md, ablations.csv (table, label, G, seed, objective, metric, value) and
ablations.json (provenance: commit, threads, command; sizes; seconds).

    python analyses/ablations.py            # full: 5 seeds, 150 steps × 8 prompts, G=8 (T2)
    python analyses/ablations.py --quick    # seconds: runs/ablations-quick, for tests
    python analyses/ablations.py --task scaffold --steps 60 --seeds 5   # → figures/scaffold/
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from analyses import figure3
from analyses.common import (
    FIGURES,
    QUICK,
    ROOT,
    fmt_diff,
    paired_table,
    per_seed,
    provenance,
    run_seeds,
    set_threads,
    stamp,
    write_meta,
)
from gradlab.stats import paired_interval

# objective (as in the store) → row label; the first four come from the Figure 3 tandem
TABLE2 = {"dfpo-min": "DFPO (Min-Replace)", "gspo": "GSPO (baseline)",
          "dfpo[stop_grad=False]": "DFPO (no stop-grad)", "dfpo-scale": "DFPO (scale by 0.5)",
          "dfpo-orth": "DFPO (Orth-Proj)", "grpo": "GRPO (token mean)",
          "dfpo-min[clip=free]": "DFPO Min-Replace, clip-free",
          "gspo[eps=1e9]": "GSPO, clip-free (eps=1e9)",
          "dfpo-orth[nodes=trie]": "DFPO Orth-Proj, trie nodes"}
EXTRA = [n for n in TABLE2 if n not in figure3.OBJECTIVES]
PAPER2 = {"DFPO (Min-Replace)": "82.5 / 71.6 / 61.4", "GSPO (baseline)": "76.9 / 64.7 / 55.8",
          "DFPO (no stop-grad)": "75.6 / 63.8 / 54.9", "DFPO (scale by 0.5)": "75.1 / 63.2 / 54.1"}
PAPER3 = {2: 3.1, 4: 4.2, 8: 5.6, 16: 5.7}
GROUP_SIZES = (2, 4, 8, 16)
FULL = dict(figure3.FULL)  # the Figure 3 size: the tandems are paired with it


def _long(wide: pd.DataFrame, table: str, G: int, labels: dict) -> pd.DataFrame:
    cols = ["heldout_acc", "train_acc_last5", "rho_prefix", "rho_trie", "tax_share",
            "probe_kl", "tokens"]
    long = wide.melt(id_vars=["seed", "objective"], value_vars=cols, var_name="metric")
    return long.assign(table=table, G=G, label=long["objective"].map(labels))


def table2(root: Path, fig3: Path, seeds, size: dict, eval_n: int):
    run_seeds(fig3, seeds, objectives=figure3.OBJECTIVES, **size)
    run_seeds(root, seeds, objectives=EXTRA, **size)
    wide = pd.concat([per_seed(fig3, seeds, [n for n in TABLE2 if n in figure3.OBJECTIVES], eval_n),
                      per_seed(root, seeds, EXTRA, eval_n)], ignore_index=True)
    t = paired_table(wide, TABLE2)
    t["paper: AIME25 / LCB / HMMT25"] = t["variant"].map(PAPER2).fillna("—")
    return t, _long(wide, "table2", size["G"], TABLE2), wide


def table3(root: Path, fig3: Path, seeds, size: dict, eval_n: int, Gs):
    rows, longs = [], []
    for G in Gs:
        sub = fig3 if G == size["G"] else root / f"G{G}"
        if G != size["G"]:
            run_seeds(sub, seeds, objectives=["dfpo-min", "gspo"], **{**size, "G": G})
        wide = per_seed(sub, seeds, ["dfpo-min", "gspo"], eval_n)
        longs.append(_long(wide, "table3", G, {"dfpo-min": f"G={G}", "gspo": f"G={G}"}))
        w = {c: wide.pivot(index="seed", columns="objective", values=c) for c in wide.columns[2:]
             if c != "heldout_source"}
        row = {"G": G, "seeds": len(w["heldout_acc"])}
        for metric, col in (("heldout_acc", "held-out"), ("train_acc_last5", "train, last 5")):
            d = paired_interval(100 * w[metric]["dfpo-min"], 100 * w[metric]["gspo"])
            row[f"DFPO − GSPO, {col} (points)"] = fmt_diff(d)
        row.update({"GSPO ρ prefix": f"{w['rho_prefix']['gspo'].mean():.2g}",
                    "GSPO tax share": f"{w['tax_share']['gspo'].mean():.2g}",
                    "drift DFPO / GSPO (KL)": f"{w['probe_kl']['dfpo-min'].mean():.2g} / "
                                              f"{w['probe_kl']['gspo'].mean():.2g}",
                    "tokens": f"{w['tokens'].mean().mean():.0f}",
                    "paper (AIME25, points)": f"+{PAPER3[G]}" if G in PAPER3 else "—"})
        rows.append(row)
    return pd.DataFrame(rows), pd.concat(longs, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--seeds", type=int, help="number of seeds 0..n-1 (default 5; quick: 2)")
    p.add_argument("--runs", help="default runs/ablations (quick: runs/ablations-quick)")
    p.add_argument("--fig3-runs", help="the Figure 3 tandem's runs (default runs/figure3; "
                   "quick: <runs>/figure3)")
    p.add_argument("--out", help="folder for ablations.md/.csv/.json (default figures/; quick: runs)")
    p.add_argument("--eval-n", type=int, help="held-out problems per policy (default 256)")
    p.add_argument("--only", choices=("table2", "table3"))
    p.add_argument("--steps", type=int, help="override the rollout steps (must match --fig3-runs)")
    p.add_argument("--task", default="arithmetic", choices=("arithmetic", "scaffold"),
                   help="built-in task; scaffold defaults to runs/ablations-scaffold, "
                   "runs/figure3-scaffold and figures/scaffold/")
    a = p.parse_args(argv)
    set_threads(1)
    a.seeds = a.seeds or (2 if a.quick else 5)
    size = dict(QUICK) if a.quick else dict(FULL)
    if a.steps:
        size["steps"] = a.steps
    sfx = "" if a.task == "arithmetic" else f"-{a.task}"
    if sfx:  # same keys as figure3.py --task, so its runs are reused (run_seeds compares configs)
        size["task"] = a.task
    eval_n = a.eval_n or (16 if a.quick else 256)
    runs = Path(a.runs or ROOT / (f"runs/ablations{sfx}-quick" if a.quick else f"runs/ablations{sfx}"))
    fig3 = Path(a.fig3_runs or (runs / "figure3" if a.quick else ROOT / f"runs/figure3{sfx}"))
    out = Path(a.out or (runs if a.quick else FIGURES / a.task if sfx else FIGURES))
    seeds = range(a.seeds)
    t0, prov, md, longs = time.time(), provenance("ablations.py", argv), [], []
    if a.only in (None, "table2"):
        t2, l2, w2 = table2(runs / "table2", fig3, seeds, size, eval_n)
        src = ", ".join(sorted(set(w2["heldout_source"])))
        md += ["### Table 2 (ablations): mean [95 % t interval] over seeds; difference to GSPO "
               f"paired by seed [95 % paired t interval], p (exact sign-flip); held-out source: {src}", "",
               t2.drop(columns="objective").to_markdown(index=False), ""]
        longs.append(l2)
    if a.only in (None, "table3"):
        t3, l3 = table3(runs / "table3", fig3, seeds, size, eval_n, GROUP_SIZES)
        md += ["### Table 3 (group size), DFPO Min-Replace − GSPO, paired by seed", "",
               t3.to_markdown(index=False), ""]
        longs.append(l3)
    seconds = time.time() - t0
    md.append(f"{len(seeds)} seeds × {size['steps']} rollout steps × {size['prompts']} prompts, "
              f"{size['minibatches']} minibatches ({size['steps'] * size['minibatches']} optimizer "
              f"steps per row), held-out n={eval_n}; {seconds:.0f} s; {stamp(prov)}.")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablations.md").write_text("\n".join(md) + "\n")
    cols = ["table", "label", "G", "seed", "objective", "metric", "value"]
    pd.concat(longs, ignore_index=True)[cols].to_csv(out / "ablations.csv", index=False)
    write_meta(out / "ablations.json", prov, size=size, seeds=len(seeds), eval_n=eval_n,
               seconds=round(seconds), fig3_runs=str(fig3), runs=str(runs))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
