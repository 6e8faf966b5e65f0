"""Option rows of `gradlab audit verl --options`: verl's rollout correction, which reweights
(`rollout_is`) or drops (`rollout_rs`) tokens by the mismatch between the training policy and the
rollout engine.

verl computes both in `verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_
rejection_mask` from the training policy's log-probs at rollout time (old_log_prob) and the
engine's (rollout_log_probs); the trainer then hands the IS weights to the policy loss
(`rollout_is_weights`) and replaces the batch's response_mask by the rejection mask, so the
engine's token totals count only the kept tokens. No rollout engine runs here: its log-probs are
emulated as old_log_prob plus seeded Gaussian noise (σ = NOISE_SIGMA nats), one draw per
(group, response prefix) — rows that share a prefix get the same engine error there, a
batch-invariant engine — or, on the 'per-row' rows, one draw per row and position. verl's own
helper and verl's own `vanilla` loss (token-mean, engine normalisers) then run unchanged; W is
−∂loss/∂log_prob by autograd, and ρ is taken at full-group nodes of the *sampled* tokens (a
rejected row stays in its group's nodes with W = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from ...core.batch import TokenBatch

BASE = ("vanilla", "token-mean")
NOISE_SIGMA = 0.5  # nats: the emulated engine's log-prob error per token
ON_TOL, OFF_TOL = 1e-6, 1e-3  # "breaks": ρ above round-off on-policy / above the base off-policy
SITUATIONS = (("on", "whole"), ("off", "whole"), ("on", "split"))


@dataclass(frozen=True)
class Option:
    """verl's rollout_corr settings (None: off) and the emulated engine's noise kind."""

    name: str
    rollout_is: str | None = None
    is_threshold: float | str = 2.0
    batch_normalize: bool = False
    rollout_rs: str | None = None
    rs_threshold: float | str | None = None
    noise: str = "context"


OPTIONS = (
    Option("none (base)"),
    Option("rollout_is=token, threshold 2 (TIS)", "token"),
    Option("rollout_is=sequence, threshold 2", "sequence"),
    Option("rollout_is=token, threshold 0.5_2 (IcePop)", "token", "0.5_2.0"),
    Option("rollout_is=token, threshold 2, batch-normalized", "token", batch_normalize=True),
    Option("rollout_rs=token_k1, 0.5_2", rollout_rs="token_k1", rs_threshold="0.5_2.0"),
    Option("rollout_rs=seq_mean_k3, 0.2", rollout_rs="seq_mean_k3", rs_threshold=0.2),
    Option("rollout_is=token, threshold 2, per-row engine error", "token", noise="row"),
)
QUICK = ("none (base)", "rollout_is=token, threshold 2 (TIS)", "rollout_is=sequence, threshold 2")


def engine_logps(b: TokenBatch, noise: str, seed: int, sigma: float = NOISE_SIGMA) -> torch.Tensor:
    """(B, T) emulated rollout-engine log-probs: old_logps + seeded N(0, σ²) per token, one draw
    per (group, response prefix) ("context") or per (row, position) ("row"); 0 on padding."""
    import torch

    if noise not in ("context", "row"):
        raise ValueError(f"engine_logps: noise={noise!r}; valid: context, row")
    gen = torch.Generator().manual_seed(10_000 + seed)
    if noise == "row":
        err = torch.randn(b.old_logps.shape, generator=gen, dtype=torch.float64)
    else:
        drawn: dict[tuple, float] = {}
        err = torch.zeros(b.old_logps.shape, dtype=torch.float64)
        for i in range(b.B):
            toks = b.tokens[i].tolist()
            for t in range(int(b.mask[i].sum())):
                key = (int(b.group[i]), tuple(toks[:t + 1]))
                if key not in drawn:
                    drawn[key] = float(torch.randn((), generator=gen, dtype=torch.float64))
                err[i, t] = drawn[key]
    return (b.old_logps + sigma * err.to(b.old_logps)) * b.mask


def correction(b: TokenBatch, opt: Option, seed: int,
               helper=None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(IS weights (B, T) or None, kept-token mask (B, T) float) from verl's helper."""
    if helper is None:
        from verl.trainer.ppo.rollout_corr_helper import (
            compute_rollout_correction_and_rejection_mask as helper,
        )

    w, keep, _ = helper(old_log_prob=b.old_logps, rollout_log_prob=engine_logps(b, opt.noise, seed),
                        response_mask=b.mask.to(b.old_logps.dtype), rollout_is=opt.rollout_is,
                        rollout_is_threshold=opt.is_threshold,
                        rollout_is_batch_normalize=opt.batch_normalize,
                        rollout_rs=opt.rollout_rs, rollout_rs_threshold=opt.rs_threshold)
    return (None if w is None else w.batch["rollout_is_weights"]), keep


