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

--options adds the rows of `trl_audit_options` (TRL options that mask or reweight tokens, the
emulated vLLM importance-sampling corrections, steps_per_generation) on the dapo loss; every
run writes trl_audit.json beside the tables (command, provenance, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import shlex
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")
GSPO_EPS = (3e-4, 4e-4)  # TRL's GSPO recipe, used for every clipped loss at sequence level
OFF_SPG = 4  # optimizer steps per generation batch off-policy (the GSPO recipe)


@dataclass(frozen=True)
class Workload:
    """Prompts (ArithmeticTask at `difficulty` digits) and a reward ("strict" | "odd-length")."""

    name: str
    difficulty: int
    reward: str
    about: str


WORKLOADS = {
    "lengths": Workload("lengths", 3, "odd-length",
                        "3-digit additions (outside the policy's 2-digit training range, so "
                        "responses vary in length but share the 'so ' template); synthetic reward "
                        "1 for an odd number of characters, so rewarded and unrewarded responses "
                        "differ in length"),
    "arithmetic": Workload("arithmetic", 2, "strict",
                           "the default task: 2-digit additions, strict verifier (correct and "
                           "wrong responses mostly have equal lengths)"),
}


# ----------------------------------------------------------------------------- TRL setup


def dataset_and_reward(workload: Workload, n: int, seed: int = 0):
    """(datasets.Dataset of n prompts, a TRL reward function) for a workload."""
    from datasets import Dataset

    from ..loop.setup.task import ArithmeticTask, Problem

    task = ArithmeticTask(difficulty=workload.difficulty)
    probs = task.problems(n, seed=seed)
    ds = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer,
                             "solutions": list(p.solutions)} for p in probs])

    def strict(prompts, completions, answer, solutions, **kw) -> list[float]:
        return [task.reward(Problem(p, a, tuple(s)), c)
                for p, c, a, s in zip(prompts, completions, answer, solutions)]

    def odd_length(prompts, completions, **kw) -> list[float]:
        return [float(len(c) % 2) for c in completions]

    return ds, {"strict": strict, "odd-length": odd_length}[workload.reward]


def grpo_args(loss_type: str, level: str, spg: int, steps: int, out_dir: str, *,
              prompts: int = 4, G: int = 8, lr: float = 1e-3, seed: int = 0,
              max_completion_length: int | None = None, **extra):
    """GRPOConfig for a CPU run: `prompts` × G rows per generation batch, cut into `spg`
    optimizer steps (gradient_accumulation_steps=1), `steps` optimizer steps in all. Clip
    ranges: TRL's defaults at token level, the GSPO recipe at sequence level, ε_high = 5 for
    cispo (TRL's recommendation); `extra` overrides."""
    from trl import GRPOConfig

    from ..loop.setup.task import ArithmeticTask

    kw = dict(  # noqa: C408 (keyword style mirrors GRPOConfig)
        output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to=[], save_strategy="no", disable_tqdm=True, seed=seed,
        per_device_train_batch_size=prompts * G // spg, steps_per_generation=spg,
        gradient_accumulation_steps=1, num_generations=G, max_steps=steps, logging_steps=spg,
        learning_rate=lr, loss_type=loss_type, importance_sampling_level=level,
        max_completion_length=max_completion_length or ArithmeticTask().max_new_tokens)
    if loss_type == "cispo":
        kw["epsilon_high"] = 5.0
    elif level == "sequence":
        kw["epsilon"], kw["epsilon_high"] = GSPO_EPS
    kw.update(extra)
    return GRPOConfig(**kw)


