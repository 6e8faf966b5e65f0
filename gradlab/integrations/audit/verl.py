"""`gradlab audit verl`: which of verl's policy losses cancel the shared-token gradient.

Every verl policy-loss mode × loss_agg_mode, W measured through verl's *own* loss functions
(`gradlab_measure:<mode>`, W = −∂L/∂log_prob of verl's loss), on one mini-batch (one optimizer
step) cut into micro-batches, in five situations:

    on / whole      on-policy, every group whole inside one micro-batch
    off / whole     off-policy (current ≠ behaviour log-probs), groups whole
    on / split      on-policy, rows shuffled so groups straddle micro-batches, verl's engine
                    normalisers (config.global_batch_info from the mini-batch: verl ≥ 0.6 engine)
    on / split, local   the same with micro-batch-local normalisers (global_batch_info empty:
                    what the legacy dp_actor passed; verl issue #5625)
    off / split, local

ρ = Σ|d| / Σ(|W| + |c*|) at full-group nodes of the mini-batch (W summed over its micro-batches, as
the accumulated gradient is), mean over batches. Workloads: gradlab's synthetic groups
(`gradlab.testing.random_batch`) and the shipped tiny policy's rollouts. DFPO rows
(`gradlab_dfpo:<mode>`) need whole groups. Writes verl_audit.csv and verl_audit.md into --out.

    gradlab audit verl [--quick] [--options] [--out DIR] [--seeds N]

--options adds the rows of `verl_options` (verl's rollout correction: IS weights and
rejection sampling, against an emulated rollout engine) on vanilla / token-mean; every run
writes verl_audit.json beside the tables (command, provenance, seconds).
"""

from __future__ import annotations

import argparse
import shlex
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from .verl_setup import MICRO, N_GROUPS, G, actor_config, micro_rows

if TYPE_CHECKING:  # torch and pandas load in the functions: a mistaken option is answered at once
    import pandas as pd
    import torch

    from ...core.batch import TokenBatch

SITUATIONS = (("on", "whole", "engine"), ("off", "whole", "engine"), ("on", "split", "engine"),
              ("on", "split", "local"), ("off", "split", "local"))
QUICK_MODES = ("vanilla", "gspo")


def run_mini_batch(batch: TokenBatch, loss_mode: str, agg: str, parts: list[torch.Tensor],
                   normaliser: str = "engine", rollout_n: int = G) -> dict[str, float]:
    """Call verl's registered `loss_mode` once per micro-batch (forward + backward on a leaf
    copy of the log-probs), as verl's actor does; returns the last call's metrics dict."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from ..verl.losses import micro_batch

    cfg = actor_config(loss_mode, rollout_n)
    if normaliser == "engine":  # verl's engine: totals of the whole mini-batch (dp_size 1)
        cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch.mask.sum()),
                                     global_batch_size=batch.B, loss_scale_factor=None)
    fn = get_policy_loss_fn(loss_mode)
    metrics: dict = {}
    for k, rows in enumerate(parts):
        mb = batch.rows(rows)
        lp = mb.logps.detach().clone().requires_grad_(True)
        adv = mb.advantages.unsqueeze(-1).expand_as(lp)
        with micro_batch(mb.tokens, mb.group, last=k == len(parts) - 1):
            loss, metrics = fn(old_log_prob=mb.old_logps, log_prob=lp, advantages=adv,
                               response_mask=mb.mask, loss_agg_mode=agg, config=cfg,
                               rollout_is_weights=None)
        loss.backward()
    dev = relative_dev(batch, parts[-1], loss_mode, agg, cfg)
    return metrics if dev is None else {**metrics, "W_dev_closed_form": dev}


def relative_dev(batch: TokenBatch, rows: torch.Tensor, loss_mode: str, agg: str, cfg) -> float | None:
    """max |W − W_gradlab| / max |W| of the last loss call (micro-batch `rows`), W verl's own
    (the base loss's under DFPO), W_gradlab the closed form of its base loss on that
    micro-batch; None where gradlab has no closed form. The absolute max the `modulation`
    instrument reports (`gradlab/w_dev`) over a whole mini-batch is another number."""
    import torch

    from ...core.batch import TokenBatch
    from ..verl.losses import last_modulation
    from ..verl.parts import closed_form, global_totals, row_advantages

    base = loss_mode.split(":")[1] if ":" in loss_mode else "vanilla"
    mask = batch.mask[rows]
    form = closed_form(base, agg, cfg, mask.shape[1])
    if form is None:
        return None
    W, W_base = last_modulation()
    ref = W if W_base is None else W_base
    adv = row_advantages(batch.advantages[rows].unsqueeze(-1).expand(mask.shape), mask, False, "")
    micro = TokenBatch(tokens=batch.tokens[rows], mask=mask,
                       logps=batch.logps[rows].to(torch.float64),
                       old_logps=batch.old_logps[rows].to(torch.float64),
                       advantages=adv.to(torch.float64), group=batch.group[rows], validate=False,
                       **global_totals(cfg))
    Wc = form.modulation(micro)
    scale = float(ref.abs().max()) or 1.0  # W ≡ 0: the absolute deviation (0 = agree)
    return float((ref.double() - Wc).abs().max()) / scale


# ----------------------------------------------------------------------------- workloads


def synthetic_batches(seeds: int, off: bool) -> list[TokenBatch]:
    """gradlab's synthetic groups: N_GROUPS × G rows, T = 16, shared 3-token prefix."""
    from ...testing import random_batch

    return [random_batch(n_groups=N_GROUPS, G=G, T=16, seed=s, off_policy=0.3 if off else 0.0)
            for s in range(seeds)]


def tiny_model_batches(seeds: int, off: bool) -> list[TokenBatch]:
    """The shipped tiny policy (trained on 2-digit additions) on 3-digit additions, so response
    lengths vary (as TRL audit's `lengths` workload): N_GROUPS prompts × G samples, strict
    reward; off-policy = log-probs after one AdamW step (lr 2e-4, the loop's) on another rollout."""
    import torch

    from ...core import objectives
    from ...core.batch import TokenBatch, advantages
    from ...loop.numerics.logprobs import token_logps
    from ...loop.rollouts.rollout import generate
    from ...loop.setup.policy import load_policy
    from ...loop.setup.task import ArithmeticTask
    from ...testing import optimizer_step_on

    task, out = ArithmeticTask(difficulty=3), []
    for s in range(seeds):
        model, tok = load_policy()
        gen = torch.Generator().manual_seed(s)
        ro = generate(model, tok, task.problems(N_GROUPS, seed=s), G=G,
                      max_new_tokens=task.max_new_tokens, generator=gen, task=task)
        rewards = ro.rewards.double() + 0.01 * (torch.arange(ro.group.numel()) % 2)  # no all-equal
        adv = advantages(rewards, ro.group)
        if off:
            other = generate(model, tok, task.problems(N_GROUPS, seed=100 + s), G=G,
                             max_new_tokens=task.max_new_tokens, generator=gen, task=task)
            rows = torch.arange(other.group.numel())
            optimizer_step_on(model, other, rows, advantages(other.rewards + 0.01 * (rows % 2),
                              other.group), objectives.get("grpo").loss, lr=2e-4)
        with torch.no_grad():
            cur = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                              ro.response_mask)
        old = ro.old_logps if off else cur
        m = ro.response_mask
        out.append(TokenBatch(ro.response_ids, m, torch.where(m, cur, 0).double(),
                              torch.where(m, old, 0).double(), adv, ro.group))
    return out


