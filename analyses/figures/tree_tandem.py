"""The tandem on counterfactual rollouts: independent vs tree vs repair groups, for GRPO, GSPO,
DFPO (Min-Replace) and IBPO, at matched generated tokens and at matched optimizer steps.

For each task and layout a tandem trains every objective from the same start on the same prompt
stream (one tandem per seed: runs/tree_tandem/<task>/<layout>/seed{k}). Layouts:
  independent  G samples per prompt
  tree         --rollout tree --roots 1 --branches 7 --branch-token alternative (a star of seven
               alternative decisions off one root: the most informative branch points per
               generated token in figures/rollout_layouts.md)
  repair       --rollout repair --repair resample (4 tries); adds ibpo[form=repair]
Two compute rules, both reported (`matched`):
  generated_tokens  each layout's rollout steps are the independent layout's × (independent
                    generated tokens per step / the layout's), from figures/rollout_layouts.csv
                    (what sampling costs); runs/…/<layout>/seed{k}
  optimizer_steps   every layout takes the independent layout's rollout steps (the same number
                    of updates; a tree step trains more tokens); runs/…/<layout>-steps/seed{k}
The independent layout is the same runs under both rules.

Primary comparisons, declared before the runs (PRIMARY; Holm-adjusted within each rule's family
of task × layout × comparison), all on held-out accuracy:
  IBPO − GRPO, IBPO − GSPO, DFPO (Min-Replace) − GSPO, and the dose of IBPO's local term:
  GRPO + λ·la − GRPO for λ = 0.5, 1, 2 (`ibpo[la_weight=λ]`; λ = 1 is IBPO itself, listed once;
  λ = 0 is form `ga`, whose update is GRPO's, so it is not trained twice).
Everything else (layout − independent for one objective, ibpo[form=repair] − GSPO, …) is
exploratory: interval and p, no Holm.

Held-out accuracy (`heldout_acc`) is the exact expected accuracy of the final policy over the
whole held-out split (gradlab.loop.recipes.evaluation: no evaluation noise, figures/noise_budget.md);
the loop's sampled score (`eval_accuracy`, one sample for each of 128 problems) is kept as
`heldout_sampled`. Intervals: paired Student-t over seeds, p exact sign-flip
(gradlab.stats.paired_interval). Writes figures/tree_tandem.csv (tidy, generated-token rule:
task, layout, seed, objective, metric, value), tree_tandem_seeds.csv (every run: the seeds file
of analyses/tools/comparisons.py), the experiment's rows of comparisons.csv, tree_tandem.md, .json
(provenance of every run used: code hash, machine, reused) and .png.

    python -m analyses.figures.tree_tandem                  # 3 seeds; arithmetic 30 and scaffold 20 steps
    python -m analyses.figures.tree_tandem --seeds 11 --jobs 2  # the seeds figures/noise_budget.md asks for
    python -m analyses.figures.tree_tandem --quick          # seconds: runs/tree_tandem-quick, for tests
A run folder is reused only when the current code made it (gradlab.provenance); --reuse-any-code
reuses finished runs of other code and says so in the .json.
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
    fmt_ci,
    load_run_policy,
    load_seeds,
    mean_ci,
    provenance,
    run_jobs,
    set_threads,
    stamp,
    write_meta,
)
from gradlab.loop.recipes.evaluation import expected_accuracy, heldout_split

EXPERIMENT = "tree_tandem"
OBJECTIVES = ["grpo", "gspo", "dfpo-min", "ibpo", "ibpo[la_weight=0.5]", "ibpo[la_weight=2]"]
LAYOUTS = {
    "independent": {},
    "tree": dict(rollout="tree", roots=1, branches=7, branch_token="alternative"),
    "repair": dict(rollout="repair", repair="resample", repair_tries=4),
}
EXTRA = {"repair": ["ibpo[form=repair]"]}  # objectives that need the layout's rows
CSV_LABEL = {"independent": "independent", "tree": "tree star alternative", "repair": "repair"}
STEPS = {"arithmetic": 30, "scaffold": 20}
MATCHED = ("generated_tokens", "optimizer_steps")
# (a, b): declared before the runs; per task, layout and compute rule
PRIMARY = [("ibpo", "grpo"), ("ibpo", "gspo"), ("dfpo-min", "gspo"),
           ("ibpo[la_weight=0.5]", "grpo"), ("ibpo[la_weight=2]", "grpo")]


def layout_steps(task: str, steps: int, table: Path = FIGURES / "rollout_layouts.csv") -> dict:
    """Rollout steps per layout at the independent layout's generated tokens (see docstring)."""
    df = pd.read_csv(table).set_index(["task", "layout"])
    ind = float(df.loc[(task, "independent"), "generated_tokens"])
    return {lay: max(1, round(steps * ind / float(df.loc[(task, CSV_LABEL[lay]), "generated_tokens"])))
            for lay in LAYOUTS}


