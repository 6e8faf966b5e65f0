"""The main job's reference numbers and the statistical half of `gradlab reproduce --check`.

Bitwise: a run is bitwise identical to another only on the same CPU model with the same torch
build and thread count (floating-point reduction order differs between kernels). On any other
machine round-off parts two runs of one seed within tens of steps, and they end as far apart as
two seeds do. So across machines the check is statistical: the reference holds, per objective
and number, the values of `n` seeds of the main job, the check runs `K` seeds, and each number
gets a two-sample t test of the two means at level `LEVEL` (per number, two-sided):

    t = (mean_check − mean_ref) / (s · √(1/n + 1/K))

with s the reference's seed sd (df n − 1) when K = 1, the pooled sd of both samples
(df n + K − 2) when K ≥ 2. Each number also gets the smallest shift the test detects with
probability `POWER` at that n and K (non-central t), in the number's own units. Round-off
quantities (exact cancellation: ρ and the tax share of GRPO and DFPO, ~1e-8 in the reference) are
held to a bound |x| ≤ 1e-3 instead (a rare clipped step leaves ~1e-4 in a run's mean). The same machine, torch build and thread count compare exactly instead
(`gradlab.loop.recipes.baseline`).

The shipped reference (gradlab/data/reproduce_reference.json) holds 5 seeds measured on another
machine; `analyses/studies/main_job.py` re-makes it.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import brentq
from scipy.stats import nct
from scipy.stats import t as student_t

from ... import jsonio
from ..config import FLAT_FLAGS, current_form

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "reproduce_reference.json"
LEVEL = 0.99  # per number, two-sided: the test flags a number when |t| > t_{1 − (1 − LEVEL)/2}
POWER = 0.8  # the power at which the detectable shift is stated
BAND_LEVEL = 0.999  # the prediction bands `make_reference` stores (lo, hi): informative only
ROUNDOFF = 1e-6  # a number whose reference values all lie within ±ROUNDOFF is round-off
# ... and is then held to |x| ≤ CANCELS: exact cancellation but for the rare step where a PPO
# clip fires (GRPO, main job, seed 8: ρ 0.027 at step 0, 1.8e-4 as a mean over the steps); a
# loss that no longer cancels sits at 0.05–0.2
CANCELS = 1e-3
# number → (absolute floor of its band, the number's range): round-off-level quantities (exact
# cancellation) get a band of at least ±1e-6; bands are clipped to the range a number can take
UNIT = (0.0, 1.0)
CHECKED = {"acc_last5": (0.0, UNIT), "eval_accuracy_expected_final": (0.0, UNIT),
           "rho_prefix": (ROUNDOFF, UNIT), "rho_trie": (ROUNDOFF, UNIT),
           "shared_frac_prefix": (0.0, UNIT), "tax_share": (ROUNDOFF, UNIT),
           "entropy": (0.0, (0.0, float("inf")))}


def make_reference(summaries: list[pd.DataFrame], seeds: list[int], machine: dict) -> dict:
    """The reference of per-seed summaries (gradlab.loop.recipes.reproduce.summarize, one frame
    per seed of the same configuration): per number its values, mean, sd and a
    `BAND_LEVEL` prediction band (lo, hi) for reading by eye."""
    n = len(summaries)
    if n < 3:
        raise ValueError(f"make_reference: need at least 3 seeds, got {n}")
    return {"gradlab_reference": 1, "level": BAND_LEVEL, "seeds": list(seeds),
            "machine": machine, "numbers": numbers_of(summaries)}


def numbers_of(summaries: list[pd.DataFrame]) -> dict:
    """{"objective/metric": {values, mean, sd, lo, hi}} over the `CHECKED` metrics present in
    every summary (sd and the band NaN for one seed, named with their reason in the entry's
    "undefined": gradlab.jsonio writes them as null)."""
    n = len(summaries)
    q = float(student_t.ppf(1 - (1 - BAND_LEVEL) / 2, n - 1)) * np.sqrt(1 + 1 / n) if n > 1 \
        else math.nan
    out = {}
    for obj in summaries[0]["objective"]:
        for metric, (floor, (low, high)) in CHECKED.items():
            vals = [float(s.set_index("objective").loc[obj, metric]) for s in summaries
                    if metric in s.columns and obj in set(s["objective"])]
            if len(vals) != n:
                continue
            mean = float(np.mean(vals))
            sd = float(np.std(vals, ddof=1)) if n > 1 else math.nan
            half = max(q * sd, floor) if n > 1 else math.nan
            entry = {"values": vals, "mean": mean, "sd": sd,
                     "lo": max(mean - half, low), "hi": min(mean + half, high)}
            if n == 1:
                entry["undefined"] = dict.fromkeys(("sd", "lo", "hi"), ONE_SEED)
            out[f"{obj}/{metric}"] = entry
    return out


ONE_SEED = "one seed: no seed spread"


def load_reference(path: str | Path = REFERENCE) -> dict:
    """The reference at `path` (the shipped one, or one of `gradlab reproduce
    --save-reference`); a missing or corrupt file is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no reference at {path}")
    try:
        ref = jsonio.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a gradlab reference ({e})") from None
    if not isinstance(ref, dict) or ref.get("gradlab_reference") not in (1, 2) \
            or "numbers" not in ref:
        raise ValueError(f"{path}: not a gradlab reference (no 'numbers')")
    if ref["gradlab_reference"] == 2 and not {"config", "seeds", "runs"} <= set(ref):
        raise ValueError(f"{path}: not a gradlab reference (a saved reference lacks "
                         "'config', 'seeds' or 'runs')")
    if isinstance(ref.get("config"), dict):  # a 0.1 reference's measuring flags: their spec
        flat = set(ref.get("typed", [])) & set(FLAT_FLAGS)
        ref["config"] = current_form(ref["config"], str(path))
        if flat:
            ref["typed"] = sorted(set(ref["typed"]) - flat | {"instruments"})
    return ref