def documented_weights(b: TokenBatch, opt: Option, seed: int) -> torch.Tensor:
    """verl's rollout_is weights as its documentation states them, written here independently:
    r = exp(old − rollout) per token, or the product over the sequence; a single threshold U
    truncates (min(r, U)), "L_U" zeroes r outside [L, U]; batch_normalize divides by the masked
    mean (token level); 0 on padding."""
    import torch

    m = b.mask.to(b.old_logps.dtype)
    d = (b.old_logps - engine_logps(b, opt.noise, seed)) * m
    r = torch.exp(d.sum(-1, keepdim=True) if opt.rollout_is == "sequence" else d).expand_as(d) * m
    spec = str(opt.is_threshold)
    if "_" in spec:
        lo, hi = (float(x) for x in spec.split("_"))
        r = torch.where((r >= lo) & (r <= hi), r, torch.zeros_like(r))
    else:
        r = r.clamp(max=float(spec))
    if opt.batch_normalize:
        r = r / ((r * m).sum() / m.sum())
    return r


def run_option(b: TokenBatch, opt: Option, policy_split: bool, seed: int,
               helper=None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vanilla loss (token-mean, engine normalisers over the kept tokens) on one
    mini-batch with the option's correction; returns (W (B, T), kept mask (B, T))."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from .verl_setup import actor_config, micro_rows

    weights, keep = correction(b, opt, seed, helper)
    cfg = actor_config(BASE[0])
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(keep.sum()),
                                 global_batch_size=b.B, loss_scale_factor=None)
    fn = get_policy_loss_fn(BASE[0])
    lp = b.logps.detach().clone().requires_grad_(True)
    for rows in micro_rows(b.group, policy_split, seed):
        adv = b.advantages[rows].unsqueeze(-1).expand(len(rows), b.T)
        loss, _ = fn(old_log_prob=b.old_logps[rows], log_prob=lp[rows], advantages=adv,
                     response_mask=keep[rows], loss_agg_mode=BASE[1], config=cfg,
                     rollout_is_weights=None if weights is None else weights[rows])
        loss.backward()
    return -lp.grad * b.mask, keep


def check_on_policy(b: TokenBatch, W: torch.Tensor, keep: torch.Tensor, opt: Option, seed: int,
                    rel_tol: float = 1e-6) -> float:
    """On-policy token-mean vanilla: W = A · r_IS · keep / N_kept (ratio 1, no clip), r_IS from
    `documented_weights`. Returns max |W − expected| / max |W|; AssertionError above rel_tol."""
    import torch

    r = documented_weights(b, opt, seed) if opt.rollout_is else torch.ones_like(W)
    exp = b.advantages[:, None] * r * keep / keep.sum()
    dev = float((W - exp).abs().max() / W.abs().max().clamp(min=1e-300))
    if dev > rel_tol:
        raise AssertionError(f"gradlab audit verl: W under {opt.name!r} deviates from "
                             f"A·r_IS·keep/N by {dev:.2e} (relative; tolerance {rel_tol:g}): verl "
                             "applied another correction than its documented one")
    return dev


