"""The noise floor: how far apart do two runs end that *should* be the same?

DFPO Min-Replace and Orth-Proj with `nodes="prefix"` give the same parameter gradient at every
step (docs/concepts/dfpo.md): in one tandem (same start, same prompt stream, same
sampling noise) they are gradient-identical twins, and they part only when float rounding (the
two transforms sum different numbers to the same zero) flips one sampled token. Whatever
separates them at the end is run-to-run noise, not an effect. GSPO runs in the same tandem, so
DFPO − GSPO is paired by seed (same start, same prompts) and the twins' spread says how small a
DFPO − GSPO difference these seeds can resolve.

Per seed and objective: training accuracy of the last 5 rollout steps, and held-out accuracy of
the final policy (`--eval-n` fresh problems at temperature 1, the same problems and sampling
seed for every objective: common random numbers). Reports
  - the twins' parting step (first rollout step whose rollout token count differs),
  - sd over seeds of the twin difference dfpo-min − dfpo-orth (the noise floor of a paired
    difference; one run's own spread is that / √2 when the twins are independent at the end),
  - DFPO − GSPO with its paired 95 % t interval (`gradlab.stats.paired_interval`),
  - seeds needed for a paired 95 % interval narrower than `--width` points
    (`gradlab.stats.seeds_needed`), from the twins' sd and from DFPO − GSPO's own sd.
Writes <out>/noise_floor.md, noise_floor.csv (seed, objective, metric, value, parted_at) and
noise_floor.json (numbers + provenance: code hash, commit, machine, command; per run used its
code hash, machine and whether it was reused). The per-seed values also go to
figures/noise_floor_seeds.csv and three held-out comparisons to figures/comparisons.csv
(experiment "noise_floor": dfpo-min − gspo, dfpo-orth − gspo and the twins dfpo-min −
dfpo-orth), all exploratory: not declared before the runs.

    python -m analyses.figures.noise_floor              # 10 seeds × 150 rollout steps × 8 prompts × G=8
    python -m analyses.figures.noise_floor --quick      # seconds, for tests
    python -m analyses.figures.noise_floor --reanalyse  # tables again from figures/noise_floor.csv
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.tools import comparisons
from analyses.tools.common import (
    FIGURES,
    QUICK,
    ROOT,
    final_accuracy,
    load_seeds,
    provenance,
    run_seeds,
    set_threads,
    stamp,
)
from gradlab import jsonio
from gradlab.stats import paired_interval, seeds_needed

TWINS = ("dfpo-min", "dfpo-orth")
OBJECTIVES = [*TWINS, "gspo"]
# probes off (only accuracy is read): ~3 × 150 × 0.13 s per seed on one thread
FULL = dict(steps=150, prompts=8, G=8, minibatches=4, instruments="off", trace_every=0,
            ckpt_every=50, progress=False)
METRICS = {"train_acc_last5": "training accuracy, last 5 rollout steps",
           "heldout_acc": "held-out accuracy of the final policy (temperature 1)"}


def parted_at(tidy: pd.DataFrame, seed: int) -> int | None:
    """First rollout step at which the twins' rollouts differ (token counts), None if never."""
    d = tidy[(tidy["seed"] == seed) & (tidy["metric"] == "reward")]
    w = d.pivot_table(index="step", columns="objective", values="tokens")
    diff = w.index[w[TWINS[0]] != w[TWINS[1]]]
    return int(diff[0]) if len(diff) else None


def scores(runs: Path, seeds, eval_n: int) -> pd.DataFrame:
    """Long table: seed, objective, metric, value (0..1), parted_at."""
    tidy = load_seeds(runs)
    rows = []
    for k in seeds:
        acc = tidy[(tidy["seed"] == k) & (tidy["metric"] == "accuracy")]
        p = parted_at(tidy, k)
        for n in OBJECTIVES:
            o = acc[acc["objective"] == n]
            rows += [{"seed": k, "objective": n, "metric": "train_acc_last5", "parted_at": p,
                      "value": o[o["step"] > o["step"].max() - 5]["value"].mean()},
                     {"seed": k, "objective": n, "metric": "heldout_acc", "parted_at": p,
                      "value": final_accuracy(runs / f"seed{k}", n, n=eval_n)}]
    return pd.DataFrame(rows)