def plan(task: str, steps: int) -> list[tuple[str, str, int, str]]:
    """(layout, matched, rollout steps, run folder name) for every run group of a task; the
    independent layout serves both rules."""
    gen = layout_steps(task, steps)
    out = []
    for lay in LAYOUTS:
        out.append((lay, "generated_tokens", gen[lay], lay))
        out.append((lay, "optimizer_steps", steps, lay if gen[lay] == steps else f"{lay}-steps"))
    return out


def per_run(tidy: pd.DataFrame, runs: Path, split: list) -> pd.DataFrame:
    """One row per (seed, objective): the figures the tables report, from the run store, and
    the exact expected held-out accuracy of the final checkpoint over the whole split."""
    rows = []
    for (run, obj), o in tidy.groupby(["run", "objective"]):
        def m(name, o=o):
            return o[o["metric"] == name].sort_values("step")["value"]
        ev, ent = m("eval_accuracy"), m("entropy")
        model, tok, task, cfg = load_run_policy(runs / run, obj)
        rows.append({"seed": int(run.removeprefix("seed")), "objective": obj,
                     "heldout_acc": float(expected_accuracy(model, tok, task, split).mean()),
                     "heldout_sampled": float(ev.iloc[-1]) if len(ev) else float("nan"),
                     "tax_share": m("tax_share").mean(), "rho_prefix": m("rho_prefix").mean(),
                     "rho_trie": m("rho_trie").mean(), "entropy_first": float(ent.iloc[0]),
                     "entropy_last": float(ent.iloc[-1]),
                     "nonfinite_steps": float(m("nonfinite_steps").sum()),
                     "generated_tokens": float(m("generated_tokens").sum()),
                     "trained_tokens": float(o["tokens"].max()),
                     "informative_per_1k": m("informative_per_1k").mean(),
                     "adv_branch_share": m("adv_branch_share").mean(),
                     "steps": int(o["step"].max()) + 1,
                     "optimizer_steps": (int(o["step"].max()) + 1) * cfg.minibatches})
    return pd.DataFrame(rows)


def pairs(seeds: pd.DataFrame) -> list[tuple[dict, dict, bool]]:
    """The primary pairs and the exploratory ones (layout − independent, others − GSPO)."""
    out = []
    for (exp, task, layout, matched), d in seeds.groupby(["experiment", "task", "layout", "matched"],
                                                         sort=False):
        key = dict(experiment=exp, task=task, layout=layout, matched=matched)
        objs = list(dict.fromkeys(d["objective"]))
        declared = set(PRIMARY)
        out += [({**key, "objective": a}, {**key, "objective": b}, True)
                for a, b in PRIMARY if a in objs and b in objs]
        out += [({**key, "objective": a}, {**key, "objective": "gspo"}, False) for a in objs
                if a != "gspo" and (a, "gspo") not in declared]
        if layout != "independent":
            out += [({**key, "objective": a}, {**key, "layout": "independent", "objective": a},
                     False) for a in objs]
    return out