def _nan(x) -> float:
    return math.nan if x is None else float(x)


@lru_cache(maxsize=256)
def detectable_shift(n: int, k: int, level: float = LEVEL, power: float = POWER) -> float:
    """The shift of the mean, in units of the seed sd, that the two-sample t test of `n`
    reference and `k` check seeds detects with probability `power` at `level` (two-sided;
    non-central t). NaN when the test has no degrees of freedom."""
    df = n - 1 if k == 1 else n + k - 2
    if n < 2 or df < 1:
        return math.nan
    crit = float(student_t.ppf(1 - (1 - level) / 2, df))
    se = math.sqrt(1 / n + 1 / k)

    def miss(nc: float) -> float:  # power at the non-centrality nc = shift / (sd · se), − target
        low = float(nct.cdf(-crit, df, nc))  # the far tail: ~0, and NaN in scipy at large nc
        return float(nct.sf(crit, df, nc)) + (0.0 if math.isnan(low) else low) - power

    approx = crit + float(student_t.ppf(power, df))  # the textbook sample-size formula
    try:  # exact where scipy's non-central t is finite (at df ≤ 2 it may not be)
        return se * brentq(miss, 0.0, 2 * approx)
    except ValueError:
        return se * approx


def stat_check(values: dict[str, list[float]], ref: dict, level: float = LEVEL) -> pd.DataFrame:
    """One row per reference number: objective, metric, n, ref_mean, ref_sd, k, mean (of the
    check seeds' `values[key]`), t, crit, detect (the shift detected at `POWER`, in the number's
    units), test ("t" or "bound"), flagged (bool), reason (why a value is "—", or why the
    number is flagged). A number the check run lacks is flagged."""
    rows = []
    for key, r in ref["numbers"].items():
        obj, metric = key.split("/", 1)
        ref_vals = np.array([_nan(v) for v in r["values"]])
        got = np.array([_nan(v) for v in values.get(key, [])])
        n, k = len(ref_vals), len(got)
        row = {"objective": obj, "metric": metric, "n": n, "ref_mean": float(np.mean(ref_vals)),
               "ref_sd": float(np.std(ref_vals, ddof=1)) if n > 1 else math.nan, "k": k,
               "mean": float(np.mean(got)) if k else math.nan, "t": math.nan, "crit": math.nan,
               "detect": math.nan, "test": "t", "flagged": False, "reason": ""}
        floor = CHECKED.get(metric, (0.0, UNIT))[0]
        if k == 0 or not np.isfinite(got).all():
            row.update(flagged=True, reason="missing or not finite in the check run")
        elif floor > 0 and np.all(np.abs(ref_vals) <= floor):  # exact cancellation: round-off
            row.update(test="bound", crit=CANCELS, detect=CANCELS,
                       flagged=bool(np.max(np.abs(got)) > CANCELS),
                       reason=f"cancels: |x| ≤ {CANCELS:g}")
        else:
            row.update(_t_test(ref_vals, got, level))
        rows.append(row)
    return pd.DataFrame(rows)