WORKLOADS = {"synthetic": synthetic_batches, "tiny-model": tiny_model_batches}


# ----------------------------------------------------------------------------- the table


def audit_row(batches: dict, mode: str, agg: str) -> dict:
    """One (mode, agg) row: mean mini-batch ρ per situation, split share, W vs closed form."""
    import torch

    row = {"loss_mode": mode, "loss_agg_mode": agg}
    dfpo = mode.startswith("gradlab_dfpo")
    name = mode if dfpo else f"gradlab_measure:{mode}"
    for pol, grouping, norm in SITUATIONS:
        key = f"{pol}_{grouping}" + ("_local" if norm == "local" else "")
        rhos, splits, devs = [], [], []
        for s, b in enumerate(batches[pol]):
            torch.manual_seed(s)  # clip_cov / kl_cov choose tokens with the global RNG
            try:
                m = run_mini_batch(b, name, agg, micro_rows(b.group, grouping == "split", s), norm)
            except ValueError as e:  # DFPO with a split group: the documented refusal
                if not (dfpo and grouping == "split"):
                    raise
                rhos, note = [], str(e)
                break
            rhos.append(m["gradlab/rho_prefix"])
            splits.append(m["gradlab/split_groups_micro"])
            devs += [m["W_dev_closed_form"]] if "W_dev_closed_form" in m else []
        row[f"rho_{key}"] = sum(rhos) / len(rhos) if rhos else float("nan")
        if grouping == "split":
            row[f"split_{key}"] = sum(splits) / len(splits) if splits else float("nan")
        if devs and pol == "off" and grouping == "whole":
            row["W_dev_closed_form"] = max(devs)
        if not rhos:
            row[f"error_{key}"] = note.split(";")[0]
    return row


def run_audit(quick: bool = False, seeds: int = 4, log=print,
              options: bool = False) -> pd.DataFrame:
    """Long table: one row per (workload, loss_mode, loss_agg_mode); with options, the option
    rows of `verl_options` too (column "option" set)."""
    import pandas as pd

    from ..verl import losses as gv

    modes = list(QUICK_MODES) if quick else gv.base_losses()
    dfpo = ["gradlab_dfpo:vanilla", "gradlab_dfpo:gspo"]
    rows, every = [], {}
    for wl in (("synthetic",) if quick else tuple(WORKLOADS)):
        t0 = time.perf_counter()
        batches = every[wl] = {pol: WORKLOADS[wl](seeds, pol == "off") for pol in ("on", "off")}
        for mode in modes + dfpo:
            for agg in gv.AGG_MODES:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # verl's .item() on grad tensors
                    rows.append({"workload": wl, **audit_row(batches, mode, agg)})
        log(f"  {wl}: {len(modes) + len(dfpo)} modes × {len(gv.AGG_MODES)} aggregations in "
            f"{time.perf_counter() - t0:.1f} s")
    if options:
        from .verl_options import run_options

        rows += run_options(every, quick, log)
    return pd.DataFrame(rows)