def table(wide: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """Per (task, layout, matched, objective): held-out accuracy [95 % t], − GSPO, measures."""
    out = []
    for (task, layout, matched, obj), o in wide.groupby(["task", "layout", "matched", "objective"],
                                                      sort=False):
        c = rows[(rows["task"] == task) & (rows["layout"] == layout) & (rows["matched"] == matched)]
        vs = c[(c["a"] == obj) & (c["b"] == "gspo")]
        out.append({
            "task": task, "layout": layout, "matched": matched, "objective": obj,
            "seeds": len(o), "held-out acc. (%)": fmt_ci(*mean_ci(o["heldout_acc"])),
            "− GSPO (points)": comparisons.fmt(vs.iloc[0]) if len(vs) else "—",
            "tax share": f"{o['tax_share'].mean():.3g}", "ρ prefix": f"{o['rho_prefix'].mean():.2g}",
            "entropy first → last": f"{o['entropy_first'].mean():.3f} → {o['entropy_last'].mean():.3f}",
            "non-finite steps": int(o["nonfinite_steps"].sum()),
            "generated tokens": f"{o['generated_tokens'].mean():.0f}",
            "trained tokens": f"{o['trained_tokens'].mean():.0f}",
            "optimizer steps": int(o["optimizer_steps"].iloc[0])})
    return pd.DataFrame(out)


def figure(wide: pd.DataFrame, path: Path) -> None:
    """Held-out accuracy per objective (mean, 95 % t interval over seeds), hue = layout; one
    column per task, one row per compute rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks, rules = list(dict.fromkeys(wide["task"])), list(dict.fromkeys(wide["matched"]))
    fig, axes = plt.subplots(len(rules), len(tasks), figsize=(6.5 * len(tasks), 3.6 * len(rules)),
                             squeeze=False)
    colours = dict(zip(LAYOUTS, ("tab:blue", "tab:orange", "tab:green")))
    for i, rule in enumerate(rules):
        for j, task in enumerate(tasks):
            ax, d = axes[i, j], wide[(wide["task"] == task) & (wide["matched"] == rule)]
            objs = list(dict.fromkeys(d["objective"]))
            for k, lay in enumerate(LAYOUTS):
                for x, obj in enumerate(objs):
                    v = 100 * d[(d["layout"] == lay) & (d["objective"] == obj)]["heldout_acc"]
                    if len(v):
                        m, lo, hi = mean_ci(v)
                        ax.errorbar(x + (k - 1) * 0.22, m, yerr=[[m - lo], [hi - m]], fmt="o",
                                    color=colours[lay], capsize=3,
                                    label=lay if x == 0 else None)
            ax.set_xticks(range(len(objs)), objs, rotation=20, ha="right")
            ax.set(ylabel="held-out accuracy (%)", title=f"{task}, matched {rule.replace('_', ' ')}")
            ax.grid(axis="y", alpha=0.3)
    axes[0, -1].legend(title="layout", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle("Objectives × rollout layouts: mean and 95 % t interval over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def train_and_measure(a, task: str, seeds, objs: list, runs: Path, ledger: list) -> pd.DataFrame:
    """Train (or reuse) every run group of a task, then one row per (layout, matched, seed,
    objective)."""
    from gradlab.loop.setup.task import get_task

    groups = plan(task, a.steps or (2 if a.quick else STEPS[task]))
    jobs = []
    for k in seeds:  # seed-major: a run cut short still has every layout of its first seeds
        for layout, _, steps, folder in dict((g[3], g) for g in groups).values():
            size = dict(QUICK, G=8, prompts=2) if a.quick else dict(
                prompts=8, G=8, minibatches=4, tax_every=5, progress=False)
            size.update(steps=steps, eval_every=steps, ckpt_every=steps, task=task,
                        eval_size=16 if a.quick else 128)
            jobs.append((runs / task / folder, k, a.reuse_any_code,
                         dict(objectives=objs + EXTRA.get(layout, []), **LAYOUTS[layout], **size)))
    run_jobs(jobs, a.jobs, ledger)
    split = heldout_split(get_task(task))[: 32 if a.quick else None]
    measured, out = {}, []
    for layout, matched, _, folder in groups:
        if folder not in measured:
            tidy = load_seeds(runs / task / folder)
            measured[folder] = per_run(tidy[tidy["run"].isin([f"seed{k}" for k in seeds])],
                                       runs / task / folder, split)
        out.append(measured[folder].assign(task=task, layout=layout, matched=matched))
    return pd.concat(out, ignore_index=True)


def from_csv(path: Path) -> pd.DataFrame:
    """Per-run rows from an earlier tree_tandem.csv (tidy, one compute rule: generated tokens)."""
    d = pd.read_csv(path)
    wide = d.pivot_table(index=["task", "layout", "seed", "objective"], columns="metric",
                         values="value").reset_index()
    # those runs took 4 optimizer steps per rollout step and did not record trained tokens
    extra = {"optimizer_steps": wide["steps"].astype(int) * 4} if "optimizer_steps" not in wide else {}
    if "trained_tokens" not in wide:
        extra["trained_tokens"] = np.nan
    return wide.assign(matched="generated_tokens", **extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--tasks", default="arithmetic,scaffold")
    p.add_argument("--seeds", help="seeds 0..n-1: a number, or per task 'arithmetic=3,scaffold=2' "
                   "(default 3; quick 1)")
    p.add_argument("--steps", type=int, help="independent layout's rollout steps (default per task)")
    p.add_argument("--objectives", help=f"comma-separated (default {','.join(OBJECTIVES)})")
    p.add_argument("--runs", help="default runs/tree_tandem (quick: runs/tree_tandem-quick)")
    p.add_argument("--out", help="folder for tree_tandem.* (default figures/; quick: the runs folder)")
    p.add_argument("--reuse-any-code", action="store_true",
                   help="reuse finished runs whatever code made them (recorded in the .json)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own "
                   "process with one torch thread (default 1)")
    p.add_argument("--name", default=EXPERIMENT, help="the experiment's name: its files "
                   "(NAME.md, NAME_seeds.csv, …) and its rows in comparisons.csv (default "
                   f"{EXPERIMENT})")
    p.add_argument("--from-csv", help="re-analyse the per-run values of an earlier "
                   "tree_tandem.csv instead of training (no provenance: said in the outputs)")
    a = p.parse_args(argv)
    set_threads(1)
    per_task = dict(x.split("=") for x in a.seeds.split(",")) if a.seeds and "=" in a.seeds else {}
    default = int(a.seeds) if a.seeds and not per_task else (1 if a.quick else 3)
    runs = Path(a.runs or ROOT / ("runs/tree_tandem-quick" if a.quick else "runs/tree_tandem"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    objs = a.objectives.split(",") if a.objectives else OBJECTIVES
    t0, prov, ledger, parts = time.time(), provenance("analyses.figures.tree_tandem", argv), [], []
    if a.from_csv:
        wide = from_csv(Path(a.from_csv))
    else:
        for task in a.tasks.split(","):
            seeds = range(int(per_task.get(task, default)))
            parts.append(train_and_measure(a, task, seeds, objs, runs, ledger))
        wide = pd.concat(parts, ignore_index=True)
    seeds_df = wide.assign(experiment=a.name)
    seeds_df = seeds_df[comparisons.SEED_KEYS + [c for c in wide.columns if c not in comparisons.SEED_KEYS]]
    rows = comparisons.compare(seeds_df, pairs(seeds_df))
    seconds = time.time() - t0
    write_outputs(out, seeds_df, rows, prov=prov, ledger=ledger, seconds=seconds, a=a)
    return 0


def unrecorded_runs(seeds_df: pd.DataFrame, made_by: dict,
                    root: str = "runs/tree_tandem") -> list[dict]:
    """Provenance rows for runs made before runs recorded their code: one per (task, layout,
    seed) of `seeds_df`, with what `made_by` (the commit and command that trained them) knows;
    code hash and CPU are None (unrecorded), never guessed."""
    keys = seeds_df[["task", "layout", "seed"]].drop_duplicates().sort_values(["task", "layout", "seed"])
    return [{"run": f"{root}/{t}/{lay}/seed{k}", "code_hash": None, "commit": made_by.get("commit"),
             "dirty": made_by.get("dirty"), "cpu_model": None, "torch": made_by.get("torch"),
             "threads": made_by.get("threads"), "reused": None}
            for t, lay, k in keys.itertuples(index=False)]


def write_outputs(out: Path, seeds_df: pd.DataFrame, rows: pd.DataFrame, *, prov: dict,
                  ledger: list, seconds: float, a) -> None:
    """NAME.{md,csv,json,png}, NAME_seeds.csv and the comparisons.csv rows (NAME: --name)."""
    name = a.name
    out.mkdir(parents=True, exist_ok=True)
    n_seeds = seeds_df.groupby("task")["seed"].nunique().to_dict()
    source = (f"re-analysed from `{a.from_csv}` (runs made before runs recorded their code; "
              "held-out = the loop's sampled score on 128 problems)") if a.from_csv else (
        "held-out = exact expected accuracy over the whole held-out split")
    primary = rows[rows["primary"].astype(bool)]
    md = ["# Objectives × rollout layouts", "",
          f"{stamp(prov)}; seeds per task {n_seeds}; {seconds:.0f} s; {source}. Differences in "
          "points, paired by seed: mean [95 % t interval], p (exact sign-flip); Holm over each "
          f"compute rule's primary family ({len(primary)} primary comparisons, "
          f"{primary.groupby('matched').size().max()} per rule).", "",
          "## Primary comparisons (declared before the runs)", "", comparisons.markdown(primary), "",
          "## Per objective", "", table(seeds_df, rows).to_markdown(index=False), "",
          "## Exploratory comparisons", "", comparisons.markdown(rows[~rows["primary"]]), ""]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    gen = seeds_df[seeds_df["matched"] == "generated_tokens"].drop(columns=["experiment", "matched"])
    gen.melt(id_vars=["task", "layout", "seed", "objective"], var_name="metric").to_csv(
        out / f"{name}.csv", index=False)
    seeds_df.to_csv(out / f"{name}_seeds.csv", index=False)
    comparisons.write(rows, name, out / "comparisons.csv")
    old_meta = out / f"{name}.json"
    made_by = None  # the runs' own provenance, when re-analysing them
    if a.from_csv and old_meta.exists():
        meta = json.loads(old_meta.read_text())
        made_by = meta.get("runs_made_by") or meta.get("provenance")
    if a.from_csv and made_by and not ledger:
        ledger = unrecorded_runs(seeds_df, made_by)
    write_meta(out / f"{name}.json", prov, seeds=n_seeds, seconds=round(seconds),
               layouts=LAYOUTS, primary=PRIMARY, runs=ledger,
               source=a.from_csv or str(a.runs or "runs/tree_tandem"), runs_made_by=made_by)
    figure(seeds_df, out / f"{name}.png")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