def _t_test(ref_vals: np.ndarray, got: np.ndarray, level: float) -> dict:
    n, k = len(ref_vals), len(got)
    df = n - 1 if k == 1 else n + k - 2
    if n < 2 or df < 1:
        return {"reason": f"the reference has {n} seed(s): no seed spread to test against"}
    ss = np.sum((ref_vals - ref_vals.mean()) ** 2) + (np.sum((got - got.mean()) ** 2) if k > 1
                                                      else 0.0)
    sd = math.sqrt(ss / df)
    diff = float(got.mean() - ref_vals.mean())
    crit = float(student_t.ppf(1 - (1 - level) / 2, df))
    ref_sd = float(np.std(ref_vals, ddof=1))
    out = {"crit": crit, "detect": detectable_shift(n, k, level) * ref_sd}
    if sd == 0.0:  # every seed gave the same value: any difference is a change
        same = abs(diff) <= 1e-12 * max(abs(ref_vals.mean()), abs(got.mean()))
        return {**out, "flagged": not same,
                "reason": "no seed spread: compared exactly" if same else
                "no seed spread and the value differs"}
    t = diff / (sd * math.sqrt(1 / n + 1 / k))
    return {**out, "t": t, "flagged": bool(abs(t) > crit)}


def fmt(x: float, spec: str = ".3g") -> str:
    """A number for a printed table: "—" for NaN or None, never "nan"."""
    return "—" if x is None or not np.isfinite(x) else format(float(x), spec)


def stat_report(rows: pd.DataFrame, ref: dict, why: str = "") -> str:
    """Markdown: per number the reference mean ± sd (n), the check's mean (K), t, the verdict
    and the shift the test detects; the test, level and power stated above the table."""
    m = ref.get("machine") or ref.get("fingerprint") or {}
    n, k = int(rows["n"].max()), int(rows["k"].max())
    df = n - 1 if k == 1 else n + k - 2
    head = (f"Statistical check{why}: {k} check seed(s) against {n} reference seed(s) measured "
            f"on {m.get('cpu_model')}, torch {m.get('torch')}, {m.get('threads')} thread(s), "
            f"code {m.get('code_hash') or ref.get('code_hash')}. Per number: two-sample t of the "
            f"means ({'reference sd' if k == 1 else 'pooled sd'}, df {df}) at "
            f"{100 * LEVEL:g} % (two-sided); 'detects' is the shift found with "
            f"{100 * POWER:g} % power at this K (more seeds: --seeds K). Numbers at round-off "
            f"in the reference (exact cancellation): |x| ≤ {CANCELS:g}.")
    table = ["| objective | metric | reference mean ± sd (n) | check mean (K) | t | verdict | "
             "detects |", "|---|---|---|---|---|---|---|"]
    for r in rows.itertuples():
        verdict = ("FLAGGED" if r.flagged else "ok") + (f" ({r.reason})" if r.reason else "")
        t = fmt(r.t, ".2g") if r.test == "t" else "bound"
        table.append(f"| {r.objective} | {r.metric} | {fmt(r.ref_mean)} ± {fmt(r.ref_sd, '.2g')} "
                     f"({r.n}) | {fmt(r.mean)} ({r.k}) | {t} | {verdict} | "
                     f"{'±' + fmt(r.detect, '.2g') if np.isfinite(r.detect) else '—'} |")
    bad = int(rows["flagged"].sum())
    untested = int((~rows["flagged"] & rows["t"].isna() & (rows["test"] == "t")
                    & (rows["reason"] != "no seed spread: compared exactly")).sum())
    tail = ("no number flagged" if bad == 0 else f"{bad} of {len(rows)} numbers FLAGGED")
    if untested:
        tail += f"; {untested} number(s) untested (—: the reason is in their row)"
    return "\n".join([head, "", *table, "", tail])
