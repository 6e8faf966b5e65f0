"""Figure 3: training curves of DFPO (both transforms), GSPO and GRPO at matched compute.

Trains the tandem loop once per seed (`gradlab.loop.train.train` → runs/figure3/seed{k}: every
objective starts from the same weights and sees the same prompt stream), reads the folders with
`gradlab.load_run` (the tidy table: run, objective, seed, step, tokens, metric, value), puts each
seed's curve on a common rollout-token grid (linear interpolation: seeds consume different
token counts) and draws mean and 95 % band over seeds with
`gradlab.viz.curves.training_curves`:

  figure3.png              accuracy vs rollout tokens (the paper's Figure 3) and reward where it
                           differs from accuracy; on the built-in tasks the two are equal, so the
                           second panel is the token entropy
  figure3_diagnostics.png  beyond the paper: ρ per step (full-group and trie nodes), the
                           learning-tax drift (cumulative KL at fixed shared probe contexts),
                           ‖g_tax‖/‖g_total‖, token entropy, equal-solution log-odds
  figure3_paired.png       each objective's training accuracy minus GSPO's, paired by seed (same
                           start, same prompts), against optimizer steps (every objective takes
                           the same number: the compute-matched axis), mean and 95 % band
  figure3.csv              the tidy table behind both: plotted metrics, raw (before interpolation)
  figure3.md, figure3.json per objective: held-out accuracy of the final policy (the exact
                           expected accuracy over the whole held-out split: no evaluation
                           noise, analyses.tools.common.heldout) and last-5-steps
                           training accuracy, mean [95 % t interval] over seeds, the paired
                           difference to GSPO [95 % paired t interval, p], measured ρ, tax share,
                           drift and tokens (analyses.tools.common.paired_table); provenance
                           (commit, threads, command), size, seconds.

    python -m analyses.figures.figure3           # full: 5 seeds × 150 steps × 8 prompts × G=8
    python -m analyses.figures.figure3 --quick   # seconds: runs/figure3-quick, for tests
    python -m analyses.figures.figure3 --replot  # redraw the PNGs from figures/figure3.csv (no runs)
Finished seed folders are reused (delete runs/figure3 to retrain).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd

from analyses.tools import comparisons
from analyses.tools.common import (
    FIGURES,
    QUICK,
    ROOT,
    load_seeds,
    paired_table,
    per_seed,
    provenance,
    run_seeds,
    set_threads,
    stamp,
    write_meta,
)
from gradlab import jsonio
from gradlab import viz as plots
from gradlab.viz.seeds import align_tokens

OBJECTIVES = ["dfpo-min", "dfpo-orth", "gspo", "grpo"]
LABELS = {"dfpo-min": "DFPO (Min-Replace)", "dfpo-orth": "DFPO (Orth-Proj)",
          "gspo": "GSPO (baseline)", "grpo": "GRPO (token mean)"}
FULL = dict(steps=150, prompts=8, G=8, minibatches=4, tax_every=5, progress=True)
MAIN = [("accuracy", "accuracy (training samples, temperature 1)"),
        ("reward", "reward")]
ENTROPY = ("entropy", "token entropy (nats)")
BEYOND = [("rho_prefix", "cancellation ratio ρ, full-group nodes"),
          ("rho_trie", "cancellation ratio ρ, trie nodes"),
          ("probe_kl", "learning-tax drift: cumulative KL at shared probe contexts (nats)"),
          ("tax_share", "‖g_tax‖ / ‖g_total‖"),
          ("entropy", "token entropy (nats)"),
          ("logodds", "equal-solution log-odds log π(a)/π(b)")]


def paired_curves(tidy: pd.DataFrame, minibatches: int, base: str = "gspo") -> pd.DataFrame:
    """Tidy rows per (seed, objective ≠ base, rollout step): `accuracy − base` (points) and
    `tokens vs base` (rollout tokens consumed so far, % above base's), x = optimizer steps
    taken by then ((step + 1) · minibatches; equal for every objective)."""
    acc = tidy[tidy["metric"] == "accuracy"]
    wide = {c: acc.pivot_table(index=["run", "seed", "step"], columns="objective", values=c)
            for c in ("value", "tokens")}
    rows = []
    for obj in wide["value"].columns.drop(base):
        d = (100 * (wide["value"][obj] - wide["value"][base])).rename("value").reset_index()
        rows.append(d.assign(objective=obj, metric=f"accuracy − {base}"))
        t = (100 * (wide["tokens"][obj] / wide["tokens"][base] - 1)).rename("value").reset_index()
        rows.append(t.assign(objective=obj, metric=f"tokens vs {base}"))
    out = pd.concat(rows, ignore_index=True)
    out["optimizer steps"] = (out["step"] + 1) * minibatches
    return out


def main_panels(tidy: pd.DataFrame) -> list[tuple[str, str]]:
    """Accuracy, then reward only where it differs from accuracy (a binary verifier makes them
    the same curve), else the token entropy."""
    def metric(m):
        return tidy[tidy["metric"] == m].set_index(["run", "objective", "step"])["value"]

    acc, reward = metric("accuracy"), metric("reward")
    same = len(reward) == len(acc) and reward.reindex(acc.index).equals(acc)
    return [MAIN[0], ENTROPY if same or reward.empty else MAIN[1]]


def draw(tidy: pd.DataFrame, out: Path, minibatches: int, smooth: int = 1) -> None:
    """figure3.png, figure3_diagnostics.png, figure3_paired.png from the tidy table."""
    steps = int(tidy["step"].max()) + 1
    aligned = align_tokens(tidy, n=min(40, steps * 4))
    out.mkdir(parents=True, exist_ok=True)
    plots.save(plots.training_curves(aligned, main_panels(tidy), smooth=smooth), out / "figure3.png")
    plots.save(plots.training_curves(aligned, BEYOND, smooth=smooth),
               out / "figure3_diagnostics.png")
    diff = paired_curves(tidy, minibatches)
    title = ("paired by seed (same start, same prompts), at equal optimizer steps; "
             "mean and 95 % band over seeds")
    plots.save(plots.training_curves(diff, [("accuracy − gspo", "training accuracy − GSPO's (points)"),
                                           ("tokens vs gspo", "rollout tokens consumed vs GSPO's (%)")],
                                     x="optimizer steps", smooth=max(smooth, 5), title=title),
               out / "figure3_paired.png")


EXPERIMENT = "figure3"
# declared before the runs: the paper's claim, DFPO above GSPO at the same updates
PRIMARY = [("dfpo-min", "gspo"), ("dfpo-orth", "gspo")]


def publish(wide: pd.DataFrame, out: Path, task: str) -> pd.DataFrame:
    """figure3_seeds.csv (or <task>'s) and the experiment's rows of figures/comparisons.csv:
    every objective takes the same optimizer steps on the same prompts (matched: updates)."""
    exp = EXPERIMENT if task == "arithmetic" else f"{EXPERIMENT}-{task}"
    seeds = wide.assign(experiment=exp, task=task, layout="independent",
                        matched="optimizer_steps")
    seeds = seeds[comparisons.SEED_KEYS + [c for c in wide.columns if c not in comparisons.SEED_KEYS]]
    key = dict(experiment=exp, task=task, layout="independent", matched="optimizer_steps")
    pairs = [({**key, "objective": a}, {**key, "objective": "gspo"}, (a, "gspo") in PRIMARY)
             for a in OBJECTIVES if a != "gspo"]
    rows = comparisons.compare(seeds, pairs)
    comparisons.publish(seeds, rows, exp, out, FIGURES)
    return rows


def make(runs: Path, out: Path, *, seeds, size: dict, smooth: int = 1,
         ledger: list | None = None, reuse_any_code: bool = False) -> pd.DataFrame:
    """Train (or reuse) the seeds, draw the figures, write the CSV; returns the tidy table."""
    run_seeds(runs, seeds, ledger=ledger, reuse_any_code=reuse_any_code, objectives=OBJECTIVES,
              **size)
    tidy = load_seeds(runs)
    tidy = tidy[tidy["seed"].isin(list(seeds))]
    draw(tidy, out, size["minibatches"], smooth)
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
    p.add_argument("--eval-n", type=int, help="fresh problems per final policy when a run has "
                   "no eval_accuracy (default 256)")
    p.add_argument("--task", help="arithmetic (default) or scaffold; runs are held out by "
                   "the loop's --eval-every (default 10): eval_accuracy is the held-out score")
    p.add_argument("--replot", action="store_true", help="redraw the PNGs from OUT/figure3.csv "
                   "and the size in OUT/figure3.json (no training, no run folders needed)")
    p.add_argument("--reanalyse", action="store_true", help="re-make the table, the seeds file "
                   "and the comparisons from OUT/figure3.json's per-seed values (no training)")
    p.add_argument("--reuse-any-code", action="store_true",
                   help="reuse finished runs whatever code made them (recorded in the .json)")
    a = p.parse_args(argv)
    set_threads(1)
    if a.replot:
        out = Path(a.out or FIGURES)
        size = json.loads((out / "figure3.json").read_text())["size"]
        draw(pd.read_csv(out / "figure3.csv"), out, size["minibatches"], smooth=3)
        print(f"figure3 → {out}/figure3.png, figure3_diagnostics.png, figure3_paired.png "
              f"(redrawn from {out / 'figure3.csv'})")
        return 0
    if a.reanalyse:
        return reanalyse(Path(a.out or FIGURES), argv)
    a.seeds = a.seeds or (2 if a.quick else 5)
    size = dict(QUICK) if a.quick else dict(FULL)
    if a.steps:
        size["steps"] = a.steps
    if a.task:
        size["task"] = a.task
    eval_n = a.eval_n or (16 if a.quick else 256)
    runs = Path(a.runs or ROOT / ("runs/figure3-quick" if a.quick else "runs/figure3"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    t0, prov, ledger = time.time(), provenance("analyses.figures.figure3", argv), []
    make(runs, out, seeds=range(a.seeds), size=size, smooth=1 if a.quick else 3, ledger=ledger,
         reuse_any_code=a.reuse_any_code)
    wide = per_seed(runs, range(a.seeds), OBJECTIVES, eval_n, exact_n=32 if a.quick else None)
    table = paired_table(wide, LABELS)
    publish(wide, out, size.get("task", "arithmetic"))
    seconds = time.time() - t0
    src = ", ".join(sorted(set(wide["heldout_source"])))
    md = [f"Mean [95 % t interval] over seeds; difference to GSPO paired by seed [95 % paired "
          f"t interval], p (exact sign-flip); held-out source: {src}", "", table.drop(columns="objective").to_markdown(index=False), "",
          f"{a.seeds} seeds × {size['steps']} rollout steps × {size['prompts']} prompts × "
          f"G={size['G']}, {size['minibatches']} minibatches ({size['steps'] * size['minibatches']} "
          f"optimizer steps per objective); {seconds:.0f} s; {stamp(prov)}."]
    (out / "figure3.md").write_text("\n".join(md) + "\n")
    write_meta(out / "figure3.json", prov, size=size, seeds=a.seeds, eval_n=eval_n,
               seconds=round(seconds), runs=str(runs), table=table.to_dict("records"),
               per_seed=wide.to_dict("records"), primary=PRIMARY, run_provenance=ledger)
    print("\n".join(md))
    print(f"figure3 → {out}/figure3.png, figure3_diagnostics.png, figure3_paired.png, "
          f"figure3.csv, figure3.md, figure3.json in {seconds:.0f} s")
    return 0


def reanalyse(out: Path, argv: list[str] | None) -> int:
    """The table, seeds file and comparisons again from OUT/figure3.json's per-seed values."""
    meta = json.loads((out / "figure3.json").read_text())
    wide, size = pd.DataFrame(meta["per_seed"]), meta["size"]
    table = paired_table(wide, LABELS)
    publish(wide, out, size.get("task", "arithmetic"))
    made = meta.get("runs_made_by") or meta["provenance"]
    md = ["Mean [95 % t interval] over seeds; difference to GSPO paired by seed [95 % paired t "
          "interval], p (exact sign-flip); held-out source: "
          f"{', '.join(sorted(set(wide['heldout_source'])))}", "",
          table.drop(columns="objective").to_markdown(index=False), "",
          f"{meta['seeds']} seeds × {size['steps']} rollout steps × {size['prompts']} prompts × "
          f"G={size['G']}, {size['minibatches']} minibatches; runs made by `{made['command']}` at "
          f"commit {made['commit'][:10]} (before runs recorded their code); table re-made by "
          f"{stamp(provenance('analyses.figures.figure3', argv))}."]
    (out / "figure3.md").write_text("\n".join(md) + "\n")
    meta.update(table=table.to_dict("records"), runs_made_by=made, primary=PRIMARY,
                provenance=provenance("analyses.figures.figure3", argv))
    (out / "figure3.json").write_text(jsonio.dumps(meta, indent=1, default=str))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
