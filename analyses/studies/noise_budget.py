"""The noise budget of a final held-out score: evaluation noise against training noise.

A held-out accuracy differs between two runs for two reasons: the runs ended in different places
(*training* noise: different seeds; or gradient-identical twins that part by float round-off)
and the evaluation itself drew different problems and samples (*evaluation* noise). Only the
first is what a comparison of objectives is about; the second should be made small.

Runs: per task, `--seeds` tandems at the size of the objectives × layouts experiment
(analyses/figures/tree_tandem.py, independent layout; probes off): DFPO Min-Replace and Orth-Proj —
gradient-identical twins at prefix nodes — and GSPO, from the same start.

Evaluation schemes (gradlab.loop.recipes.evaluation; each a function of the weights, N, K, eval seed):
  sampled N×K   N held-out problems, K samples each at temperature 1, share correct
  expected N    the exact probability that one sample is correct, mean over N problems
  expected all  the same over the whole held-out split (no draw at all: zero evaluation noise)
Evaluation noise of a scheme: sd of one checkpoint's score over `--eval-seeds` evaluation seeds
(each draws other problems and other samples), pooled (root mean square) over `--eval-ckpts`
checkpoints. Training noise: sd over training seeds of the whole-split expected accuracy (no
evaluation noise in it), pooled over the three objectives; and the twins' difference sd / √2
(round-off chaos alone). A scheme is good enough when its evaluation sd ≤ ¼ of the training sd.

Writes <out>/noise_budget.md, noise_budget.csv (task, scheme, checkpoint, eval_seed, value) and
noise_budget.json (the table, provenance).

    python -m analyses.studies.noise_budget            # 10 seeds per task (a few minutes a task)
    python -m analyses.studies.noise_budget --quick    # seconds, for tests
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.tools.common import (
    FIGURES,
    QUICK,
    ROOT,
    load_run_policy,
    provenance,
    run_seeds,
    set_threads,
    stamp,
)
from gradlab import jsonio
from gradlab.loop.recipes.evaluation import expected_accuracy, heldout_draw, sampled_accuracy

OBJECTIVES = ["dfpo-min", "dfpo-orth", "gspo"]
STEPS = {"arithmetic": 30, "scaffold": 20}  # the independent layout of tree_tandem.py
SIZE = dict(prompts=8, G=8, minibatches=4, instruments="off", trace_every=0, eval_every=0,
            progress=False)
# (name, kind, N, K): the loop's held-out protocol is "sampled 128×1" (eval_size 128)
SCHEMES = [("sampled 128×1", "sampled", 128, 1), ("sampled 256×1", "sampled", 256, 1),
           ("sampled 256×8", "sampled", 256, 8), ("sampled 1024×1", "sampled", 1024, 1),
           ("expected 128", "expected", 128, 1), ("expected 256", "expected", 256, 1),
           ("expected all", "expected", "all", 1)]
QUICK_SCHEMES = [("sampled 16×1", "sampled", 16, 1), ("expected 16", "expected", 16, 1),
                 ("expected all", "expected", "all", 1)]


def score(model, tok, task, kind: str, *, n, k: int, seed: int) -> float:
    """One scheme's score of one policy at one evaluation seed (0..1)."""
    probs = heldout_draw(task, n, seed + 1)  # seed 0 of the loop's set is one draw among many
    if kind == "expected":
        return float(expected_accuracy(model, tok, task, probs).mean())
    return float(sampled_accuracy(model, tok, task, probs, samples=k, temperature=1.0,
                                  seed=seed + 1).mean())


def measure(runs: Path, task: str, seeds, schemes, eval_seeds: int, eval_ckpts: int) -> pd.DataFrame:
    """Long table: task, scheme, seed, objective, eval_seed, value."""
    rows = []
    for k in seeds:
        for obj in OBJECTIVES:
            model, tok, t, _ = load_run_policy(runs / f"seed{k}", obj)
            noisy = k < eval_ckpts and obj == OBJECTIVES[-1]  # eval noise on a few checkpoints
            for name, kind, n, kk in schemes:
                reps = range(eval_seeds) if noisy and n != "all" else range(1)
                if n == "all" or noisy or name == schemes[0][0]:
                    rows += [{"task": task, "scheme": name, "seed": k, "objective": obj,
                              "eval_seed": e,
                              "value": score(model, tok, t, kind, n=n, k=kk, seed=e)}
                             for e in reps]
    return pd.DataFrame(rows)


def budget(long: pd.DataFrame) -> pd.DataFrame:
    """Per task and scheme: evaluation sd, training sd, their ratio (points)."""
    out = []
    for task, d in long.groupby("task", sort=False):
        whole = d[d["scheme"] == "expected all"].pivot_table(index="seed", columns="objective",
                                                            values="value")
        train_sd = 100 * float(np.sqrt(whole.var(ddof=1).mean()))  # pooled over objectives
        twin_sd = 100 * float((whole["dfpo-min"] - whole["dfpo-orth"]).std(ddof=1) / np.sqrt(2))
        for scheme, s in d.groupby("scheme", sort=False):
            reps = s.groupby(["seed", "objective"])["value"]
            var = reps.var(ddof=1).dropna()
            eval_sd = 0.0 if scheme == "expected all" else (
                100 * float(np.sqrt(var.mean())) if len(var) else float("nan"))
            out.append({"task": task, "scheme": scheme, "eval_sd": eval_sd,
                        "train_sd": train_sd, "twin_sd": twin_sd,
                        "ratio": eval_sd / train_sd if train_sd > 0 else float("nan"),
                        "ok": bool(eval_sd <= 0.25 * train_sd),
                        "checkpoints": int(var.size), "train_seeds": int(len(whole))})
    return pd.DataFrame(out)


