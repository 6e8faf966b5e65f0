"""`gradlab audit trl`: which of TRL's GRPO loss settings cancel the shared-token gradient.

For each `loss_type` × `importance_sampling_level`, a few real `GRPOTrainer` steps on the tiny
policy, on-policy (one optimizer step per generation batch) and off-policy
(`steps_per_generation=4`: four optimizer steps per generation batch, TRL's row shuffle), with
W measured by `GradlabGRPOTrainer`'s hook. Pooled over the run's generation batches:
ρ = Σ|d| / Σ|W| at full-group (and trie) nodes, ρ per optimizer step (the node sums taken
inside each optimizer step: what one update can cancel), the share of split groups, and, where
gradlab has the loss in closed form, the attribution of the residual to coupling / length /
clip. Writes trl_audit.csv and trl_audit.md into --out (default figures/).

    gradlab audit trl [--quick] [--options] [--out DIR] [--workload lengths|arithmetic|both]

--options adds the rows of `trl_options` (TRL options that mask or reweight tokens, the
emulated vLLM importance-sampling corrections, steps_per_generation) on the dapo loss; every
run writes trl_audit.json beside the tables (command, provenance, seconds).
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
import time
from pathlib import Path

import pandas as pd

from .trl_setup import (
    GSPO_EPS,
    OFF_SPG,
    WORKLOADS,
    Workload,
    grpo_args,
    make_trainer,
    pool_windows,
    quiet,
)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")


# ----------------------------------------------------------------------------- measuring


def audit_setting(loss_type: str, level: str, off: bool, *, workload: Workload, gens: int,
                  dfpo: str | None = None, seed: int = 0) -> dict:
    """Run one TRL setting for `gens` generation batches; pooled figures as a dict."""
    from ..trl.host import closed_form
    from ..trl.trainer import GradlabConfig

    spg = OFF_SPG if off else 1
    with tempfile.TemporaryDirectory() as tmp, quiet():
        args = grpo_args(loss_type, level, spg, gens * spg, tmp, seed=seed)
        tr = make_trainer(args, workload, GradlabConfig(store=None, dfpo=dfpo, keep_windows=True,
                                                         instruments="off"))
        tr.train()
    obj = closed_form(loss_type, level, args) if dfpo is None else None
    row = {"workload": workload.name, "loss_type": loss_type, "level": level,
           "dfpo": dfpo or "", "policy": "off" if off else "on"}
    row.update(pool_windows(tr.gradlab_windows, obj))
    return row


def settings(quick: bool) -> list[tuple[str, str, str | None]]:
    """(loss_type, level, dfpo) rows of the table."""
    if quick:
        return [("dr_grpo", "token", None), ("grpo", "sequence", None), ("grpo", "sequence", "orth")]
    rows = [(lt, lv, None) for lt in LOSS_TYPES for lv in LEVELS]
    return rows + [("grpo", "sequence", "orth"), ("grpo", "sequence", "min"), ("grpo", "token", "orth")]


# ----------------------------------------------------------------------------- the table


def run_audit(quick: bool = False, workloads: tuple[str, ...] = ("lengths",), seed: int = 0,
              log=print) -> pd.DataFrame:
    """Long table: one row per (workload, loss_type, level, dfpo, policy)."""
    gens_on, gens_off = (2, 1) if quick else (6, 3)
    rows = []
    for wl in workloads:
        for lt, lv, dfpo in settings(quick):
            for off in (False, True):
                t0 = time.perf_counter()
                row = audit_setting(lt, lv, off, workload=WORKLOADS[wl],
                                    gens=gens_off if off else gens_on,
                                    dfpo=dfpo, seed=seed)
                rows.append(row)
                log(f"  {wl:10s} {lt:8s} {lv:8s} {dfpo or '':5s} {row['policy']:3s} "
                    f"ρ={row['rho']:.3f} ρ_step={row['rho_step']:.3f} "
                    f"({time.perf_counter() - t0:.1f} s)")
    return pd.DataFrame(rows)


def _num(x: float) -> str:
    if pd.isna(x):
        return "—"
    return "≈0" if abs(x) < 1e-5 else f"{x:.2f}"


def to_markdown(df: pd.DataFrame, command: str) -> str:
    """One markdown table per workload: on- and off-policy side by side."""
    from .trl_options import OPTIONS_NOTE, options_markdown

    out = [f"<!-- made by: {command} -->", ""]
    key = ["workload", "loss_type", "level", "dfpo"]
    opts = df[df["option"].notna()] if "option" in df else df.iloc[:0]
    df = df[df["option"].isna()] if "option" in df else df
    for wl, d in df.groupby("workload", sort=False):
        on = d[d.policy == "on"].set_index(key[1:])
        off = d[d.policy == "off"].set_index(key[1:])
        out += [f"**Workload `{wl}`** — {WORKLOADS[wl].about}.", "",
                ("| loss_type | IS level | DFPO | ρ full-group, on-policy | ρ trie, on-policy "
                "| ρ full-group, off-policy | ρ per optimizer step, off | split groups, off "
                "| closed-form ρ, off | attribution off: coupling / length / clip "
                "| split's share of the per-step residual |"),
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for idx in on.index:
            a, b = on.loc[idx], off.loc[idx]
            att = "—" if pd.isna(b.get("attr_clip")) else " / ".join(
                _num(b[f"attr_{m}"]) for m in ("coupling", "length", "clip"))
            out.append(f"| {idx[0]} | {idx[1]} | {idx[2] or '—'} | {_num(a.rho)} | "
                       f"{_num(a.rho_trie)} | {_num(b.rho)} | {_num(b.rho_step)} | "
                       f"{_num(b.split)} | {_num(b.get('rho_closed_form'))} | {att} | "
                       f"{_num(b.split_attr)} |")
        out.append("")
        if len(opts[opts.workload == wl]):
            out += options_markdown(opts[opts.workload == wl])
    out.append(
        "ρ = Σ|d|/Σ|W| (0: the shared-token gradient cancels; 1: not at all), W measured by the "
        "hook on TRL's own loss and pooled over the run's generation batches. On-policy: one "
        f"optimizer step per generation batch; off-policy: steps_per_generation={OFF_SPG} "
        "(gradient_accumulation_steps=1), TRL's row shuffle. 'ρ per optimizer step' takes the "
        "node sums inside each optimizer step; 'split groups' is the share of groups whose rows "
        "land in more than one optimizer step (DFPO rows keep groups whole). Attribution "
        "(gradlab's closed form, where it has the loss): share of the batch residual removed by "
        "switching each mechanism off. Token level: TRL's default ε = 0.2 (cispo ε_high = 5); "
        f"sequence level: the GSPO recipe ε = {GSPO_EPS}.")
    if len(opts):
        out += ["", OPTIONS_NOTE]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ...cli.args import Parser  # one-line errors, as every gradlab command
    from ...provenance import write_in_process

    p = Parser(prog="gradlab audit", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trainer", choices=["trl"], help="the trainer to audit")
    p.add_argument("--quick", action="store_true", help="three settings, fewer steps (CI)")
    p.add_argument("--out", default="figures", help="folder for trl_audit.csv / .md")
    p.add_argument("--options", action="store_true", help="add the option rows (masks, "
                   "reweighting, emulated vLLM IS corrections, steps_per_generation) on dapo")
    p.add_argument("--workload", default="both", choices=[*WORKLOADS, "both"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        print(f"gradlab audit trl: {e.name} is not installed: pip install 'gradlab[trl]'")
        return 2
    wls = tuple(WORKLOADS) if a.workload == "both" else (a.workload,)
    if a.quick and a.workload == "both":
        wls = ("lengths",)
    t0 = time.perf_counter()
    df = run_audit(a.quick, wls, a.seed)
    if a.options:
        from .trl_options import run_options

        df = pd.concat([df, pd.DataFrame(run_options(a.quick, wls, a.seed))], ignore_index=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "gradlab audit trl" + (" --quick" if a.quick else "") + (
        " --options" if a.options else "") + (
        f" --workload {a.workload}" if a.workload != "both" else "") + (
        f" --seed {a.seed}" if a.seed else "") + f" --out {shlex.quote(a.out)}"
    df.to_csv(out / "trl_audit.csv", index=False)
    md = to_markdown(df, cmd)
    (out / "trl_audit.md").write_text(md)
    print(md)
    secs = time.perf_counter() - t0
    write_in_process(out / "trl_audit.json", cmd, secs)
    print(f"wrote {out / 'trl_audit.csv'}, {out / 'trl_audit.md'} and trl_audit.json in "
          f"{secs:.0f} s")
    return 0
