"""The paper's ablations as tables, on the built-in task: Table 2 and Table 3.

Table 2 — every variant against GSPO, paired by seed. The paper's rows (DFPO Min-Replace, GSPO,
DFPO without stop-gradient, DFPO "scale by 0.5") and ours: Orth-Proj, token-mean GRPO, clip-free
DFPO (`dfpo-min[clip=free]`), clip-free GSPO (`gspo[eps=1e9]`), Orth-Proj at trie nodes
(`dfpo-orth[nodes=trie]`). dfpo-min, dfpo-orth, gspo and grpo come from the Figure 3 tandem
(`--fig3-runs`, trained by analyses/figures/figure3.py or here if missing); the other variants
run in a second tandem of the same size and seeds (runs/ablations/table2/seed{k}). Learners of a tandem
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
ablations.json (provenance: code hash, commit, machine, command; per run used its code hash,
machine and whether it was reused; sizes; seconds). The per-seed values also go to
figures/ablations_seeds.csv (scaffold: ablations-scaffold_seeds.csv; layout "independent" for
Table 2, "G=<g>" for Table 3's tandems, matched "optimizer_steps") and every difference shown to
figures/comparisons.csv (experiment "ablations" / "ablations-scaffold"; those of the Figure 3
tandem's runs are experiment figure3's rows), all exploratory: not declared before the runs.

    python -m analyses.figures.ablations            # full: 5 seeds, 150 steps × 8 prompts, G=8 (T2)
    python -m analyses.figures.ablations --quick    # seconds: runs/ablations-quick, for tests
    python -m analyses.figures.ablations --task scaffold --steps 60 --seeds 5  # → figures/scaffold/
    python -m analyses.figures.ablations --reanalyse [--task scaffold]  # tables again from ablations.csv
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import pandas as pd

from analyses.figures import figure3
from analyses.tools import comparisons
from analyses.tools.common import (
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
from gradlab import jsonio
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


METRICS = ["heldout_acc", "train_acc_last5", "rho_prefix", "rho_trie", "tax_share", "probe_kl",
           "tokens"]
EXPERIMENT = "ablations"


def _long(wide: pd.DataFrame, table: str, G: int, labels: dict) -> pd.DataFrame:
    long = wide.melt(id_vars=["seed", "objective"], value_vars=METRICS, var_name="metric")
    return long.assign(table=table, G=G, label=long["objective"].map(labels))


def _wide(long: pd.DataFrame, table: str, G: int | None = None) -> pd.DataFrame:
    """Per (seed, objective) rows of one table (and G) back from ablations.csv's long rows."""
    d = long[(long["table"] == table) & ((long["G"] == G) if G is not None else True)]
    w = d.pivot_table(index=["seed", "objective"], columns="metric", values="value",
                      aggfunc="first").reset_index()
    return w[["seed", "objective", *METRICS]]


def table2(root: Path, fig3: Path, *, seeds, size: dict, eval_n: int, ledger: list,
           reuse: bool) -> pd.DataFrame:
    """Train (or reuse) both tandems; per-seed rows of every Table 2 objective."""
    run_seeds(fig3, seeds, ledger=ledger, reuse_any_code=reuse, objectives=figure3.OBJECTIVES, **size)
    run_seeds(root, seeds, ledger=ledger, reuse_any_code=reuse, objectives=EXTRA, **size)
    return pd.concat([per_seed(fig3, seeds, [n for n in TABLE2 if n in figure3.OBJECTIVES], eval_n),
                      per_seed(root, seeds, EXTRA, eval_n)], ignore_index=True)


def table2_rows(wide: pd.DataFrame) -> pd.DataFrame:
    t = paired_table(wide, TABLE2)
    t["paper: AIME25 / LCB / HMMT25"] = t["variant"].map(PAPER2).fillna("—")
    return t


