"""The short tables `gradlab run / tandem / reproduce / variance` print when they finish.

Per objective of a run: reward (mean of the last steps), held-out accuracy (the last
evaluation), the cancellation ratio ρ at trie and full-group nodes (mean over the steps where it
is defined) and the learning tax share (mean over the steps it was measured, every --tax-every,
and defined). A value that no step defines prints "—" with its reason (`gradlab.viz.undefined`). Per objective of
a variance measurement: the gradient noise and its noise ratios against GRPO and GSPO, each
with its 95 % bootstrap interval. Definitions: docs/concepts/shared-nodes.md#residual-and-cancellation-ratio,
docs/concepts/tax.md, docs/concepts/variance.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

LAST = 5  # steps averaged for the final reward


RATIOS = ("rho_trie", "rho_prefix", "tax_share")


def _fmt(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def run_rows(tidy: pd.DataFrame, last: int = LAST) -> pd.DataFrame:
    """One row per objective of a run's tidy table: steps, reward, heldout, rho_trie,
    rho_prefix, tax_share, and why_<metric> for each of the last three.

    ρ and the tax share are means over the steps where they are defined (an undefined step is
    NaN in the store and left out); NaN where no step defines them, why_<metric> then says why
    (`gradlab.viz.undefined.reason`: "no gradient: every group tied", "no full-group token",
    "not measured", ...), else None. reward and heldout are NaN where not measured."""
    from .undefined import reason

    rows = []
    for obj, d in tidy.groupby("objective", sort=False):
        wide = d.pivot_table(index="step", columns="metric", values="value", dropna=False)
        col = {m: wide[m].dropna() if m in wide else pd.Series(dtype=float)
               for m in ("reward", "eval_accuracy", *RATIOS)}
        reward, held = col["reward"], col["eval_accuracy"]
        row = {"objective": obj, "steps": int(wide.index.max()) + 1 if len(wide) else 0,
               "reward": reward.tail(last).mean() if len(reward) else math.nan,
               "heldout": held.iloc[-1] if len(held) else math.nan}
        for m in RATIOS:
            row[m] = col[m].mean() if len(col[m]) else math.nan
            row[f"why_{m}"] = None if len(col[m]) else reason(wide, m)
        rows.append(row)
    return pd.DataFrame(rows)


def run_table(run: str | Path, last: int = LAST) -> str:
    """The Markdown table of `run_rows` for run folder `run`: an undefined or unmeasured ρ or
    tax share is "—" with a footnote marker, its reason in a legend line under the table."""
    from ..loop.runs.store import load_run
    from .undefined import NOT_MEASURED, Footnotes

    df = run_rows(load_run(run), last)
    notes = Footnotes()
    lines = [f"| objective | reward (last {last} steps) | held-out accuracy (%) | ρ trie | "
             "ρ full-group | tax share |", "|---|---|---|---|---|---|"]
    for r in df.to_dict("records"):  # accuracy in percent, as gradlab eval prints it
        cells = [notes.cell(r["reward"], NOT_MEASURED), notes.cell(100 * r["heldout"], NOT_MEASURED),
                 *(notes.cell(r[m], r[f"why_{m}"]) for m in RATIOS)]  # markers in column order
        lines.append(f"| {r['objective']} | " + " | ".join(cells) + " |")
    legend = notes.legend().replace("\n", "  \n")  # Markdown: one line each (hard breaks)
    return "\n".join(lines) + "\n\n" + NOTE + ("\n\n" + legend if legend else "")


NOTE = ("ρ: cancellation ratio at shared nodes (0 = the shared part cancels; undefined, —, "
        "where there is no gradient at shared tokens or no such token); tax share: "
        "‖g_tax‖ / ‖g‖ (undefined where g = 0); values below 1e-6 are float round-off; means "
        "over the steps where defined.")


def write_run_summary(run: str | Path, cfg=None) -> str:
    """Write RUN/summary.md (the table of `run_table` under a one-line description of the run)
    and return the table."""
    from ..atomic import write_file

    table = run_table(run)
    what = (f"{cfg.steps} rollout steps × {cfg.prompts} prompts × G={cfg.G} on {cfg.task}, "
            f"rollout {cfg.rollout}, mode {cfg.mode}\n\n" if cfg is not None else "")
    note = ("Held-out accuracy: sampled accuracy (%) on problems never trained on, at the last "
            "evaluation (--eval-every).")
    write_file(Path(run) / "summary.md", f"# gradlab run: {Path(run).name}\n\n{what}{table}\n\n{note}\n")
    return table


def variance_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Summary rows of a `measure_variance` table, one per objective: grad_noise and
    noise_ratio_vs_grpo / _vs_gspo with their _lo / _hi (NaN where absent)."""
    s = df[df["batch"].isna()].pivot_table(index="objective", columns="metric", values="value",
                                           sort=False)
    keys = [f"{m}{x}" for m in ("grad_noise", "noise_ratio_vs_grpo", "noise_ratio_vs_gspo")
            for x in ("", "_lo", "_hi")]
    return s.reindex(columns=keys).reset_index()


def variance_table(df: pd.DataFrame) -> str:
    """Markdown: per objective the noise tr Cov(g)/⟨ḡ, g_ref⟩ and the ratios to GRPO and GSPO,
    each as value [95 % interval]."""
    def cell(r: pd.Series, m: str) -> str:
        if pd.isna(r[m]):
            return "—"
        return f"{r[m]:.3g} [{r[m + '_lo']:.3g}, {r[m + '_hi']:.3g}]"

    lines = ["| objective | gradient noise | noise ratio vs GRPO | noise ratio vs GSPO |",
             "|---|---|---|---|"]
    for _, r in variance_rows(df).iterrows():
        lines.append(f"| {r['objective']} | {cell(r, 'grad_noise')} | "
                     f"{cell(r, 'noise_ratio_vs_grpo')} | {cell(r, 'noise_ratio_vs_gspo')} |")
    return "\n".join(lines) + "\n\nvalue [95 % bootstrap interval over the K batches]; a ratio < 1: less noise than the baseline."
