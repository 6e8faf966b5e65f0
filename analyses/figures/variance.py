"""The variance claim, measured: gradient noise of GRPO, GSPO, DFPO and every IBPO form at the
shipped warm starts of arithmetic and scaffold (`gradlab.loop.recipes.variance.measure_variance`).

At a fixed policy and a fixed set of 8 prompts, K rollout batches (8 prompts × G = 8 independent
responses) give each objective's policy gradient on the same samples; R further batches give
the reference gradient. Writes figures/variance.csv (the tidy table), variance.png and
variance.md (K, R, the noise of every objective, the ratios IBPO/GRPO and IBPO/GSPO with their
paired 95 % bootstrap intervals, which objectives coincide, and the command) and variance.json
(sizes, the provenance of the measuring process, and `runs`: the batches are sampled and scored
in this process, which writes no run folder, so the list holds one row for the process itself,
`gradlab.provenance.current()` with "run": "<in-process>" and reused false).

    OMP_NUM_THREADS=1 python -m analyses.figures.variance           # K = 48, R = 240 (~6 min CPU)
    python -m analyses.figures.variance --redraw                     # figure and table from the CSV
    python -m analyses.figures.variance --quick --out /tmp/v.png     # seconds, for tests
    python -m analyses.figures.variance --rollout tree --objectives grpo,gspo,dfpo-min,ibpo \
        --K 24 --reference-batches 96 --out figures/variance_tree.png   # another layout
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from analyses.tools.common import FIGURES, provenance, set_threads, stamp
from gradlab import jsonio
from gradlab.loop.recipes.variance import DEFAULT_OBJECTIVES, measure_variance
from gradlab.provenance import in_process_row
from gradlab.viz.curves import save
from gradlab.viz.variance import summary_table, variance_figure

TASKS = ("arithmetic", "scaffold")
LAYOUT_WORDS = {"independent": "independent samples",
                "tree": "a star of G − 1 alternative branches off one root per group",
                "repair": "the independent rows plus resampled repairs of the incorrect ones; "
                          "generated tokens per batch in the CSV"}
SAME = 1e-5  # max relative gradient difference below which two objectives coincide (float32)


def coincide(tidy: pd.DataFrame) -> list[tuple[str, str, str, float]]:
    """(task, a, b, max rel diff) for every pair a < b (in table order) whose gradients agree
    on all K batches to within `SAME`."""
    d = tidy[tidy["metric"].str.startswith("max_rel_diff_vs:")].copy()
    d["other"] = d["metric"].str.split(":", n=1).str[1]
    order = {n: i for i, n in enumerate(dict.fromkeys(tidy["objective"]))}
    keep = d[(d["value"] < SAME) & (d["objective"].map(order) < d["other"].map(order))]
    return [(r.task, r.objective, r.other, r.value) for r in keep.itertuples()]


def _fmt(v: float) -> str:
    return "∞" if v == float("inf") else f"{v:.3g}"


def _ratio(r: dict, base: str) -> str:
    """'ratio [lo, hi]' of the noise against `base`, or — where none was measured."""
    k = f"noise_ratio_vs_{base}"
    if k not in r or pd.isna(r[k]):
        return "—"
    return f"{_fmt(r[k])} [{_fmt(r[k + '_lo'])}, {_fmt(r[k + '_hi'])}]"


def report(tidy: pd.DataFrame, K: int, R: int, prov: dict) -> str:
    """The markdown table of variance.md."""
    s = summary_table(tidy)
    lines = [f"# Gradient noise at a fixed policy (K = {K} batches, reference R = {R} batches)",
             "", stamp(prov),
             "", f"Each batch: the same {prov.get('prompts', 8)} prompts × G = {prov.get('G', 8)} "
             f"responses in the `{prov.get('rollout', 'independent')}` layout "
             f"({LAYOUT_WORDS[prov.get('rollout', 'independent')]}), shipped warm start, on-policy. noise = tr Cov(g) / ⟨ḡ, g_ref⟩ per "
             "batch; ratios and 95 % intervals from one paired bootstrap over the K batches (the "
             "reference's own noise is not in them; 'ref. only' is the noise estimated from the R "
             "reference batches alone, a cross-check). corr: Pearson over response tokens of R_i "
             "with A_{i,t} − A_i (IBPO's comparison term), mean over batches.", "",
             "| task | objective | noise [95 % CI] | ref. only | vs GRPO [CI] | vs GSPO [CI] | "
             "cos(g_k, g_ref) | ‖g‖ | A≠0 share | corr(R, A−A_grpo) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s.to_dict("records"):
        corr = r["reward_comparison_corr_mean"]
        lines.append(f"| {r['task']} | {r['objective']} | {_fmt(r['grad_noise'])} "
                     f"[{_fmt(r['grad_noise_lo'])}, {_fmt(r['grad_noise_hi'])}] | "
                     f"{_fmt(r['grad_noise_ref'])} | {_ratio(r, 'grpo')} | "
                     f"{_ratio(r, 'gspo')} | {r['cos_ref_mean']:.3f} | {r['grad_norm_mean']:.3g} | "
                     f"{r['adv_nonzero_frac_mean']:.3f} | {'—' if pd.isna(corr) else f'{corr:.3f}'} |")
    lines += ["", "Objectives whose gradients coincide on every batch (max ‖g_a − g_b‖/‖g_b‖ "
              f"< {SAME:g}):", ""]
    lines += [f"- {t}: {a} = {b} ({v:.1e})" for t, a, b, v in coincide(tidy)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--K", type=int, default=48)
    p.add_argument("--reference-batches", type=int, default=240)
    p.add_argument("--quick", action="store_true",
                   help="K = 2, R = 2, 2 prompts × G = 4, three objectives (seconds, for tests)")
    p.add_argument("--out", default=str(FIGURES / "variance.png"))
    p.add_argument("--redraw", action="store_true", help="redraw the figure and table from the "
                   "CSV and JSON an earlier run wrote next to --out (no sampling)")
    p.add_argument("--rollout", default="independent", choices=("independent", "tree", "repair"))
    p.add_argument("--objectives", help="comma-separated (default: every objective of the study)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.redraw:
        meta = json.loads(out.with_suffix(".json").read_text())
        write(pd.read_csv(out.with_suffix(".csv")), out, meta)
        return 0
    set_threads(1)
    # the code that measures, not what HEAD is at the end
    prov = provenance("analyses.figures.variance", argv)
    K, R = (2, 2) if a.quick else (a.K, a.reference_batches)
    size = dict(prompts=2, G=4) if a.quick else dict(prompts=8, G=8)
    names = (a.objectives.split(",") if a.objectives else
             ["grpo", "gspo", "ibpo[form=ga]"] if a.quick else list(DEFAULT_OBJECTIVES))
    tidy = pd.concat([measure_variance(names, task=t, K=K, reference_batches=R, seed=0,
                                       threads=1, progress=not a.quick, rollout=a.rollout, **size)
                      for t in TASKS], ignore_index=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"K": K, "reference_batches": R, "rollout": a.rollout, **size, **prov,
            "runs": [in_process_row(prov)]}
    tidy.to_csv(out.with_suffix(".csv"), index=False)
    out.with_suffix(".json").write_text(jsonio.dumps(meta, indent=1))
    write(tidy, out, meta)
    return 0


def write(tidy: pd.DataFrame, out: Path, meta: dict) -> None:
    """The figure (out) and the table (out .md) of a measurement; meta: its JSON record."""
    K, R = meta["K"], meta["reference_batches"]
    save(variance_figure(tidy, f"gradient noise at the shipped warm starts: K = {K} batches of "
                               f"{meta['prompts']}×{meta['G']}, reference {R} batches"), out)
    out.with_suffix(".md").write_text(report(tidy, K, R, meta))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    sys.exit(main())
