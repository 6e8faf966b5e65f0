"""The data side of analyses/tools/quoted.py: records a quoted result may come from, and the pages'
data blocks.

A data block is prose whose numbers are derived (a share, a ratio of two experiments) and so
cannot be matched to one stored value: the page holds

    <!-- data:NAME -->text<!-- /data -->

and `render` replaces `text` with BLOCKS[kind](figures, arg) for NAME = "kind:arg". The test
holds every committed page equal to its rendering.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import t as student_t

from gradlab.stats import paired_interval

SEED_KEYS = ["experiment", "task", "layout", "matched", "objective"]
PAIRED = ("heldout_acc", "train_acc_last5", "heldout_sampled")
BLOCK = re.compile(r"<!-- data:([\w\-:/.\[\]=+]+) -->([^<]*)<!-- /data -->")  # body: no markup


def _group_stats(df: pd.DataFrame, keys: list[str], cols: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per group of `keys` and column of df with ≥ 2 values: (mean, lo, hi, NaN) t-interval
    rows and (mean, sd) rows."""
    g = df.groupby(keys, dropna=False, sort=False)[cols]
    m, s, k = (np.asarray(x, dtype=float).ravel() for x in (g.mean(), g.std(), g.count()))
    ok = k >= 2
    m, s, k = m[ok], s[ok], k[ok]
    half = student_t.ppf(0.975, k - 1) * s / np.sqrt(k)
    return np.column_stack([m, m - half, m + half, np.full_like(m, np.nan)]), np.column_stack([m, s])


