"""The tandem on counterfactual rollouts: independent vs tree vs repair groups, at matched
generated tokens, for GRPO, GSPO, DFPO (Min-Replace, Orth-Proj) and IBPO.

For each task and layout a tandem trains every objective from the same start on the same prompt
stream (one tandem per seed: runs/tree_tandem/<task>/<layout>/seed{k}). Layouts:
  independent  G samples per prompt
  tree         --rollout tree --roots 1 --branches 7 --branch-token alternative (a star of seven
               alternative decisions off one root: the most informative branch points per
               generated token in figures/rollout_layouts.md)
  repair       --rollout repair --repair resample (4 tries); adds ibpo[form=repair]
Compute rule: equal *generated* tokens (what sampling costs). Each layout's rollout steps are the
independent layout's steps × (independent generated tokens per step / the layout's), from
figures/rollout_layouts.csv (same prompts, G and policy); the table reports the generated tokens
each run actually consumed. Each run evaluates its final policy on the held-out split
(`eval_accuracy`, the same problems for every objective and layout of a task).

Reported per (task, layout, objective): held-out accuracy, mean [95 % bootstrap] over seeds; the
paired difference to GSPO in the same layout and to the same objective in the independent
layout (paired by seed: same start, same prompts) [95 % paired bootstrap]; learning-tax share
(mean over the tax steps of the whole run), ρ at full-group and trie nodes; stability: token
entropy at the first and last step, non-finite optimizer steps. Writes figures/tree_tandem.csv
(tidy: task, layout, seed, objective, metric, value), .md, .json (provenance) and .png.

    python analyses/tree_tandem.py                  # 3 seeds; arithmetic 30 and scaffold 20 steps
    python analyses/tree_tandem.py --seeds 5        # the published table (figures/tree_tandem.*)
    python analyses/tree_tandem.py --quick          # seconds: runs/tree_tandem-quick, for tests
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
    fmt_ci,
    load_seeds,
    provenance,
    run_seeds,
    set_threads,
    write_meta,
)
from gradlab.stats import paired_bootstrap

OBJECTIVES = ["grpo", "gspo", "dfpo-min", "dfpo-orth", "ibpo"]
LAYOUTS = {
    "independent": {},
    "tree": dict(rollout="tree", roots=1, branches=7, branch_token="alternative"),
    "repair": dict(rollout="repair", repair="resample", repair_tries=4),
}
EXTRA = {"repair": ["ibpo[form=repair]"]}  # objectives that need the layout's rows
CSV_LABEL = {"independent": "independent", "tree": "tree star alternative", "repair": "repair"}
STEPS = {"arithmetic": 30, "scaffold": 20}


def layout_steps(task: str, steps: int, table: Path = FIGURES / "rollout_layouts.csv") -> dict:
    """Rollout steps per layout at the independent layout's generated tokens (see docstring)."""
    df = pd.read_csv(table).set_index(["task", "layout"])
    ind = float(df.loc[(task, "independent"), "generated_tokens"])
    return {lay: max(1, round(steps * ind / float(df.loc[(task, CSV_LABEL[lay]), "generated_tokens"])))
            for lay in LAYOUTS}


def per_run(tidy: pd.DataFrame, task: str, layout: str) -> pd.DataFrame:
    """One row per (seed, objective): the figures the tables report, from the run store."""
    rows = []
    for (run, obj), o in tidy.groupby(["run", "objective"]):
        def m(name, o=o):
            return o[o["metric"] == name].sort_values("step")["value"]
        ev, ent = m("eval_accuracy"), m("entropy")
        rows.append({"task": task, "layout": layout, "seed": int(run.removeprefix("seed")),
                     "objective": obj, "heldout_acc": float(ev.iloc[-1]) if len(ev) else float("nan"),
                     "tax_share": m("tax_share").mean(), "rho_prefix": m("rho_prefix").mean(),
                     "rho_trie": m("rho_trie").mean(), "entropy_first": float(ent.iloc[0]),
                     "entropy_last": float(ent.iloc[-1]),
                     "nonfinite_steps": float(m("nonfinite_steps").sum()),
                     "generated_tokens": float(m("generated_tokens").sum()),
                     "informative_per_1k": m("informative_per_1k").mean(),
                     "adv_branch_share": m("adv_branch_share").mean(),
                     "steps": int(o["step"].max()) + 1})
    return pd.DataFrame(rows)


def _paired(wide: pd.DataFrame, a: dict, b: dict) -> str:
    x = wide.loc[(wide[list(a)] == pd.Series(a)).all(axis=1)].set_index("seed")["heldout_acc"]
    y = wide.loc[(wide[list(b)] == pd.Series(b)).all(axis=1)].set_index("seed")["heldout_acc"]
    seeds = x.index.intersection(y.index)
    if len(seeds) == 0 or a == b:
        return "—"
    d = paired_bootstrap(100 * x.loc[seeds], 100 * y.loc[seeds])
    return f"{d['mean']:+.1f} [{d['lo']:+.1f}, {d['hi']:+.1f}]"


