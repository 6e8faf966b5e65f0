"""Scaffold vs arithmetic: is the learning tax larger where responses share a long preamble?

The issue's "Done when" check, over seeds: short tandems from each task's shipped start,
`--steps 3 --tax-every 1` (the tax measured on every rollout step), two tandems per (task, seed):
  - `gspo,dfpo-min` — shared_frac_prefix (share of response tokens at full-group nodes), GSPO's
    tax_share (‖g_tax‖/‖g_total‖) and DFPO's (≈ 0), the token-space residual at full-group nodes
    and the loop's attribution of it (`attr_clip`, `attr_length`, `attr_coupling`: share of the
    residual that goes away when one mechanism is switched off on the same batch);
  - `gspo,gspo[eps=1e9]` — the clip's share of the *parameter-space* tax: at rollout step 0 both
    learners score the same samples (tandem), so 1 − ‖g_tax‖(clip-free)/‖g_tax‖(GSPO) is paired.
Each run is `gradlab tandem --task T --steps 3 --tax-every 1 --objectives O --seed k` (defaults
otherwise: 8 prompts × G = 8, 4 minibatches, eval every 10 steps and at the end on 64 held-out
problems). Writes <out>/scaffold_tax.md, scaffold_tax.csv (task, seed, pair, objective, step,
metric, value) and scaffold_tax.json (summary, provenance, and `runs`: one row per tandem with
its code hash, commit, dirty flag, machine and whether it was reused, `common.run_row`).

    python -m analyses.figures.scaffold_tax          # 5 seeds × 2 tasks × 2 tandems × 3 steps (~5 min)
    python -m analyses.figures.scaffold_tax --quick  # 1 seed, 2 steps, tiny batch: seconds, for tests
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from analyses.tools.common import (
    FIGURES,
    ROOT,
    load_seeds,
    provenance,
    run_seeds,
    set_threads,
    write_meta,
)

TASKS = ("scaffold", "arithmetic")
PAIRS = {"dfpo": ["gspo", "dfpo-min"], "clip": ["gspo", "gspo[eps=1e9]"]}
FULL = dict(steps=3, tax_every=1, progress=False)
QUICK = dict(steps=2, tax_every=1, prompts=2, G=4, minibatches=2, probe_contexts=2,
             progress=False)
KEYS = ["shared_frac_prefix", "length", "tax_share", "tax_norm", "rho_prefix", "attr_residual",
        "attr_clip", "attr_length", "attr_coupling", "clip_frac", "eval_accuracy",
        "eval_accuracy_greedy"]


def collect(runs: Path, seeds, size: dict, ledger: list | None = None) -> pd.DataFrame:
    """Train (or reuse) every (task, pair, seed) tandem; the tidy rows of KEYS. `ledger` gets
    one provenance row per run (`common.run_row`)."""
    parts = []
    for task in TASKS:
        for pair, objs in PAIRS.items():
            root = runs / task / pair
            run_seeds(root, seeds, ledger=ledger, objectives=objs, task=task, **size)
            t = load_seeds(root)
            t = t[t["metric"].isin(KEYS) & t["seed"].isin(list(seeds))]
            parts.append(t.assign(task=task, pair=pair))
    return pd.concat(parts, ignore_index=True)[
        ["task", "seed", "pair", "objective", "step", "metric", "value"]]


def _per_seed(tidy: pd.DataFrame, task: str, pair: str, obj: str, metric: str) -> pd.Series:
    d = tidy[(tidy["task"] == task) & (tidy["pair"] == pair) & (tidy["objective"] == obj)
             & (tidy["metric"] == metric)].dropna(subset=["value"])
    return d.groupby("seed")["value"].mean()


def summarise(tidy: pd.DataFrame) -> dict:
    """Per task: means over steps then seeds (and per-seed values) of the headline numbers;
    the scaffold/arithmetic ratio of GSPO's tax share (ratio of means, per-seed, per-step)."""
    out = {}
    for task in TASKS:
        s = {m: _per_seed(tidy, task, "dfpo", "gspo", m) for m in KEYS}
        d = tidy[(tidy["task"] == task) & (tidy["pair"] == "clip") & (tidy["step"] == 0)
                 & (tidy["metric"] == "tax_norm")].pivot(index="seed", columns="objective",
                                                          values="value")
        clip0 = 1 - d["gspo[eps=1e9]"] / d["gspo"]
        steps = tidy[(tidy["task"] == task) & (tidy["pair"] == "dfpo") & (tidy["objective"] == "gspo")
                     & (tidy["metric"] == "tax_share")]["value"]
        sf = tidy[(tidy["task"] == task) & (tidy["pair"] == "dfpo")
                  & (tidy["metric"] == "shared_frac_prefix")]["value"]
        out[task] = {**{m: float(v.mean()) for m, v in s.items()},
                     "tax_share_per_seed": s["tax_share"].round(6).tolist(),
                     "tax_share_step_median": float(steps.median()),
                     "shared_frac_prefix_min_step": float(sf.min()),
                     "dfpo_tax_share_max": float(_per_seed(tidy, task, "dfpo", "dfpo-min",
                                                           "tax_share").max()),
                     "clip_share_of_tax_step0_per_seed": clip0.round(3).tolist(),
                     "clip_share_of_tax_step0_median": float(clip0.median())}
    a, b = out["scaffold"], out["arithmetic"]
    out["ratio"] = {"of_means": _ratio(a["tax_share"], b["tax_share"]),
                    "per_seed": [round(_ratio(x, y), 1) for x, y in
                                 zip(a["tax_share_per_seed"], b["tax_share_per_seed"])],
                    "of_step_medians": _ratio(a["tax_share_step_median"],
                                              b["tax_share_step_median"])}
    return out