def seed_records(seeds: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """From a seeds file: per (experiment, task, layout, matched, objective) and numeric column,
    the mean with its t interval and sd over seeds (also pooled over the objectives of one
    layout, as a table's "tokens" column); and every ordered pair of objectives of one
    (experiment, task, layout, matched), paired by seed on the accuracy columns, as (mean, lo,
    hi, p). Returns (intervals (n, 4), spreads (n, 2))."""
    keys = [k for k in SEED_KEYS if k in seeds]
    cols = [c for c in seeds.select_dtypes("number").columns if c not in ("seed", "G")]
    iv, sp = _group_stats(seeds, keys, cols)
    pooled, _ = _group_stats(seeds, [k for k in keys if k != "objective"], cols)
    rows = []
    acc = [c for c in PAIRED if c in seeds]
    for _, g in seeds.groupby([k for k in keys if k != "objective"], dropna=False, sort=False):
        for c in acc:
            w = g.pivot_table(index="seed", columns="objective", values=c, aggfunc="first")
            for a in w.columns:
                for b in w.columns:
                    if a == b:
                        continue
                    pair = w[[a, b]].dropna()
                    if len(pair) >= 2:
                        r = paired_interval(pair[a].to_numpy(), pair[b].to_numpy())
                        rows.append((r["mean"], r["lo"], r["hi"], r["p"]))
    return np.vstack([iv, pooled, np.asarray(rows, dtype=float).reshape(-1, 4)]), sp


def table_records(df: pd.DataFrame, drop: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """From any other table: in a long table (metric, value), per group of the columns not in
    `drop`, the mean with its t interval and sd; in every table (long ones pivoted on metric),
    each column x with x_lo and x_hi beside it as (x, x_lo, x_hi). Returns (intervals, spreads)."""
    iv, sp = [np.empty((0, 4))], [np.empty((0, 2))]
    if {"metric", "value"} <= set(df.columns):
        df = df.assign(value=pd.to_numeric(df["value"], errors="coerce"))
        keys = [c for c in df.columns if c not in drop and c != "value"]
        a, b = _group_stats(df, keys, ["value"])
        iv.append(a)
        sp.append(b)
        wide_keys = [k for k in keys if k != "metric"]
        df = (df.pivot_table(index=wide_keys, columns="metric", values="value", aggfunc="mean")
              .reset_index() if wide_keys else df.groupby("metric")["value"].mean().to_frame().T)
    for c in df.columns:
        if f"{c}_lo" in df and f"{c}_hi" in df:
            x = df[[c, f"{c}_lo", f"{c}_hi"]].apply(pd.to_numeric, errors="coerce").to_numpy(float)
            iv.append(np.column_stack([x, np.full(len(x), np.nan)]))
    return np.vstack(iv), np.vstack(sp)


def _gspo_tax(figures: Path, exp: str) -> float:
    """GSPO's ‖g_tax‖/‖g‖, mean over rollout steps and seeds, of a Figure 3 experiment."""
    s = pd.read_csv(figures / f"{exp}_seeds.csv")
    return float(s[s["objective"] == "gspo"]["tax_share"].mean())


def gspo_tax(figures: Path, exp: str) -> str:
    """'1.28 %': GSPO's mean tax share in a Figure 3 experiment (its seeds file)."""
    return f"{100 * _gspo_tax(figures, exp):.3g} %"


def gspo_tax_ratio(figures: Path, arg: str) -> str:
    """'0.98×': GSPO's mean tax share of experiment a over experiment b ('a/b')."""
    a, b = arg.split("/")
    den = _gspo_tax(figures, b)
    return "— (zero denominator)" if den == 0 else f"{_gspo_tax(figures, a) / den:.2f}×"


def gspo_tax_steps(figures: Path, folder: str) -> str:
    """'mean 1.28 %, median 0.11 %, max 24 %': GSPO's tax share over every measured rollout
    step of every seed, from <folder>/figure3.csv ('.' for figures/)."""
    d = pd.read_csv(figures / folder / "figure3.csv")
    v = d[(d["objective"] == "gspo") & (d["metric"] == "tax_share")]["value"].dropna()
    return (f"mean {100 * v.mean():.3g} %, median {100 * v.median():.2g} %, "
            f"max {100 * v.max():.2g} %")


def tax_ratio(figures: Path, arg: str) -> str:
    """'3.7 %': objective a's mean tax share over objective b's in one experiment's seeds file
    ('EXP:a/b'; its independent-layout rows where it has layouts)."""
    exp, _, pair = arg.partition(":")
    a, b = pair.split("/")
    s = pd.read_csv(figures / f"{exp}_seeds.csv")
    s = s[s["layout"] == "independent"] if "layout" in s else s
    tax = s.groupby("objective")["tax_share"].mean()
    return "— (zero denominator)" if tax[b] == 0 else f"{100 * tax[a] / tax[b]:.2g} %"


def trl_cost(figures: Path, arg: str) -> str:
    """'1.04× (0.98–1.10)': a runner's time per optimizer step over plain TRL's, the median over
    rounds of the ratio within a round (and its range), from real_trl_cost.json ('RUNNER', or
    'RUNNER:rss' for peak memory)."""
    runner, _, what = arg.partition(":")
    d = json.loads((figures / "real_trl_cost.json").read_text())
    v = d["ratios"][runner]["peak_rss_gib" if what == "rss" else "median_step_s"]
    med = float(np.median(v))
    return f"{med:.2f}×" + (f" ({min(v):.2f}–{max(v):.2f})" if len(v) > 1 and what != "rss" else "")


def real_trl(figures: Path, arg: str) -> str:
    """'40.4 %': one cell of figures/real_trl.md's table ('METRIC:OBJECTIVE:BLOCK', block 0..),
    from real_trl.json, formatted as the table formats it."""
    metric, obj, i = arg.split(":")
    v = json.loads((figures / "real_trl.json").read_text())["table"]["values"][metric][obj][int(i)]
    return real_trl_cell(float("nan") if v is None else float(v), metric)


PERCENT_METRICS = ("share_prefix", "share_trie", "tax_share", "has_prefix", "reward", "heldout_acc")


def real_trl_cell(v: float, metric: str) -> str:
    """One number of figures/real_trl.md's table as the table prints it (and a page quotes it):
    '40.4 %' for a share or rate (PERCENT_METRICS), 3 significant digits otherwise, '—' for NaN
    (undefined)."""
    if math.isnan(v):
        return "—"
    if metric in PERCENT_METRICS:
        return f"{100 * v:.1f} %"
    return f"{v:.3g}"


def real_trl_grad(figures: Path, arg: str) -> str:
    """'8 of its 30': optimizer steps with a gradient among an objective's on- or off-policy
    steps, from real_trl.json ('OBJECTIVE:on_policy' or 'OBJECTIVE:off_policy')."""
    obj, kind = arg.split(":")
    g = json.loads((figures / "real_trl.json").read_text())["gradient_steps"][obj]
    return f"{g[kind]} of {g[kind + '_steps']}"


def instrument_overhead(figures: Path, arg: str) -> str:
    """'1.29×': CPU time per optimizer step of a configuration over the uninstrumented step,
    from instrument_overhead.json ('MODEL:CONFIGURATION')."""
    model, _, config = arg.partition(":")
    d = json.loads((figures / "instrument_overhead.json").read_text())
    cpu = next(m for m in d["models"] if m["name"] == model)["cpu_s"]
    return "— (zero denominator)" if cpu["off"] == 0 else f"{cpu[config] / cpu['off']:.2f}×"


BLOCKS = {"gspo-tax": gspo_tax, "gspo-tax-ratio": gspo_tax_ratio, "gspo-tax-steps": gspo_tax_steps,
          "tax-ratio": tax_ratio, "trl-cost": trl_cost, "real-trl": real_trl,
          "real-trl-grad": real_trl_grad, "instrument-overhead": instrument_overhead}


def replace_table(text: str, name: str, body: str) -> str:
    """`text` with the body of its `<!-- table:NAME -->` … `<!-- /table -->` block replaced by
    `body` (a table a script rewrites from its data); a page without the block is an error
    naming it."""
    block = re.compile(rf"(<!-- table:{re.escape(name)} -->\n).*?(<!-- /table -->)", re.S)
    if not block.search(text):
        raise ValueError(f"no <!-- table:{name} --> … <!-- /table --> block")
    return block.sub(lambda m: m.group(1) + body + m.group(2), text)


def render(text: str, figures: Path) -> str:
    """`text` with every data block rewritten from the data under `figures`; an unknown block
    name is an error naming it."""
    def one(m: re.Match) -> str:
        kind, _, arg = m.group(1).partition(":")
        if kind not in BLOCKS:
            raise ValueError(f"data block '{m.group(1)}': unknown kind '{kind}' "
                             f"(known: {', '.join(BLOCKS)})")
        return f"<!-- data:{m.group(1)} -->{BLOCKS[kind](figures, arg)}<!-- /data -->"

    return BLOCK.sub(one, text)