def _num(x) -> str:
    import pandas as pd

    if x is None or pd.isna(x):
        return "—"
    return "≈0" if abs(x) < 1e-6 else f"{x:.3f}"


def to_markdown(df: pd.DataFrame, command: str, findings: str = "") -> str:
    """One markdown table per workload."""
    import pandas as pd

    from .verl_options import OPTIONS_NOTE, options_markdown

    opts = df[df["option"].notna()] if "option" in df else df.iloc[:0]
    df = df[df["option"].isna()] if "option" in df else df
    out = [f"<!-- made by: {command} -->", ""]
    head = ("| loss_mode | loss_agg_mode | ρ on, whole | ρ off, whole | ρ on, split "
            "| ρ on, split, local norm. | ρ off, split, local norm. | split groups "
            "| W vs gradlab closed form |")
    for wl, d in df.groupby("workload", sort=False):
        out += [f"**Workload `{wl}`**", "", head, "|---|---|---|---|---|---|---|---|---|"]
        for _, r in d.iterrows():
            split_cols = [_num(r.get(f"rho_{k}")) if pd.notna(r.get(f"rho_{k}")) else
                          "refused (split group)" for k in ("on_split", "on_split_local",
                                                            "off_split_local")]
            out.append(f"| {r.loss_mode} | {r.loss_agg_mode} | {_num(r.rho_on_whole)} | "
                       f"{_num(r.rho_off_whole)} | {' | '.join(split_cols)} | "
                       f"{_num(r.get('split_on_split'))} | {_num(r.get('W_dev_closed_form'))} |")
        out.append("")
        if len(opts[opts.workload == wl]):
            out += options_markdown(opts[opts.workload == wl])
    out.append(
        "ρ = Σ|d| / Σ(|W| + |c*|) at full-group nodes of one mini-batch (one optimizer step: W "
        f"summed over its micro-batches), mean over batches; {N_GROUPS} groups × G = {G} rows; "
        f"whole = two whole groups per micro-batch, split = rows shuffled, {MICRO} per "
        "micro-batch. 'local norm.' = micro-batch-local normalisers (empty "
        "config.global_batch_info, the legacy dp_actor path of verl issue #5625); otherwise "
        "verl's engine normalisers from the whole mini-batch. 'W vs closed form' = max |W − "
        "W_gradlab| / max |W| off-policy, where gradlab has the loss in closed form (vanilla ↔ "
        "grpo token/seq/const norm, gspo ↔ gspo; DFPO rows: the base loss's W). verl defaults: "
        "clip 0.2, dual clip 3; dro_beta 0.1. clip_cov / kl_cov pick tokens with torch's global "
        "RNG, seeded per batch.")
    if len(opts):
        out += ["", OPTIONS_NOTE]
    if findings:
        out += ["", findings]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ...cli.args import Parser  # one-line errors, as every gradlab command

    p = Parser(prog="gradlab audit verl", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="vanilla and gspo, synthetic only (CI)")
    p.add_argument("--out", default="figures", help="folder for verl_audit.csv / .md")
    p.add_argument("--options", action="store_true", help="add verl's rollout correction rows "
                   "(IS weights, rejection sampling; emulated rollout engine)")
    p.add_argument("--seeds", type=int, default=4, help="batches per situation")
    p.add_argument("--findings", default=None, help="markdown file appended under the table")
    a = p.parse_args(argv)
    try:
        from .. import verl  # noqa: F401
    except ImportError as e:
        print(f"gradlab audit verl: {e.name} is not importable: pip install 'gradlab[verl]' "
              "(or the --no-deps overlay of .ci/run on PYTHONPATH)")
        return 2
    t0 = time.perf_counter()
    df = run_audit(a.quick, a.seeds, options=a.options)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "gradlab audit verl" + (" --quick" if a.quick else "") + (
        " --options" if a.options else "") + (
        f" --seeds {a.seeds}" if a.seeds != 4 else "") + f" --out {shlex.quote(a.out)}" + (
        f" --findings {shlex.quote(a.findings)}" if a.findings else "")
    findings = Path(a.findings).read_text() if a.findings else ""
    df.to_csv(out / "verl_audit.csv", index=False)
    md = to_markdown(df, cmd, findings)
    (out / "verl_audit.md").write_text(md)
    print(md)
    from ...provenance import write_in_process

    secs = time.perf_counter() - t0
    write_in_process(out / "verl_audit.json", cmd, secs)
    print(f"wrote {out / 'verl_audit.csv'}, {out / 'verl_audit.md'} and verl_audit.json in "
          f"{secs:.0f} s")
    return 0