def _ratio(x: float, y: float) -> float:
    """x / y; NaN (not an error) when the arithmetic tax y is exactly 0 (tiny quick runs)."""
    return float(x) / float(y) if y != 0 else float("nan")


def markdown(summ: dict, n_seeds: int, size: dict, seconds: float) -> str:
    rows = [("response tokens", "length", "{:.1f}"),
            ("shared_frac_prefix (mean; min over steps)", None, None),
            ("GSPO tax_share, mean", "tax_share", "{:.2%}"),
            ("GSPO tax_share, median over steps", "tax_share_step_median", "{:.3%}"),
            ("DFPO-min tax_share, max", "dfpo_tax_share_max", "{:.1e}"),
            ("GSPO ρ prefix", "rho_prefix", "{:.3f}"),
            ("GSPO token residual at full-group nodes", "attr_residual", "{:.3f}"),
            ("attr_clip / attr_length / attr_coupling", None, None),
            ("clip's share of ‖g_tax‖ at step 0, median [per seed]", None, None),
            ("held-out accuracy after the run, sampled / greedy", None, None)]
    lines = ["| | scaffold | arithmetic |", "|---|---|---|"]
    for label, key, fmt in rows:
        cells = []
        for task in TASKS:
            s = summ[task]
            if key:
                cells.append(fmt.format(s[key]))
            elif label.startswith("shared"):
                cells.append(f"{s['shared_frac_prefix']:.3f}; {s['shared_frac_prefix_min_step']:.3f}")
            elif label.startswith("attr"):
                cells.append(f"{s['attr_clip']:.2f} / {s['attr_length']:.2f} / {s['attr_coupling']:.2f}")
            elif label.startswith("clip"):
                cells.append(f"{s['clip_share_of_tax_step0_median']:.2f} "
                             f"{s['clip_share_of_tax_step0_per_seed']}")
            else:
                cells.append(f"{s['eval_accuracy']:.1%} / {s['eval_accuracy_greedy']:.1%}")
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    r = summ["ratio"]
    lines += ["", f"GSPO tax share, scaffold / arithmetic: {r['of_means']:.1f}× (ratio of means), "
              f"{r['of_step_medians']:.1f}× (ratio of per-step medians), per seed {r['per_seed']}.",
              f"{n_seeds} seeds × {size['steps']} rollout steps, tax every step; {seconds:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--seeds", type=int, help="number of seeds 0..n-1 (default 5; quick: 1)")
    p.add_argument("--runs", help="default runs/scaffold_tax (quick: runs/scaffold_tax-quick)")
    p.add_argument("--out", help="output folder (default figures/; quick: the runs folder)")
    a = p.parse_args(argv)
    prov = provenance("analyses.figures.scaffold_tax", argv)
    set_threads(1)
    n = a.seeds or (1 if a.quick else 5)
    size = dict(QUICK if a.quick else FULL)
    runs = Path(a.runs or ROOT / ("runs/scaffold_tax-quick" if a.quick else "runs/scaffold_tax"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ledger: list[dict] = []
    tidy = collect(runs, range(n), size, ledger)
    summ = summarise(tidy)
    seconds = time.time() - t0
    md = markdown(summ, n, size, seconds)
    tidy.to_csv(out / "scaffold_tax.csv", index=False)
    (out / "scaffold_tax.md").write_text(md)
    write_meta(out / "scaffold_tax.json", prov, size=size, seeds=n, seconds=round(seconds),
               summary=summ, runs=ledger)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