def table3(root: Path, fig3: Path, *, seeds, size: dict, eval_n: int, Gs, ledger: list,
           reuse: bool) -> dict:
    """{G: per-seed rows of dfpo-min and gspo}; G = size["G"] is the Figure 3 tandem."""
    wides = {}
    for G in Gs:
        sub = fig3 if G == size["G"] else root / f"G{G}"
        if G != size["G"]:
            run_seeds(sub, seeds, ledger=ledger, reuse_any_code=reuse,
                      objectives=["dfpo-min", "gspo"], **{**size, "G": G})
        wides[G] = per_seed(sub, seeds, ["dfpo-min", "gspo"], eval_n)
    return wides


def table3_rows(wides: dict) -> pd.DataFrame:
    rows = []
    for G, wide in wides.items():
        w = {c: wide.pivot(index="seed", columns="objective", values=c) for c in METRICS}
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
    return pd.DataFrame(rows)


def publish(w2: pd.DataFrame | None, w3: dict, out: Path, task: str, G2: int) -> bool:
    """<experiment>_seeds.csv and the experiment's comparisons.csv rows (into figures/ when out
    lies under it): each variant − GSPO of Table 2 and DFPO Min-Replace − GSPO per G (layout
    "G=<g>"); all exploratory, held-out accuracy in points. G2: Table 2's group size. The seeds
    file holds every row. The differences whose runs are the Figure 3 tandem (Table 2's
    dfpo-min, dfpo-orth, grpo; Table 3 at G2) are experiment figure3's rows when figure3's
    seeds file (beside ours, else the published one in figures/) holds these runs (one row per comparison), and this experiment's rows when
    they are other runs (Figure 3 re-trained after the ablations); returns which."""
    exp = EXPERIMENT if task == "arithmetic" else f"{EXPERIMENT}-{task}"
    key = dict(experiment=exp, task=task, matched="optimizer_steps")
    parts = [] if w2 is None else [w2.assign(layout="independent", table="table2", G=G2)]
    parts += [w.assign(layout=f"G={G}", table="table3", G=G) for G, w in w3.items()]
    seeds = pd.concat(parts, ignore_index=True).assign(**key)
    seeds = seeds[comparisons.SEED_KEYS + [c for c in seeds.columns if c not in comparisons.SEED_KEYS]]
    dest = FIGURES if out.resolve().is_relative_to(FIGURES.resolve()) else out
    name = f"{exp.replace(EXPERIMENT, figure3.EXPERIMENT)}_seeds.csv"  # beside ours, else published
    shared = fig3_shared(seeds, dest / name if (dest / name).is_file() else FIGURES / name, G2)
    fig3_names = [n for n in TABLE2 if n in figure3.OBJECTIVES and n != "gspo"]
    names = EXTRA + ([] if shared else fig3_names)
    pairs = [] if w2 is None else [({**key, "layout": "independent", "objective": n},
                                    {**key, "layout": "independent", "objective": "gspo"}, False)
                                   for n in TABLE2 if n in names]
    pairs += [({**key, "layout": f"G={G}", "objective": "dfpo-min"},
               {**key, "layout": f"G={G}", "objective": "gspo"}, False)
              for G in w3 if G != G2 or not shared]
    comparisons.publish(seeds, comparisons.compare(seeds, pairs), exp, out, FIGURES)
    return shared


def fig3_shared(seeds: pd.DataFrame, fig3_seeds: Path, G2: int) -> bool:
    """True iff the Figure 3 experiment's seeds file holds this experiment's Figure 3 tandem
    (Table 2's rows of the Figure 3 objectives, Table 3 at G2): the same held-out score per
    (objective, seed)."""
    if not fig3_seeds.is_file():
        return False
    pub = pd.read_csv(fig3_seeds).set_index(["objective", "seed"])["heldout_acc"]
    mine = seeds[seeds["objective"].isin(figure3.OBJECTIVES)
                 & seeds["layout"].isin(["independent", f"G={G2}"])]
    mine = mine.drop_duplicates(["objective", "seed"]).set_index(["objective", "seed"])["heldout_acc"]
    return bool(len(mine)) and bool(mine.index.isin(pub.index).all()) and bool(
        (pub.loc[mine.index].to_numpy() == mine.to_numpy()).all())


