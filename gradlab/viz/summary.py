"""The short tables `gradlab run / tandem / reproduce / variance` print when they finish.

Per objective of a run: reward (mean of the last steps), held-out accuracy (the last
evaluation), the cancellation ratio ρ at trie and full-group nodes (mean over steps) and the
learning tax share (mean over the steps it was measured, every --tax-every). Per objective of
a variance measurement: the gradient noise and its noise ratios against GRPO and GSPO, each
with its 95 % bootstrap interval. Definitions: docs/concepts/shared-nodes.md#residual-and-cancellation-ratio,
docs/concepts/tax.md, docs/concepts/variance.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

LAST = 5  # steps averaged for the final reward


def _fmt(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def run_rows(tidy: pd.DataFrame, last: int = LAST) -> pd.DataFrame:
    """One row per objective of a run's tidy table: steps, reward, heldout, rho_trie,
    rho_prefix, tax_share (NaN where not measured)."""
    rows = []
    for obj, d in tidy.groupby("objective", sort=False):
        wide = d.pivot_table(index="step", columns="metric", values="value")
        col = {m: wide[m].dropna() if m in wide else pd.Series(dtype=float)
               for m in ("reward", "eval_accuracy", "rho_trie", "rho_prefix", "tax_share")}
        reward, held = col["reward"], col["eval_accuracy"]
        rows.append({"objective": obj, "steps": int(wide.index.max()) + 1 if len(wide) else 0,
                     "reward": reward.tail(last).mean() if len(reward) else math.nan,
                     "heldout": held.iloc[-1] if len(held) else math.nan,
                     "rho_trie": col["rho_trie"].mean(), "rho_prefix": col["rho_prefix"].mean(),
                     "tax_share": col["tax_share"].mean()})
    return pd.DataFrame(rows)


def run_table(run: str | Path, last: int = LAST) -> str:
    """The Markdown table of `run_rows` for run folder `run`."""
    from ..loop.runs.store import load_run

    df = run_rows(load_run(run), last)
    lines = [f"| objective | reward (last {last} steps) | held-out accuracy | ρ trie | "
             "ρ full-group | tax share |", "|---|---|---|---|---|---|"]
    for r in df.itertuples():
        lines.append(f"| {r.objective} | {_fmt(r.reward)} | {_fmt(r.heldout)} | "
                     f"{_fmt(r.rho_trie)} | {_fmt(r.rho_prefix)} | {_fmt(r.tax_share)} |")
    return "\n".join(lines) + "\n\n" + NOTE


NOTE = ("ρ: cancellation ratio at shared nodes (0 = the shared part cancels); tax share: "
        "‖g_tax‖ / ‖g‖; values below 1e-6 are float round-off; —: not measured.")


def write_run_summary(run: str | Path, cfg=None) -> str:
    """Write RUN/summary.md (the table of `run_table` under a one-line description of the run)
    and return the table."""
    from ..loop.faults.atomic import write_file

    table = run_table(run)
    what = (f"{cfg.steps} rollout steps × {cfg.prompts} prompts × G={cfg.G} on {cfg.task}, "
            f"rollout {cfg.rollout}, mode {cfg.mode}\n\n" if cfg is not None else "")
    note = ("Held-out accuracy: sampled accuracy on problems never trained on, at the last "
            "evaluation (--eval-every).")
    write_file(Path(run) / "summary.md", f"# gradlab run: {Path(run).name}\n\n{what}{table} {note}\n")
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