def summarise(long: pd.DataFrame, width: float) -> dict:
    """Per metric: twin sd, DFPO − GSPO paired interval and the seeds needed (in points)."""
    out = {}
    for metric in METRICS:
        w = long[long["metric"] == metric].pivot(index="seed", columns="objective", values="value")
        twin = 100 * (w[TWINS[0]] - w[TWINS[1]])
        gap = paired_interval(100 * w["dfpo-min"], 100 * w["gspo"])
        sd_twin = float(twin.std(ddof=1))
        out[metric] = {
            "seeds": len(w), "twin_sd": sd_twin, "twin_mean": float(twin.mean()),
            "twin_mean_abs": float(twin.abs().mean()), "run_sd": sd_twin / np.sqrt(2),
            "sd_per_objective": {n: float(100 * w[n].std(ddof=1)) for n in OBJECTIVES},
            "dfpo_minus_gspo": gap,
            "seeds_needed_width": width,
            "seeds_needed_twin_sd": seeds_needed(sd_twin, width),
            "seeds_needed_dfpo_gspo_sd": seeds_needed(gap["sd"], width),
            "seeds_needed_halfwidth_twin_sd": seeds_needed(sd_twin, 2 * width),
            "seeds_needed_halfwidth_dfpo_gspo_sd": seeds_needed(gap["sd"], 2 * width)}
    return out


EXPERIMENT = "noise_floor"
# exploratory (not declared before the runs): DFPO against GSPO, and the twins against each other
PAIRS = [("dfpo-min", "gspo"), ("dfpo-orth", "gspo"), ("dfpo-min", "dfpo-orth")]


def publish(long: pd.DataFrame, out: Path, task: str = "arithmetic") -> pd.DataFrame:
    """noise_floor_seeds.csv (one row per seed and objective: heldout_acc, train_acc_last5,
    parted_at) and the experiment's rows of comparisons.csv (into figures/ when out lies under
    it); every objective takes the same optimizer steps on the same prompts."""
    key = dict(experiment=EXPERIMENT, task=task, layout="independent", matched="optimizer_steps")
    w = long.pivot_table(index=["seed", "objective"], columns="metric", values="value",
                         aggfunc="first").reset_index()
    parted = long.groupby("seed")["parted_at"].first()
    seeds = w.assign(parted_at=w["seed"].map(parted), **key)
    seeds = seeds[comparisons.SEED_KEYS + [*METRICS, "parted_at"]]
    rows = comparisons.compare(seeds, [({**key, "objective": a}, {**key, "objective": b}, False)
                                       for a, b in PAIRS])
    comparisons.publish(seeds, rows, EXPERIMENT, out, FIGURES)
    return rows


def markdown(summary: dict, parted: list, size: dict, eval_n: int, rows: pd.DataFrame,
             footer: str) -> str:
    """The noise-floor table, the exploratory held-out comparisons and a footer."""
    lines = ["| metric | seeds | twin sd (min − orth) | one run's sd (twin sd/√2) | "
             "DFPO − GSPO [95 % paired t interval], p | sd of DFPO − GSPO | seeds for width < "
             f"{summary['train_acc_last5']['seeds_needed_width']:g} (twin sd / DFPO−GSPO sd) |",
             "|---|---|---|---|---|---|---|"]
    for metric, s in summary.items():
        g = s["dfpo_minus_gspo"]
        lines.append(f"| {METRICS[metric]} | {s['seeds']} | {s['twin_sd']:.2f} | "
                     f"{s['run_sd']:.2f} | {g['mean']:+.2f} [{g['lo']:+.2f}, {g['hi']:+.2f}], "
                     f"p {g['p']:.2g} | {g['sd']:.2f} | {s['seeds_needed_twin_sd']} / "
                     f"{s['seeds_needed_dfpo_gspo_sd']} |")
    never = sum(p is None for p in parted)
    got = sorted(p for p in parted if p is not None)
    p_method = next(iter(summary.values()))["dfpo_minus_gspo"]["p_method"]
    lines += ["", f"Points (accuracy × 100); p: {p_method} test. Twins parted at rollout "
              f"steps {got}" + (f"; {never} pair(s) never parted" if never else "") + ". "
              f"{len(parted)} seeds × {size['steps']} rollout steps × {size['prompts']} prompts "
              f"× G={size['G']}, {size['minibatches']} minibatches; held-out n={eval_n}.", "",
              f"Held-out comparisons (experiment `{EXPERIMENT}` of `comparisons.csv`; per-seed "
              f"values in `{EXPERIMENT}_seeds.csv`), exploratory: not declared before the runs.",
              "", comparisons.markdown(rows), "", footer]
    return "\n".join(lines)