def markdown(w2: pd.DataFrame | None, w3: dict, src: str, *, footer: str, exp: str,
             G2: int, shared: bool = True) -> list[str]:
    """The tables' markdown lines (Table 2 if w2, Table 3 if w3), a note on where the
    comparisons live (shared: the Figure 3 tandem's are figure3's rows), and the footer."""
    md = []
    if w2 is not None:
        md += ["### Table 2 (ablations): mean [95 % t interval] over seeds; difference to GSPO "
               f"paired by seed [95 % paired t interval], p (exact sign-flip); held-out source: {src}",
               "", table2_rows(w2).drop(columns="objective").to_markdown(index=False), ""]
    if w3:
        md += ["### Table 3 (group size), DFPO Min-Replace − GSPO, paired by seed [95 % paired t "
               "interval], p (exact sign-flip)", "", table3_rows(w3).to_markdown(index=False), ""]
    fig3 = exp.replace(EXPERIMENT, figure3.EXPERIMENT)
    where = (("; DFPO (both)" + (f", GRPO and G = {G2}" if w3 else " and GRPO")
              + f" are the Figure 3 tandem's runs, published once as experiment `{fig3}`")
             if shared else f" and for the Figure 3 tandem's, which are not experiment `{fig3}`'s runs")
    md += [f"Per-seed values: `{exp}_seeds.csv`. The held-out differences to GSPO are rows of "
           f"`comparisons.csv`, all exploratory (not declared before the runs; no multiplicity "
           f"adjustment): experiment `{exp}` for the second tandem's variants"
           + (f" and G ≠ {G2}" if w3 and shared else " and every G" if w3 else "") + where + ".",
           "", footer]
    return md


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
    p.add_argument("--reuse-any-code", action="store_true",
                   help="reuse finished runs whatever code made them (recorded in the .json)")
    p.add_argument("--reanalyse", action="store_true", help="re-make ablations.md/.json, the "
                   "seeds file and the comparisons from OUT/ablations.csv (no training)")
    a = p.parse_args(argv)
    set_threads(1)
    sfx = "" if a.task == "arithmetic" else f"-{a.task}"
    if a.reanalyse:
        return reanalyse(Path(a.out or (FIGURES / a.task if sfx else FIGURES)), argv)
    a.seeds = a.seeds or (2 if a.quick else 5)
    size = dict(QUICK) if a.quick else dict(FULL)
    if a.steps:
        size["steps"] = a.steps
    if sfx:  # same keys as figure3.py --task, so its runs are reused (run_seeds compares configs)
        size["task"] = a.task
    eval_n = a.eval_n or (16 if a.quick else 256)
    runs = Path(a.runs or ROOT / (f"runs/ablations{sfx}-quick" if a.quick else f"runs/ablations{sfx}"))
    fig3 = Path(a.fig3_runs or (runs / "figure3" if a.quick else ROOT / f"runs/figure3{sfx}"))
    out = Path(a.out or (runs if a.quick else FIGURES / a.task if sfx else FIGURES))
    seeds, ledger, reuse = range(a.seeds), [], a.reuse_any_code
    t0, prov, w2, w3 = time.time(), provenance("analyses.figures.ablations", argv), None, {}
    if a.only in (None, "table2"):
        w2 = table2(runs / "table2", fig3, seeds=seeds, size=size, eval_n=eval_n, ledger=ledger,
                    reuse=reuse)
    if a.only in (None, "table3"):
        w3 = table3(runs / "table3", fig3, seeds=seeds, size=size, eval_n=eval_n, Gs=GROUP_SIZES,
                    ledger=ledger, reuse=reuse)
    src = ", ".join(sorted(set(pd.concat([w for w in [w2, *w3.values()] if w is not None])
                               ["heldout_source"])))
    shared = publish(w2, w3, out, a.task, size["G"])
    seconds = time.time() - t0
    footer = (f"{len(seeds)} seeds × {size['steps']} rollout steps × {size['prompts']} prompts, "
              f"{size['minibatches']} minibatches ({size['steps'] * size['minibatches']} optimizer "
              f"steps per row), held-out n={eval_n}; {seconds:.0f} s; {stamp(prov)}"
              + ("; finished runs reused whatever code made them (--reuse-any-code)." if reuse else "."))
    md = markdown(w2, w3, src, footer=footer, exp=EXPERIMENT + sfx, G2=size["G"], shared=shared)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablations.md").write_text("\n".join(md) + "\n")
    longs = ([] if w2 is None else [_long(w2, "table2", size["G"], TABLE2)]) + [
        _long(w, "table3", G, {"dfpo-min": f"G={G}", "gspo": f"G={G}"}) for G, w in w3.items()]
    cols = ["table", "label", "G", "seed", "objective", "metric", "value"]
    pd.concat(longs, ignore_index=True)[cols].to_csv(out / "ablations.csv", index=False)
    write_meta(out / "ablations.json", prov, size=size, seeds=len(seeds), eval_n=eval_n,
               seconds=round(seconds), fig3_runs=str(fig3), runs=str(runs), heldout_source=src,
               reuse_any_code=reuse, run_provenance=ledger)
    print("\n".join(md))
    return 0