def table(wide: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (task, layout, obj), o in wide.groupby(["task", "layout", "objective"], sort=False):
        rows.append({
            "task": task, "layout": layout, "objective": obj, "seeds": len(o),
            "held-out acc. (%)": fmt_ci(*bootstrap_ci(o["heldout_acc"])),
            "− GSPO, same layout": _paired(wide, dict(task=task, layout=layout, objective=obj),
                                           dict(task=task, layout=layout, objective="gspo")),
            "− independent, same objective": _paired(
                wide, dict(task=task, layout=layout, objective=obj),
                dict(task=task, layout="independent", objective=obj)),
            "tax share": f"{o['tax_share'].mean():.3g}", "ρ prefix": f"{o['rho_prefix'].mean():.2g}",
            "ρ trie": f"{o['rho_trie'].mean():.2g}",
            "entropy first → last": f"{o['entropy_first'].mean():.3f} → {o['entropy_last'].mean():.3f}",
            "non-finite steps": int(o["nonfinite_steps"].sum()),
            "generated tokens": f"{o['generated_tokens'].mean():.0f}",
            "rollout steps": int(o["steps"].iloc[0])})
    return pd.DataFrame(rows)


def figure(wide: pd.DataFrame, path: Path) -> None:
    """Held-out accuracy and learning-tax share per objective, hue = layout, one column per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    tasks = list(dict.fromkeys(wide["task"]))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 7), squeeze=False)
    for j, task in enumerate(tasks):
        d = wide[wide["task"] == task].assign(acc=lambda x: 100 * x["heldout_acc"])
        for i, (col, label) in enumerate((("acc", "held-out accuracy (%)"),
                                          ("tax_share", "learning-tax share ‖g_tax‖/‖g‖"))):
            ax = axes[i, j]
            sns.pointplot(d, x="objective", y=col, hue="layout", dodge=0.45, errorbar=("ci", 95),
                          linestyle="none", markers="o", ax=ax, seed=0)
            ax.set(xlabel="", ylabel=label, title=f"{task}" if i == 0 else "")
            ax.tick_params(axis="x", rotation=20)
            if i or j:
                ax.get_legend().remove() if ax.get_legend() else None
    fig.suptitle("Objectives × rollout layouts at matched generated tokens (mean, 95 % CI over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


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
    a = p.parse_args(argv)
    set_threads(1)
    per_task = dict(x.split("=") for x in a.seeds.split(",")) if a.seeds and "=" in a.seeds else {}
    default = int(a.seeds) if a.seeds and not per_task else (1 if a.quick else 3)
    runs = Path(a.runs or ROOT / ("runs/tree_tandem-quick" if a.quick else "runs/tree_tandem"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    objs = a.objectives.split(",") if a.objectives else OBJECTIVES
    t0, prov, walls, plan = time.time(), provenance("tree_tandem.py", argv), [], {}
    n_seeds = {}
    for task in a.tasks.split(","):
        seeds = range(int(per_task.get(task, default)))
        steps = layout_steps(task, a.steps or (2 if a.quick else STEPS[task]))
        plan[task], n_seeds[task] = steps, len(seeds)
        for k in seeds:  # seed-major: a run cut short still has every layout of its first seeds
            for layout, opts in LAYOUTS.items():
                size = dict(QUICK, G=8, prompts=2) if a.quick else dict(
                    prompts=8, G=8, minibatches=4, tax_every=5, progress=False)
                size.update(steps=steps[layout], eval_every=steps[layout],
                            ckpt_every=steps[layout], task=task, eval_size=16 if a.quick else 128)
                run_seeds(runs / task / layout, [k], objectives=objs + EXTRA.get(layout, []),
                          **opts, **size)
        for layout in LAYOUTS:
            tidy = load_seeds(runs / task / layout)
            walls.append(per_run(tidy[tidy["run"].isin([f"seed{k}" for k in seeds])], task, layout))
    wide = pd.concat(walls, ignore_index=True)
    seconds = time.time() - t0
    t = table(wide)
    md = ["# Objectives × rollout layouts at matched generated tokens", "",
          f"`{prov['command']}` at {prov['commit'][:10]}, {prov['threads']} thread(s), "
          f"seeds per task {n_seeds}, {seconds:.0f} s. Rollout steps per layout (independent × "
          f"generated-token ratio): {plan}. Held-out accuracy of the final policy "
          "(eval_accuracy); differences in points, paired by seed [95 % paired bootstrap].", "",
          t.to_markdown(index=False), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_tandem.md").write_text("\n".join(md) + "\n")
    cols = ["task", "layout", "seed", "objective"]
    wide.melt(id_vars=cols, var_name="metric").to_csv(out / "tree_tandem.csv", index=False)
    write_meta(out / "tree_tandem.json", prov, seeds=n_seeds, steps=plan, seconds=round(seconds),
               layouts=LAYOUTS, runs=str(runs))
    figure(wide, out / "tree_tandem.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
