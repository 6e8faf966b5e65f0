"""The real-model study in TRL: figures/real_trl.{csv,json,png} and the results table of
figures/real_trl.md, from the runs of examples/real_trl.py (one folder per objective).

    python -m analyses.figures.real_trl_figure --runs runs/real_trl          # token/, gspo/, dfpo/

Each objective's folder holds the recipe's real_trl.csv (objective, step, metric, value) and
provenance.json (code hash, commit, machine). The tidy CSV is their rows, sorted; the JSON lists
the runs with their provenance and the table's numbers; the figure has one panel per question:
reward and held-out accuracy, entropy, the share of W mass at shared tokens (whole group and
trie nodes), ρ at both, the learning tax and the drift at full-group tokens. One run per objective: the table gives means over
blocks of steps, with no interval (steps of one run are not independent samples).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.tools.quoted_data import real_trl_cell, replace_table  # noqa: E402
from gradlab import jsonio

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "figures"
OBJECTIVES = {"token": "TRL default (token)", "gspo": "GSPO", "dfpo": "DFPO Min-Replace"}
# (metric, label, how a block of steps reduces it); NaN steps are skipped by the mean
TABLE = (("reward", "reward", "mean"), ("heldout_acc", "held-out acc", "last"),
         ("entropy", "entropy (nats)", "mean"), ("completion_length", "tokens", "mean"),
         ("has_prefix", "steps with a full-group token", "frac"),
         ("share_prefix", "W share, full group", "mean"), ("share_trie", "W share, trie", "mean"),
         ("rho_prefix", "ρ full group", "mean"), ("rho_trie", "ρ trie", "mean"),
         ("drift_node_dlogp", "drift at full-group tokens", "mean"),
         ("drift_node_dlogp_mean", "drift of full-group tokens per optimizer step", "mean"),
         ("tax_share", "‖g_tax‖/‖g‖", "mean"))
# Runs of examples/real_trl.py log gradlab's instrument names: `n_shared_prefix`, and
# `drift_node_dlogp_mean` (how one optimizer step moved a full-group token), with no separate
# tax timing. A recipe CSV of the earlier window-level figures holds `nodes_prefix`,
# `drift_node_dlogp` (l_used − l_old over the generation batch) and `time_tax`; both render, a
# metric a CSV lacks is left out of the table.


def load(runs: Path) -> tuple[pd.DataFrame, list[dict]]:
    """(tidy rows of every objective, one provenance row per objective's run)."""
    from gradlab.provenance import summary

    frames, prov = [], []
    for obj in OBJECTIVES:
        # one recipe run with every objective (runs/real_trl.csv, runs/OBJ/), or one run per
        # objective side by side (runs/OBJ/real_trl.csv, runs/OBJ/OBJ/)
        f = next((p for p in (runs / obj / "real_trl.csv", runs / "real_trl.csv") if p.is_file()),
                 None)
        if f is None:
            raise SystemExit(f"real_trl_figure: {runs}: no real_trl.csv for {obj} "
                             "(run examples/real_trl.py first)")
        d = pd.read_csv(f)
        frames.append(d[d["objective"] == obj])
        run = next((p for p in (runs / obj / obj, runs / obj)
                    if (p / "provenance.json").is_file()), runs / obj)
        row = summary(run, reused=False)  # shipped or not: python -m analyses.tools.provenance
        prov.append({"objective": obj, **row})
    df = pd.concat(frames, ignore_index=True).sort_values(["objective", "step", "metric"])
    return df.reset_index(drop=True), prov


def wide(df: pd.DataFrame) -> pd.DataFrame:
    """(objective, step) × metric, with has_prefix = 1 where a full-group token exists."""
    w = df.pivot_table(index=["objective", "step"], columns="metric", values="value",
                       aggfunc="first", dropna=False)
    count = next((c for c in ("n_shared_prefix", "nodes_prefix") if c in w), None)
    if count is not None:
        w["has_prefix"] = np.where(w[count].isna(), np.nan, (w[count] > 0).astype(float))
    return w


def blocks(w: pd.DataFrame, size: int) -> list[tuple[int, int]]:
    last = int(w.index.get_level_values("step").max())
    return [(lo, min(lo + size - 1, last)) for lo in range(1, last + 1, size)]


def table(w: pd.DataFrame, size: int = 20) -> tuple[str, dict]:
    """Markdown rows (metric × objective × block of steps) and the same numbers as a dict."""
    spans = blocks(w, size)
    head = "| metric | objective | " + " | ".join(f"steps {a}–{b}" for a, b in spans) + " |"
    lines = [head, "|---|---|" + "---:|" * len(spans)]
    out: dict = {}
    counts: dict = {}
    for metric, label, how in TABLE:
        for obj in OBJECTIVES:
            if metric not in w or obj not in w.index.get_level_values(0):
                continue
            s = w.loc[obj, metric]
            vals, ns = [], []
            for a, b in spans:
                part = s[(s.index >= (0 if how == "last" else a)) & (s.index <= b)].dropna()
                v = (part.iloc[-1] if how == "last" else part.mean()) if len(part) else math.nan
                vals.append(float(v))
                ns.append(len(part))
            out.setdefault(metric, {})[obj] = vals
            counts.setdefault(metric, {})[obj] = ns
            cells = [real_trl_cell(v, metric) + (f" ({n})" if how == "mean" and n else "")
                     for v, n in zip(vals, ns)]
            lines.append(f"| {label} | {OBJECTIVES[obj]} | " + " | ".join(cells) + " |")
    lines.append("\n(n): the block's steps where the quantity is defined (reward and length: "
                 "generation steps; shares, ρ and drift: the second step of each batch, where "
                 "the window closes, with a gradient; the tax: steps with a gradient). — : "
                 "undefined at every step of the block.")
    return "\n".join(lines) + "\n", {"blocks": spans, "values": out, "counts": counts}


def times(w: pd.DataFrame) -> tuple[str, dict]:
    """Where a step's time went, per objective: medians over steps of the step, its sampling
    (generation steps), gradlab's window probes and the tax probe (seconds), and the tax probe's
    share of the step (median of the per-step ratio; "—" for a run that times the tax within
    gradlab's probes, with no `time_tax`)."""
    out, lines = {}, ["| objective | step (s) | sampling, generation steps (s) | window probes (s) | "
                      "tax probe (s) | tax probe / step | peak RSS (GiB) |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
    for obj in OBJECTIVES:
        if obj not in w.index.get_level_values(0):
            continue
        d = w.loc[obj]
        samp = d["time_sampling"][d["time_sampling"] > 0]
        tax = d["time_tax"] if "time_tax" in d else pd.Series(math.nan, index=d.index)
        r = {"step": d["time_step"].median(), "sampling": samp.median(),
             "probes": d["time_probes"].median(), "tax": tax.median(),
             "tax_of_step": (tax / d["time_step"]).median(),
             "peak_rss_gib": d["peak_rss_gib"].max()}
        out[obj] = {k: float(v) for k, v in r.items()}
        t = "—" if math.isnan(r["tax"]) else f"{r['tax']:.1f}"
        ts = "—" if math.isnan(r["tax_of_step"]) else f"{100 * r['tax_of_step']:.0f} %"
        lines.append(f"| {OBJECTIVES[obj]} | {r['step']:.1f} | {r['sampling']:.1f} | "
                     f"{r['probes']:.3f} | {t} | {ts} | {r['peak_rss_gib']:.2f} |")
    return "\n".join(lines) + "\n", out


def figure(w: pd.DataFrame, path: Path) -> None:
    """Six panels, the three objectives in each: lines are rolling means over 5 measured steps
    (faint: each step), dots the held-out accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward", "heldout_acc", "reward (line) · held-out acc (dots)", False),
              ("entropy", None, "entropy (nats / token)", False),
              ("share_prefix", "share_trie", "W share: full group (line) · trie (dashed)", False),
              ("rho_prefix", "rho_trie", "ρ: full group (line) · trie (dashed)", True),
              ("tax_share", None, "‖g_tax‖ / ‖g‖", False),
              ("drift_node_dlogp_mean" if "drift_node_dlogp_mean" in w else "drift_node_dlogp",
               None, "drift at full-group tokens (Δ log-prob)", False))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    axes = axes.ravel()
    colors = dict(zip(OBJECTIVES, ("tab:gray", "tab:blue", "tab:orange")))
    for ax, (m1, m2, title, log) in zip(axes, panels):
        for obj, c in colors.items():
            if obj not in w.index.get_level_values(0):
                continue
            d = w.loc[obj]
            if m1 in d:  # window metrics exist every spg-th step: roll over the steps that have one
                y = d[m1].dropna()
                ax.plot(y.index, y, color=c, alpha=0.2, lw=0.8)
                ax.plot(y.index, y.rolling(5, min_periods=1).mean(), color=c, label=OBJECTIVES[obj])
            if m2 and m2 in d:
                y = d[m2].dropna()
                if m2 == "heldout_acc":
                    ax.plot(y.index, y, "o", color=c, ms=4)
                else:
                    ax.plot(y.index, y.rolling(5, min_periods=1).mean(), "--", color=c)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer step")
        if log:
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="runs/real_trl", help="folder with token/, gspo/, dfpo/")
    p.add_argument("--figures", default=str(FIGURES))
    p.add_argument("--block", type=int, default=20, help="steps per table column")
    a = p.parse_args(argv)
    out = Path(a.figures)
    df, prov = load(Path(a.runs))
    df.to_csv(out / "real_trl.csv", index=False)
    w = wide(df)
    md, numbers = table(w, a.block)
    steps = {o: int(w.loc[o].index.max()) for o in OBJECTIVES if o in w.index.get_level_values(0)}
    first = {o: _first(w, o) for o in steps}
    tmd, tnum = times(w)
    meta = {"runs": prov, "steps": steps, "first_full_group_step": first, "table": numbers,
            "time": tnum, "gradient_steps": {o: gradient_steps(w, o) for o in steps},
            "command": "python examples/real_trl.py --objectives OBJ --steps 60 --G 8 "
                       "--prompts 2 --spg 2 --max-completion-length 128 --eval-every 10 "
                       "--eval-size 32 --tax-every 1 --save-every 5 --fewshot chat"}
    (out / "real_trl.json").write_text(jsonio.dumps(meta, indent=1) + "\n")
    figure(w, out / "real_trl.png")
    page = out / "real_trl.md"
    if page.is_file():
        text = page.read_text()
        try:
            text = replace_table(replace_table(text, "real_trl", md), "real_trl_time", tmd)
        except ValueError as e:
            raise SystemExit(f"{page}: {e}") from None
        page.write_text(text)
    print(md + "\n" + tmd)
    print(f"wrote {out / 'real_trl.csv'}, real_trl.json, real_trl.png; steps {steps}")
    return 0


def gradient_steps(w: pd.DataFrame, obj: str) -> dict:
    """Optimizer steps with a gradient (tax share defined: g ≠ 0) among the first step of each
    generation batch (it sampled: on-policy) and the later ones (off-policy), with the counts."""
    d = w.loc[obj]
    d = d[d.index > 0]
    sampled = d["time_sampling"] > 0
    out = {}
    for name, part in (("on_policy", d[sampled]), ("off_policy", d[~sampled])):
        out[name] = int(part["tax_share"].notna().sum()) if "tax_share" in part else 0
        out[name + "_steps"] = len(part)
    return out


def _first(w: pd.DataFrame, obj: str) -> int | None:
    """The first optimizer step with a token shared by a whole group, or None."""
    d = w.loc[obj]
    hit = d.index[d.get("has_prefix", pd.Series(dtype=float)).fillna(0) > 0]
    return int(hit[0]) if len(hit) else None


if __name__ == "__main__":
    sys.exit(main())