def reanalyse(out: Path, argv: list[str] | None) -> int:
    """ablations.md/.json, the seeds file and the comparisons again from OUT/ablations.csv's
    per-seed values (sizes and the runs' provenance from OUT/ablations.json)."""
    for f in ("ablations.csv", "ablations.json"):
        if not (out / f).is_file():
            print(f"ablations --reanalyse: {out / f} not found", file=sys.stderr)
            return 2
    long, meta = pd.read_csv(out / "ablations.csv"), json.loads((out / "ablations.json").read_text())
    size, task = meta["size"], meta["size"].get("task", "arithmetic")
    w2 = _wide(long, "table2") if (long["table"] == "table2").any() else None
    w3 = {int(G): _wide(long, "table3", G) for G in long[long["table"] == "table3"]["G"].unique()}
    src = meta.get("heldout_source") or _old_source(out / "ablations.md")
    for w in [w2, *w3.values()]:
        if w is not None:
            w["heldout_source"] = src
    shared = publish(w2, w3, out, task, size["G"])
    made = meta.get("runs_made_by") or meta["provenance"]
    prov = provenance("analyses.figures.ablations", argv)
    when = ("per-run code hashes in ablations.json" if meta.get("run_provenance")
            else "before runs recorded their code")
    footer = (f"{meta['seeds']} seeds × {size['steps']} rollout steps × {size['prompts']} prompts, "
              f"{size['minibatches']} minibatches ({size['steps'] * size['minibatches']} optimizer "
              f"steps per row), held-out n={meta['eval_n']}; runs made by `{made['command']}` at "
              f"commit {made['commit'][:10]} in {meta['seconds']} s ({when}); tables re-made by {stamp(prov)}.")
    md = markdown(w2, w3, src, footer=footer,
                  exp=EXPERIMENT + ("" if task == "arithmetic" else f"-{task}"),
                  G2=size["G"], shared=shared)
    (out / "ablations.md").write_text("\n".join(md) + "\n")
    meta.update(provenance=prov, runs_made_by=made, heldout_source=src,
                run_provenance=meta.get("run_provenance"))
    (out / "ablations.json").write_text(jsonio.dumps(meta, indent=1, default=str))
    print("\n".join(md))
    return 0


def _old_source(md: Path) -> str:
    """The held-out source an earlier ablations.md names ('unrecorded' if none)."""
    m = re.search(r"held-out source: ([\w, ]+)", md.read_text()) if md.is_file() else None
    return m.group(1).strip() if m else "unrecorded"


if __name__ == "__main__":
    sys.exit(main())