def make_trainer(args, workload: Workload, gradlab=None, instrumented: bool = True,
                 n_prompts: int = 64, cls: type | None = None):
    """A GradlabGRPOTrainer (or `cls`; plain GRPOTrainer when not instrumented) on the shipped
    tiny policy and its char tokenizer, with TRL's per-step printing off."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    from ..loop.setup.policy import load_policy
    from .trl import GradlabGRPOTrainer

    model, tok = load_policy()
    ds, reward = dataset_and_reward(workload, n_prompts, seed=args.seed)
    kw = {"model": model, "reward_funcs": reward, "args": args, "train_dataset": ds, "processing_class": tok}
    if instrumented:
        tr = (cls or GradlabGRPOTrainer)(**kw, gradlab=gradlab)
    else:
        tr = GRPOTrainer(**kw)
    tr.remove_callback(PrinterCallback)
    return tr


@contextlib.contextmanager
def quiet():
    """Silence TRL / transformers warnings and info logs."""
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(n) for n in ("transformers", "trl", "accelerate", "datasets")]
    levels = [lg.level for lg in loggers]
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" bars of from_pretrained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)
            if bars:
                hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- measuring


def closed_form(loss_type: str, level: str, args):
    """gradlab's closed-form objective for a TRL setting, or None where gradlab has none."""
    from ..core import objectives

    eps = (args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    if level == "sequence":
        return objectives.get("gspo", eps=eps) if loss_type == "grpo" else None
    norm = {"grpo": "seq", "bnpo": "token", "dapo": "token", "dr_grpo": "const"}.get(loss_type)
    if norm is None:
        return None
    return objectives.get("grpo", eps=eps, norm=norm,
                          max_len=args.max_completion_length if norm == "const" else None)


def pool_windows(windows: list, objective=None) -> dict[str, float]:
    """ρ's pooled over windows (Σ|d| / Σ|W|), split share, closed-form ρ and attribution."""
    from ..core.cancellation import attribution, cancellation
    from ..core.nodes import shared_nodes
    from .trl import split_share, stepwise_residual

    acc = dict.fromkeys(("res", "mass", "res_step", "res_trie", "mass_trie", "res_cf", "mass_cf"), 0.0)
    shares, split = dict.fromkeys(("coupling", "length", "clip"), 0.0), []
    for w in windows:
        trie = shared_nodes(w.batch, "trie")
        sn = trie.full_group()
        c, ct = cancellation(w.W, w.batch, sn=sn), cancellation(w.W, w.batch, sn=trie)
        acc["res"] += c.residual
        acc["mass"] += c.mass
        acc["res_trie"] += ct.residual
        acc["mass_trie"] += ct.mass
        acc["res_step"] += stepwise_residual(w.W, sn, w.opt)[0]
        split.append(split_share(w.batch.group, w.opt))
        if objective is not None:
            cf = cancellation(objective.modulation(w.batch), w.batch, sn=sn)
            acc["res_cf"] += cf.residual
            acc["mass_cf"] += cf.mass
            att = attribution(objective, w.batch, "prefix")
            for k in shares:
                shares[k] += att[k] * att["residual"]
    r = lambda a, b: acc[a] / acc[b] if acc[b] > 0 else math.nan  # Σ|W| = 0: undefined
    out = {"rho": r("res", "mass"), "rho_trie": r("res_trie", "mass_trie"),
           "rho_step": r("res_step", "mass"), "split": sum(split) / max(len(split), 1)}
    # Share of the per-step residual that splitting adds; 0 when there is (numerically) none.
    real = acc["res_step"] > 1e-6 * acc["mass"]
    out["split_attr"] = (acc["res_step"] - acc["res"]) / acc["res_step"] if real else 0.0
    if objective is not None:
        out["rho_closed_form"] = r("res_cf", "mass_cf")
        out.update({f"attr_{k}": v / acc["res_cf"] if acc["res_cf"] > 0 else math.nan
                    for k, v in shares.items()})
    return out


def audit_setting(loss_type: str, level: str, off: bool, workload: Workload, gens: int,
                  dfpo: str | None = None, seed: int = 0) -> dict:
    """Run one TRL setting for `gens` generation batches; pooled figures as a dict."""
    from .trl import GradlabConfig

    spg = OFF_SPG if off else 1
    with tempfile.TemporaryDirectory() as tmp, quiet():
        args = grpo_args(loss_type, level, spg, gens * spg, tmp, seed=seed)
        tr = make_trainer(args, workload, GradlabConfig(store=None, dfpo=dfpo, keep_windows=True))
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
                row = audit_setting(lt, lv, off, WORKLOADS[wl], gens_off if off else gens_on,
                                    dfpo, seed)
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
    from .trl_audit_options import OPTIONS_NOTE, options_markdown

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
    from ..cli_args import Parser  # one-line errors, as every gradlab command
    from ..provenance import write_in_process

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
        from .trl_audit_options import run_options

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