def power(long: pd.DataFrame, family: int = 30) -> pd.DataFrame:
    """Per task, from the whole-split expected accuracy (no evaluation noise): the sd of a paired
    difference between objectives (DFPO-min − GSPO), the seeds a 95 % half-width of 2.5 points
    needs, and the seeds an exact sign-flip p needs to survive Holm over `family` comparisons
    (2 / 2^n ≤ 0.05 / family)."""
    from gradlab.stats import detectable, seeds_needed

    rows = []
    for task, d in long[long["scheme"] == "expected all"].groupby("task", sort=False):
        w = 100 * d.pivot_table(index="seed", columns="objective", values="value")
        sd = float((w["dfpo-min"] - w["gspo"]).std(ddof=1))
        rows.append({"task": task, "sd of dfpo-min − gspo": sd,
                     "seeds for half-width 2.5": seeds_needed(sd, 5.0),
                     "half-width at 10 seeds": detectable(sd, 10),
                     f"seeds for p to survive Holm over {family}":
                         int(np.ceil(np.log2(2 * family / 0.05)))})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame, prov: dict, seconds: float, n_seeds: int,
             pw: pd.DataFrame | None = None) -> str:
    t = table.assign(**{c: table[c].map(lambda x: f"{x:.2f}") for c in
                        ("eval_sd", "train_sd", "twin_sd", "ratio")})
    t["ok"] = t["ok"].map({True: "yes", False: "no"})
    return "\n".join([
        "# Noise budget of a held-out score", "",
        "Points (accuracy × 100). eval_sd: sd of one checkpoint's score over evaluation seeds "
        "(other problems, other samples), pooled over checkpoints; train_sd: sd over training "
        "seeds of the whole-split expected accuracy, pooled over DFPO-min, DFPO-orth and GSPO; "
        "twin_sd: the round-off twins' difference sd / √2. ok: eval_sd ≤ ¼ train_sd.", "",
        t.rename(columns={"ok": "eval ≤ ¼ train"}).to_markdown(index=False), "",
        *(["Seeds by power, from the paired differences without evaluation noise:", "",
           pw.to_markdown(index=False, floatfmt=".2f"), ""] if pw is not None else []),
        f"{n_seeds} training seeds per task; {seconds:.0f} s; {stamp(prov)}."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--tasks", default="arithmetic,scaffold")
    p.add_argument("--seeds", type=int, help="training seeds 0..n-1 (default 10; quick 3)")
    p.add_argument("--eval-seeds", type=int, default=5, help="evaluation seeds per checkpoint")
    p.add_argument("--eval-ckpts", type=int, default=3, help="checkpoints whose eval noise is measured")
    p.add_argument("--runs", help="default runs/noise_budget (quick: runs/noise_budget-quick)")
    p.add_argument("--out", help="folder for noise_budget.* (default figures/; quick: the runs folder)")
    p.add_argument("--from-csv", help="re-make the tables from an earlier noise_budget.csv "
                   "(no training; its .json's provenance is kept as runs_made_by)")
    a = p.parse_args(argv)
    if a.from_csv:
        return remake(Path(a.from_csv), Path(a.out or FIGURES), argv)
    set_threads(1)
    n_seeds = a.seeds or (3 if a.quick else 10)
    runs = Path(a.runs or ROOT / ("runs/noise_budget-quick" if a.quick else "runs/noise_budget"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    t0, prov, ledger, longs = time.time(), provenance("analyses.studies.noise_budget", argv), [], []
    for task in a.tasks.split(","):
        size = dict(QUICK, instruments="off", trace_every=0, G=8) if a.quick else dict(
            SIZE, steps=STEPS[task])
        run_seeds(runs / task, range(n_seeds), ledger=ledger, objectives=OBJECTIVES, task=task,
                  **size)
        longs.append(measure(runs / task, task, range(n_seeds), QUICK_SCHEMES if a.quick else SCHEMES,
                             2 if a.quick else a.eval_seeds, a.eval_ckpts))
    long = pd.concat(longs, ignore_index=True)
    table, pw = budget(long), power(long)
    seconds = time.time() - t0
    md = markdown(table, prov, seconds, n_seeds, pw)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise_budget.md").write_text(md + "\n")
    long.to_csv(out / "noise_budget.csv", index=False)
    (out / "noise_budget.json").write_text(jsonio.dumps(
        {"provenance": prov, "runs": ledger, "seeds": n_seeds, "seconds": round(seconds),
         "table": table.to_dict("records"), "power": pw.to_dict("records")}, indent=1,
        default=str))
    print(md)
    return 0


def remake(csv: Path, out: Path, argv: list[str] | None) -> int:
    """noise_budget.md/.json again from a stored noise_budget.csv (and its .json)."""
    long = pd.read_csv(csv)
    meta_path = csv.with_suffix(".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    made = meta.get("runs_made_by") or meta.get("provenance")
    table, pw = budget(long), power(long)
    prov = provenance("analyses.studies.noise_budget", argv)
    md = markdown(table, made or prov, meta.get("seconds", 0), int(long["seed"].nunique()), pw)
    md += f"\n\nTables re-made from `{csv.name}` by {stamp(prov)}."
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise_budget.md").write_text(md + "\n")
    if csv.resolve() != (out / "noise_budget.csv").resolve():
        long.to_csv(out / "noise_budget.csv", index=False)
    meta.update(provenance=prov, runs_made_by=made, table=table.to_dict("records"),
                power=pw.to_dict("records"))
    (out / "noise_budget.json").write_text(jsonio.dumps(meta, indent=1, default=str))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