def _parted(long: pd.DataFrame) -> list:
    """Per seed (in seed order): the twins' parting step, None where they never parted."""
    first = long.groupby("seed")["parted_at"].first()
    return [None if pd.isna(x) else int(x) for x in first]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--seeds", type=int, help="number of seeds 0..n-1 (default 10; quick: 3)")
    p.add_argument("--steps", type=int, help="override the rollout steps")
    p.add_argument("--runs", help="default runs/noise_floor (quick: runs/noise_floor-quick)")
    p.add_argument("--out", help="folder for noise_floor.* (default figures/; quick: runs)")
    p.add_argument("--eval-n", type=int, help="held-out problems per policy (default 256)")
    p.add_argument("--width", type=float, default=5.0,
                   help="target width of the paired 95 %% interval, in points (default 5)")
    p.add_argument("--reuse-any-code", action="store_true",
                   help="reuse finished runs whatever code made them (recorded in the .json)")
    p.add_argument("--reanalyse", action="store_true", help="re-make noise_floor.md/.json, the "
                   "seeds file and the comparisons from OUT/noise_floor.csv (no training)")
    a = p.parse_args(argv)
    set_threads(1)
    if a.reanalyse:
        return reanalyse(Path(a.out or FIGURES), argv)
    n_seeds = a.seeds or (3 if a.quick else 10)
    size = dict(QUICK, instruments="off", trace_every=0) if a.quick else dict(FULL)
    if a.steps:
        size["steps"] = a.steps
    eval_n = a.eval_n or (16 if a.quick else 256)
    runs = Path(a.runs or ROOT / ("runs/noise_floor-quick" if a.quick else "runs/noise_floor"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    seeds, ledger = range(n_seeds), []
    t0, prov = time.time(), provenance("analyses.figures.noise_floor", argv)
    run_seeds(runs, seeds, ledger=ledger, reuse_any_code=a.reuse_any_code, objectives=OBJECTIVES,
              **size)
    long = scores(runs, seeds, eval_n)
    summary, parted = summarise(long, a.width), _parted(long)
    rows = publish(long, out)
    seconds = time.time() - t0
    footer = (f"{seconds:.0f} s; {stamp(prov)}" + ("; finished runs reused whatever code made "
              "them (--reuse-any-code)." if a.reuse_any_code else "."))
    md = markdown(summary, parted, size, eval_n, rows, footer)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise_floor.md").write_text(md + "\n")
    long.to_csv(out / "noise_floor.csv", index=False)
    meta = {"provenance": prov, "size": size, "seeds": n_seeds, "eval_n": eval_n,
            "parted_at": parted, "seconds": round(seconds), "summary": summary,
            "reuse_any_code": a.reuse_any_code, "run_provenance": ledger}
    (out / "noise_floor.json").write_text(jsonio.dumps(meta, indent=1))
    print(md)
    return 0


def reanalyse(out: Path, argv: list[str] | None) -> int:
    """noise_floor.md/.json, the seeds file and the comparisons again from OUT/noise_floor.csv
    (sizes, width and the runs' provenance from OUT/noise_floor.json)."""
    for f in ("noise_floor.csv", "noise_floor.json"):
        if not (out / f).is_file():
            print(f"noise_floor --reanalyse: {out / f} not found", file=sys.stderr)
            return 2
    long, meta = pd.read_csv(out / "noise_floor.csv"), json.loads((out / "noise_floor.json").read_text())
    width = meta["summary"]["train_acc_last5"]["seeds_needed_width"]
    summary, parted = summarise(long, width), _parted(long)
    rows = publish(long, out, meta["size"].get("task", "arithmetic"))
    made = meta.get("runs_made_by") or meta["provenance"]
    prov = provenance("analyses.figures.noise_floor", argv)
    when = ("per-run code hashes in noise_floor.json" if meta.get("run_provenance")
            else "before runs recorded their code")
    footer = (f"Runs made by `{made['command']}` at commit {made['commit'][:10]}"
              + (" with uncommitted changes" if made.get("dirty") else "")
              + f" in {meta['seconds']} s ({when}); tables re-made by {stamp(prov)}.")
    md = markdown(summary, parted, meta["size"], meta["eval_n"], rows, footer)
    (out / "noise_floor.md").write_text(md + "\n")
    meta.update(provenance=prov, runs_made_by=made, parted_at=parted, summary=summary,
                run_provenance=meta.get("run_provenance"))
    (out / "noise_floor.json").write_text(jsonio.dumps(meta, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
