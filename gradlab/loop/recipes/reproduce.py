"""The main job: the default tandem on the built-in task, its figures and a summary table."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from ... import viz as plots
from ..config import RunConfig
from ..faults.atomic import write_file, writing
from ..runs.lock import acquire
from ..runs.resume import reproduce_action
from ..runs.store import load_run
from ..train import train

SUMMARY_METRICS = ["accuracy", "reward", "rho_prefix", "rho_trie", "shared_frac_prefix",
                   "tax_share", "probe_kl", "entropy", "logodds_abs", "w_dev"]


def summarize(tidy: pd.DataFrame, last: int = 5) -> pd.DataFrame:
    """Per objective: first-step and last-`last`-steps training accuracy, held-out accuracy at
    the last evaluation (sampled and greedy, when evaluated), means of the diagnostics, tokens
    consumed and seconds per rollout step (median)."""
    wide = tidy.pivot_table(index=["objective", "seed", "step"], columns="metric",
                            values="value").reset_index()
    rows = []
    for obj, d in wide.groupby("objective", sort=False):
        d = d.sort_values("step")
        tail = d[d["step"] > d["step"].max() - last]
        row = {"objective": obj, "acc_first": d["accuracy"].iloc[0],
               f"acc_last{last}": tail["accuracy"].mean()}
        for m in ("eval_accuracy", "eval_accuracy_greedy", "eval_accuracy_expected"):  # held-out
            if m in d and d[m].notna().any():
                row[f"{m}_final"] = d[m].dropna().iloc[-1]
        for m in SUMMARY_METRICS[1:]:
            if m in d:
                row[m] = d[m].mean()
        row["tokens"] = tidy[tidy["objective"] == obj]["tokens"].max()
        for t in ("time_step", "time_rollout", "time_update", "time_probes"):
            if t in d:
                row[f"{t}_s"] = d[t].median()
        rows.append(row)
    return pd.DataFrame(rows)


def reproduce(cfg: RunConfig, resume: bool = False) -> str:
    """Train, draw, summarise; returns the summary as markdown (also in <out>/summary.md).

    Run again on a finished run with the same options it re-makes the figures and summary
    without training; a partial run needs resume=True (the error says what to type).
    """
    action = reproduce_action(cfg, resume)  # loop/runs/resume.py
    t0 = time.time()
    if action == "train":
        train(cfg, resume=resume)
    t_train = time.time() - t0
    path = Path(cfg.out)
    lock = acquire(path)  # the figures and summary are written by the folder's one writer
    try:
        tidy = load_run(path)
        if action == "redraw":
            t_train = float(tidy.loc[tidy["metric"] == "time_step", "value"].sum())
        text = _write(cfg, tidy, path, t_train, action)
    finally:
        lock.release()
    return text


def _write(cfg: RunConfig, tidy: pd.DataFrame, path: Path, t_train: float, action: str) -> str:
    png = path / "figures" / "training_curves.png"
    with writing(png):  # a full disk: exit code 4 naming the file (loop/faults/atomic.py)
        plots.save(plots.training_curves(tidy, smooth=3), png)
    table = summarize(tidy)
    took = (f"training took {t_train:.0f} s" if action == "train" else
            f"training took {t_train:.0f} s (recorded step times; figures re-made from the "
            "stored run)")
    md = ["# gradlab reproduce — summary", "",
          f"{cfg.steps} rollout steps × {cfg.prompts} prompts × G={cfg.G}, "
          f"{cfg.minibatches} optimizer steps per rollout, seed {cfg.seed}, task {cfg.task}"
          f" (difficulty {cfg.difficulty}); {took}.", "",
          table.to_markdown(index=False, floatfmt=".3g"), "",
          "Figures: figures/training_curves.png. Metrics: metrics.jsonl (gradlab.load_run)."]
    text = "\n".join(md)
    write_file(path / "summary.md", text + "\n")
    return text
