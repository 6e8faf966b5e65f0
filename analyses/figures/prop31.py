"""Prop. 3.1 on real steps: measured KL(π_θ(·|h*) ‖ π_θ+(·|h*)) at the full-group shared
contexts h* of real optimizer steps against ½ δᵀF(h*)δ for the step δ actually taken, and the
part of it due to the residual (docs/concepts/drift.md; `gradlab.loop.recipes.prop31`, `gradlab.probes.fisher`).

Runs short tandems from the shipped start (one per learning rate) and writes

  prop31.csv   one row per (config, objective, optimizer step): sums over the step's node
               contexts of kl_measured, kl_predicted = ½δᵀFδ, kl_res = ½δ_resᵀFδ_res (Adam
               reading), kl_res_sgd (−lr·c·g_tax reading), kl_cur (this step's gradient's part
               of δ), plus tax_share, grad-clip factor, cos(δ, −g), checks
  prop31.json  fits (log–log slope, ratio quantiles) per config/objective, per step and per
               node context; provenance (code hash, commit, machine, threads, command), sizes
               and `runs`: the tandems run in this process and write no run folder, so the
               list holds one row for the process itself (`gradlab.provenance.current()`,
               "run": "<in-process>", reused false)
  prop31.png   (a) measured vs predicted with y = x and the fit, (b) residual's part vs KL

    python -m analyses.figures.prop31          # 20 rollout steps × 3 objectives at lr 2e-4, + lr sweep
    python -m analyses.figures.prop31 --quick  # seconds, for tests
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from analyses.tools.common import FIGURES, provenance, set_threads
from gradlab import jsonio
from gradlab import viz as plots
from gradlab.loop.config import RunConfig
from gradlab.loop.recipes.prop31 import prop31_tandem
from gradlab.provenance import in_process_row
from gradlab.stats import loglog_fit

BASE = dict(prompts=8, G=8, minibatches=4, instruments="off", progress=False)
# (label, objectives, lr, rollout steps): the default lr, then 10× and 50× for larger steps
FULL = [("lr 2e-4", ["grpo", "gspo", "dfpo-min"], 2e-4, 20),
        ("lr 2e-3", ["gspo", "dfpo-min"], 2e-3, 10),
        ("lr 1e-2", ["gspo"], 1e-2, 5)]
QUICK = [("lr 2e-4", ["gspo", "dfpo-min"], 2e-4, 1), ("lr 2e-3", ["gspo"], 2e-3, 1)]
SUMS = {"kl": "kl_measured", "half_delta": "kl_predicted", "half_res_adam": "kl_res",
        "half_res_sgd": "kl_res_sgd", "half_cur": "kl_cur"}
FIRST = ["n_nodes", "tax_share", "clip", "grad_norm", "delta_norm", "cos_delta_grad", "res_frac",
         "grad_match", "adam_match"]


def collect(configs, task: str, size: dict, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-node records, per-step table) over the configs."""
    nodes = []
    for label, objs, lr, steps in configs:
        cfg = RunConfig(out="runs/prop31", objectives=objs, lr=lr, steps=steps, task=task,
                        seed=seed, **size)
        t0 = time.time()
        recs = pd.DataFrame(prop31_tandem(cfg))
        recs.insert(0, "config", label)
        recs["lr"] = lr
        nodes.append(recs)
        print(f"{label}: {len(recs)} node records in {time.time() - t0:.0f} s", flush=True)
    nodes = pd.concat(nodes, ignore_index=True)
    keys = ["config", "objective", "lr", "step", "opt_step"]
    g = nodes.groupby(keys, sort=False)
    steps = g[list(SUMS)].sum().rename(columns=SUMS).join(g[FIRST].first()).reset_index()
    steps["label"] = steps["objective"] + ", " + steps["config"]
    return nodes, steps


def fits(nodes: pd.DataFrame, steps: pd.DataFrame) -> list[dict]:
    """Log–log fits of measured on predicted KL, per (config, objective) and overall."""
    out = []
    for (cfg, obj), s in [(("all", "all"), steps)] + list(steps.groupby(["config", "objective"], sort=False)):
        n = nodes if cfg == "all" else nodes[(nodes["config"] == cfg) & (nodes["objective"] == obj)]
        row = {"config": cfg, "objective": obj, "steps": len(s),
               "median_tax_share": float(s["tax_share"].median()),
               "max_tax_share": float(s["tax_share"].max()),
               "median_res_over_kl": float((s["kl_res"] / s["kl_measured"]).median()),
               "max_res_over_kl": float((s["kl_res"] / s["kl_measured"]).max()),
               "median_res_sgd_over_res_adam": float((s["kl_res_sgd"] / s["kl_res"]).median()),
               "median_cos_delta_grad": float(s["cos_delta_grad"].median()),
               "frac_clipped": float((s["clip"] < 1).mean()),
               "max_grad_match": float(s["grad_match"].max()),
               "max_adam_match": float(s["adam_match"].max())}
        row.update({f"step_{k}": v for k, v in loglog_fit(s["kl_predicted"], s["kl_measured"]).items()})
        row.update({f"node_{k}": v for k, v in loglog_fit(n["half_delta"], n["kl"]).items()})
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny runs (seconds), for tests")
    p.add_argument("--task", default="arithmetic", help="arithmetic (default) or a .jsonl task")
    p.add_argument("--out", help="output folder (default figures/)")
    a = p.parse_args(argv)
    set_threads(1)
    out = Path(a.out) if a.out else FIGURES
    out.mkdir(parents=True, exist_ok=True)
    configs = QUICK if a.quick else FULL
    size = dict(BASE, prompts=2, G=4, minibatches=2) if a.quick else dict(BASE)
    # the commit the run starts from
    t0, prov = time.time(), provenance("analyses.figures.prop31", argv)
    nodes, steps = collect(configs, a.task, size)
    steps.to_csv(out / "prop31.csv", index=False, float_format="%.6g")
    table = fits(nodes, steps)
    runs = [in_process_row(prov)]
    meta = {"provenance": prov, "runs": runs, "task": a.task, "size": size,
            "configs": [{"label": c, "objectives": o, "lr": lr, "rollout_steps": s}
                        for c, o, lr, s in configs],
            "node_records": len(nodes), "seconds": round(time.time() - t0), "fits": table}
    (out / "prop31.json").write_text(jsonio.dumps(meta, indent=1))
    plots.save(plots.prop31_figure(steps.assign(objective=steps["label"])), out / "prop31.png")
    cols = ["config", "objective", "steps", "step_slope", "step_ratio_median", "step_ratio_q05",
            "step_ratio_q95", "node_slope", "median_tax_share", "median_res_over_kl",
            "median_cos_delta_grad", "frac_clipped"]
    print(pd.DataFrame(table)[cols].to_markdown(index=False, floatfmt=".3g"))
    print(f"prop31: {len(steps)} steps, {len(nodes)} node contexts → {out}/prop31.* "
          f"in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
