"""The main job's reference numbers and the regression check `gradlab reproduce --check`.

Bitwise: a run is bitwise identical to another only on the same CPU model with the same torch
build and thread count (floating-point reduction order differs between kernels). On any other
machine round-off parts two runs of one seed within tens of steps, and they end as far apart as
two seeds do. So the reference holds, per objective and number, the spread of `n` seeds of the
main job, and the check asks whether a fresh run falls inside a 99.9 % prediction interval of
that spread:

    mean ± t_{0.9995, n−1} · sd · √(1 + 1/n)      (widened to an absolute floor per number)

That catches what breaks a loss (GRPO's ρ leaving round-off, GSPO's residual vanishing, nothing
learning) without flagging a run because it ran on another CPU; a difference of a few points
between objectives needs seeds and paired intervals (analyses/comparisons.py), not this check.
The reference ships with the package (gradlab/data/reproduce_reference.json) and names the
machine and code it was measured on; `analyses/main_job.py` re-makes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import t as student_t

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "reproduce_reference.json"
LEVEL = 0.999
# number → (absolute floor of its band, the number's range): round-off-level quantities (exact
# cancellation) get a band of at least ±1e-6 whatever their seed spread; bands are clipped to
# the range a number can take (accuracies, ρ, shares in [0, 1]; entropy ≥ 0)
UNIT = (0.0, 1.0)
CHECKED = {"acc_last5": (0.0, UNIT), "eval_accuracy_expected_final": (0.0, UNIT),
           "rho_prefix": (1e-6, UNIT), "rho_trie": (1e-6, UNIT), "shared_frac_prefix": (0.0, UNIT),
           "tax_share": (1e-6, UNIT), "entropy": (0.0, (0.0, float("inf")))}


def make_reference(summaries: list[pd.DataFrame], seeds: list[int], machine: dict) -> dict:
    """Reference bands from per-seed summaries (gradlab.loop.recipes.reproduce.summarize, one frame per
    seed of the same configuration)."""
    n = len(summaries)
    if n < 3:
        raise ValueError(f"make_reference: need at least 3 seeds, got {n}")
    q = float(student_t.ppf(1 - (1 - LEVEL) / 2, n - 1)) * np.sqrt(1 + 1 / n)
    numbers = {}
    for obj in summaries[0]["objective"]:
        for metric, (floor, (low, high)) in CHECKED.items():
            vals = [float(s.set_index("objective").loc[obj, metric]) for s in summaries
                    if metric in s.columns]
            if len(vals) != n:
                continue
            mean, sd = float(np.mean(vals)), float(np.std(vals, ddof=1))
            half = max(q * sd, floor)
            numbers[f"{obj}/{metric}"] = {"values": vals, "mean": mean, "sd": sd,
                                          "lo": max(mean - half, low), "hi": min(mean + half, high)}
    return {"gradlab_reference": 1, "level": LEVEL, "seeds": list(seeds), "machine": machine,
            "numbers": numbers}


def load_reference(path: str | Path = REFERENCE) -> dict:
    """The reference at `path`; a missing or corrupt file is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no reference at {path}")
    try:
        ref = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a gradlab reference ({e})") from None
    if ref.get("gradlab_reference") != 1 or "numbers" not in ref:
        raise ValueError(f"{path}: not a gradlab reference (no 'numbers')")
    return ref


def check(summary: pd.DataFrame, ref: dict) -> pd.DataFrame:
    """One row per reference number: objective, metric, value, lo, hi, inside (bool). A number
    the run lacks (another objective list, evaluation off) is reported with inside=False."""
    s = summary.set_index("objective")
    rows = []
    for key, r in ref["numbers"].items():
        obj, metric = key.split("/", 1)
        have = obj in s.index and metric in s.columns and np.isfinite(s.loc[obj, metric])
        v = float(s.loc[obj, metric]) if have else float("nan")
        rows.append({"objective": obj, "metric": metric, "value": v, "lo": r["lo"],
                     "hi": r["hi"], "inside": bool(have and r["lo"] <= v <= r["hi"])})
    return pd.DataFrame(rows)


def report(rows: pd.DataFrame, ref: dict) -> str:
    """Markdown: per number inside / outside, and the machine the reference was measured on."""
    t = rows.assign(band=rows.apply(lambda r: f"[{r['lo']:.3g}, {r['hi']:.3g}]", axis=1),
                    verdict=rows["inside"].map({True: "inside", False: "OUTSIDE"}))
    m = ref["machine"]
    head = (f"Reference: {len(ref['seeds'])} seeds of the main job on {m.get('cpu_model')}, "
            f"torch {m.get('torch')}, {m.get('threads')} thread(s), code {m.get('code_hash')}; "
            f"bands: {100 * ref['level']:.1f} % prediction intervals of the seed spread.")
    bad = int((~rows["inside"]).sum())
    tail = "all inside" if bad == 0 else f"{bad} of {len(rows)} numbers OUTSIDE their band"
    return "\n".join([head, "", t[["objective", "metric", "value", "band", "verdict"]].to_markdown(
        index=False, floatfmt=".3g"), "", tail])