def option_row(batches: dict, opt: Option, helper=None) -> dict:
    """Mean mini-batch ρ (full-group, trie) per situation, split share, dropped tokens."""
    from ...core.batch import split_share
    from ...core.cancellation import cancellation
    from ...core.nodes import shared_nodes
    from .verl_setup import micro_rows

    row = {"option": opt.name, "loss_mode": BASE[0], "loss_agg_mode": BASE[1]}
    for pol, grouping in SITUATIONS:
        rho, trie, split, drop, live, dev = [], [], [], 0, 0, 0.0
        for s, b in enumerate(batches[pol]):
            W, keep = run_option(b, opt, grouping == "split", s, helper)
            nodes = shared_nodes(b, "trie")
            rho.append(cancellation(W, b, sn=nodes.full_group()).ratio)  # NaN where undefined
            trie.append(cancellation(W, b, sn=nodes).ratio)
            rows = micro_rows(b.group, grouping == "split", s)
            micro = b.group.new_zeros(b.B)
            for k, r in enumerate(rows):
                micro[r] = k
            split.append(split_share(b.group, micro))
            nz = b.mask & (b.advantages != 0)[:, None]
            drop, live = drop + int((nz & (W == 0)).sum()), live + int(nz.sum())
            if pol == "on" and grouping == "whole":
                dev = max(dev, check_on_policy(b, W, keep, opt, s))
        key = f"{pol}_{grouping}"
        row[f"rho_{key}"] = _mean(rho)
        row[f"rho_trie_{key}"] = _mean(trie)
        row[f"split_{key}"] = _mean(split)
        row[f"dropped_{key}"] = drop / live if live else math.nan
    row["check_dev"] = dev
    return row


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def run_options(batches_of: dict, quick: bool, log=print) -> list[dict]:
    """Option rows for every workload: `batches_of` maps a workload to its {"on", "off"} batches."""
    import time
    import warnings

    rows = []
    for wl, batches in batches_of.items():
        t0 = time.perf_counter()
        for o in OPTIONS:
            if quick and o.name not in QUICK:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # verl's .item() on grad tensors
                rows.append({"workload": wl, **option_row(batches, o)})
        log(f"  {wl}: {len(rows)} option rows so far ({time.perf_counter() - t0:.1f} s)")
    return rows


# ----------------------------------------------------------------------------- the table


def _num(x: float | None) -> str:
    import pandas as pd

    if x is None or pd.isna(x):
        return "—"
    return "≈0" if abs(x) < ON_TOL else f"{x:.3f}"


def verdict(r: pd.Series, base: pd.Series) -> str:
    """Breaks cancellation at full-group nodes: on-policy ρ (whole groups) above round-off,
    else off-policy ρ above the base's by more than OFF_TOL, else no."""
    if r.rho_on_whole > ON_TOL:
        return f"yes: ρ {_num(r.rho_on_whole)} on-policy"
    if r.rho_off_whole - base.rho_off_whole > OFF_TOL:
        return f"off-policy: ρ {_num(r.rho_off_whole)} (base {_num(base.rho_off_whole)})"
    return "no"


def options_markdown(d: pd.DataFrame) -> list[str]:
    """Markdown lines of one workload's option table."""
    d = d.set_index("option")
    base = d.loc[OPTIONS[0].name]
    out = [f"Rollout correction on `{BASE[0]}`, `{BASE[1]}` (`gradlab audit verl --options`):",
           "", "| option | ρ on, whole | ρ off, whole | ρ on, split | ρ trie, on, whole "
           "| split groups | tokens with W = 0 (A ≠ 0), on | W vs documented rule, on "
           "| breaks cancellation? |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in d.iterrows():
        out.append(f"| {name} | {_num(r.rho_on_whole)} | {_num(r.rho_off_whole)} | "
                   f"{_num(r.rho_on_split)} | {_num(r.rho_trie_on_whole)} | "
                   f"{_num(r.split_on_split)} | {_num(r.dropped_on_whole)} | "
                   f"{_num(r.check_dev)} | {verdict(r, base)} |")
    return out + [""]


OPTIONS_NOTE = (
    f"Rollout correction rows: verl's `{BASE[0]}` loss, `{BASE[1]}`, engine normalisers over the "
    "kept tokens; IS weights and rejection mask from verl's own "
    "`compute_rollout_correction_and_rejection_mask`. No rollout engine runs here: its log-probs "
    f"are emulated as old_log_prob plus seeded Gaussian noise of σ = {NOISE_SIGMA:g} nats, one "
    "draw per (group, response prefix) — rows sharing a prefix see the same engine error there "
    "— or, on the 'per-row' row, one draw per row and token. ρ at full-group nodes of the "
    "sampled tokens (a rejected token keeps its place with W = 0). 'W vs documented rule' = "
    "max |W − A·r_IS·keep/N| / max |W| on-policy, r_IS recomputed from verl's documented "
    f"rule. 'breaks cancellation': on-policy ρ above {ON_TOL:g}, else off-policy ρ above the "
    f"base row's by more than {OFF_TOL:g}.")
