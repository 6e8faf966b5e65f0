"""Option rows of `gradlab audit trl --options`: TRL settings that change which tokens carry
weight after the advantages, or how groups are cut into optimizer steps.

Each option runs on one base loss (dapo, token level: it cancels on-policy, so what an option
adds shows alone) in real `GRPOTrainer` steps on the tiny policy, on- and off-policy as the loss
rows of `trl_audit`, with W measured by the hook on TRL's own loss:

    mask_truncated_completions   completions that hit max_completion_length carry no loss
    off_policy_mask_threshold    DeepSeek-V3.2's sequence mask: negative-advantage sequences
                                 whose mean KL(old ‖ current) exceeds δ are dropped
    top_entropy_quantile         only the top-q entropy tokens of each loss call carry loss
    scale_rewards                group / batch / none: the advantage's scale
    vLLM importance sampling     vllm_importance_sampling_correction with each
                                 vllm_importance_sampling_mode (TRL's own code path, emulated
                                 sampler: `OptionAuditTrainer`)
    steps_per_generation         the number of optimizer steps a generation batch is cut into

vLLM cannot run here. `OptionAuditTrainer` emulates it: generation runs on the transformers path,
and the sampler's per-token log-probs handed to TRL are the policy's own log-probs at generation
plus seeded Gaussian noise (σ = NOISE_SIGMA nats). Noise "context": one draw per (prompt,
completion prefix, token), so rows sharing a prefix get the same sampler error there (a
batch-invariant sampler); "row": an independent draw per row and position (a batch-variant
sampler). TRL's own correction code (`_generate_and_score_completions` and `_compute_loss`) then
runs unchanged, with `use_vllm` switched on everywhere except inside `_generate`.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..trl.trainer import GradlabConfig, GradlabGRPOTrainer
from .trl_setup import OFF_SPG, Workload, grpo_args, make_trainer, pool_windows, quiet

if TYPE_CHECKING:
    import pandas as pd

BASE = ("dapo", "token")  # loss_type, importance_sampling_level of every option row
NOISE_SIGMA = 0.5  # nats: the emulated sampler's log-prob error per token
OPM_DELTA = 1e-3  # off_policy_mask_threshold δ (mean per-token KL of a sequence, nats)
ON_TOL, OFF_TOL = 1e-5, 1e-3  # "breaks": ρ above round-off on-policy / above the base off-policy


@dataclass(frozen=True)
class Option:
    """One audited setting: GRPOConfig overrides, emulated sampler noise, off-policy spg."""

    name: str
    extra: dict = field(default_factory=dict)
    noise: str | None = None  # None: no vLLM emulation; "context" | "row"
    off_spg: int = OFF_SPG


def _is(mode: str, noise: str = "context") -> Option:
    label = f"vLLM IS {mode}" + (", per-row sampler error" if noise == "row" else "")
    return Option(label, {"vllm_importance_sampling_correction": True,
                          "vllm_importance_sampling_mode": mode}, noise)


OPTIONS = (
    Option("none (base)"),
    Option("mask_truncated_completions", {"mask_truncated_completions": True}),
    Option(f"off_policy_mask_threshold={OPM_DELTA:g}", {"off_policy_mask_threshold": OPM_DELTA}),
    Option("top_entropy_quantile=0.2", {"top_entropy_quantile": 0.2}),
    Option("scale_rewards=batch", {"scale_rewards": "batch"}),
    Option("scale_rewards=none", {"scale_rewards": "none"}),
    _is("token_truncate"), _is("token_mask"), _is("sequence_truncate"), _is("sequence_mask"),
    _is("token_truncate", "row"),
    Option("steps_per_generation=2", off_spg=2),
    Option("steps_per_generation=8", off_spg=8),
)
QUICK = ("none (base)", "mask_truncated_completions", "vLLM IS token_truncate",
         "vLLM IS sequence_mask", "steps_per_generation=8")


# ----------------------------------------------------------------------------- emulated vLLM


class OptionAuditTrainer(GradlabGRPOTrainer):
    """GradlabGRPOTrainer for the option rows (its batch mask is every sampled token, so a
    completion that `mask_truncated_completions` drops stays in its group's nodes with W = 0)
    with, after `emulate(noise)`, an emulated vLLM sampler (module doc)."""

    noise: str | None = None
    sampling: list  # (B, T) emulated sampler log-probs of each training generation batch

    def emulate(self, noise: str, sigma: float = NOISE_SIGMA, seed: int = 0) -> None:
        """Switch the emulated sampler on (noise "context" | "row", σ in nats)."""
        if noise not in ("context", "row"):
            raise ValueError(f"OptionAuditTrainer.emulate: noise={noise!r}; valid: context, row")
        self.noise, self.sigma, self.sampling = noise, sigma, []
        self._gen = torch.Generator().manual_seed(seed)
        self._drawn: dict[tuple, float] = {}
        self.use_vllm = True  # TRL's correction branches; `_generate` switches it off

    def _generate(self, prompts):
        self.use_vllm = False
        try:
            out = list(super()._generate(prompts))
        finally:
            self.use_vllm = self.noise is not None
        if self.noise is not None:
            out[4] = self._sampler_logps(out[0], out[1])
        return tuple(out)

    @torch.no_grad()
    def _sampler_logps(self, prompt_ids: list, completion_ids: list) -> list[list[float]]:
        """Per row: the policy's log-probs of its completion (TRL's own per-token function, one
        row at a time, no padding) plus the seeded sampler error."""
        rows = []
        for p, c in zip(prompt_ids, completion_ids):
            ids = torch.tensor([list(p) + list(c)], device=self.accelerator.device)
            lp = self._get_per_token_logps_and_entropies(self.model, ids, torch.ones_like(ids),
                                                         len(c))[0][0].double().cpu()
            rows.append([float(v) + self._error(tuple(p), tuple(c[:t + 1]))
                         for t, v in enumerate(lp.tolist())])
        return rows

    def _error(self, prompt: tuple, prefix: tuple) -> float:
        draw = lambda: float(torch.randn((), generator=self._gen, dtype=torch.float64)) * self.sigma
        if self.noise == "row":
            return draw()
        key = (prompt, prefix)
        if key not in self._drawn:
            self._drawn[key] = draw()
        return self._drawn[key]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training and self._gl_gen is not None and self.noise is not None:
            self.sampling.append(out["sampling_per_token_logps"].detach().double().cpu())
        return out


# ----------------------------------------------------------------------------- checks


def is_weights(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
               lo: float | None, hi: float | None) -> torch.Tensor:
    """(B, T) importance weights TRL documents for `vllm_importance_sampling_mode`, written here
    from its documentation: r = π_train/π_sampler per token (token_*) or the product over the
    sequence (sequence_*); *_truncate clips r to [lo, hi], *_mask zeroes r outside it."""
    d = (old - sampling) * mask
    r = torch.exp(d.sum(-1, keepdim=True) if mode.startswith("sequence") else d).expand_as(d)
    lo_, hi_ = (-math.inf if lo is None else lo), (math.inf if hi is None else hi)
    if mode.endswith("truncate"):
        return r.clamp(min=lo_, max=hi_)
    return torch.where((r < lo_) | (r > hi_), torch.zeros_like(r), r)


def check_is_correction(tr: OptionAuditTrainer, rel_tol: float = 1e-4) -> float:
    """On-policy dapo: W must equal A · r_IS · exp(logp − old) / N on every loss token (N: the
    generation batch's loss tokens), r_IS from `is_weights` on the emulated sampler log-probs.
    Returns max |W − expected| / max |W|; raises AssertionError above rel_tol."""
    a = tr.args
    worst = 0.0
    for w, s in zip(tr.gradlab_windows, tr.sampling):
        b = w.batch
        m = b.mask.double()
        r = is_weights(b.old_logps.double(), s.to(m.dtype), m, a.vllm_importance_sampling_mode,
                       a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max)
        exp = b.advantages.double()[:, None] * r * torch.exp(b.logps.double() - b.old_logps) * m
        exp = exp / m.sum()
        W = w.W.double() * m
        worst = max(worst, float((W - exp).abs().max() / W.abs().max().clamp(min=1e-30)))
    if worst > rel_tol:
        raise AssertionError(
            f"gradlab audit trl: W under vllm_importance_sampling_mode="
            f"{a.vllm_importance_sampling_mode!r} deviates from A·r_IS/N by {worst:.2e} (relative; "
            f"tolerance {rel_tol:g}): TRL applied another correction than its documented one")
    return worst


def dropped_share(windows: list) -> float:
    """Share of sampled tokens with A ≠ 0 whose W is exactly 0 (masked, clipped or truncated);
    NaN when no token has A ≠ 0."""
    num = den = 0
    for w in windows:
        live = w.batch.mask & (w.batch.advantages != 0)[:, None]
        num += int((live & (w.W == 0)).sum())
        den += int(live.sum())
    return num / den if den else math.nan


# ----------------------------------------------------------------------------- measuring


def audit_option(opt: Option, off: bool, workload: Workload, gens: int, seed: int = 0) -> dict:
    """Run one option on the base loss for `gens` generation batches; pooled figures."""
    spg = opt.off_spg if off else 1
    with tempfile.TemporaryDirectory() as tmp, quiet():
        args = grpo_args(*BASE, spg, gens * spg, tmp, seed=seed, **opt.extra)
        tr = make_trainer(args, workload, GradlabConfig(store=None, keep_windows=True, instruments="off"),
                          cls=OptionAuditTrainer)
        if opt.noise is not None:
            tr.emulate(opt.noise, seed=seed)
        tr.train()
    row = {"workload": workload.name, "loss_type": BASE[0], "level": BASE[1], "dfpo": "",
           "option": opt.name, "policy": "off" if off else "on", "spg": spg}
    row.update(pool_windows(tr.gradlab_windows))
    row["dropped"] = dropped_share(tr.gradlab_windows)
    if opt.noise is not None and not off:
        row["is_check"] = check_is_correction(tr)
    return row


def run_options(quick: bool, workloads: tuple[str, ...], seed: int = 0, log=print) -> list[dict]:
    """Rows (on- and off-policy) of every option (QUICK subset with quick) per workload."""
    import time

    from .trl_setup import WORKLOADS

    gens_on, gens_off = (2, 1) if quick else (6, 3)
    opts = [o for o in OPTIONS if not quick or o.name in QUICK]
    rows = []
    for wl in workloads:
        for o in opts:
            for off in (False, True):
                t0 = time.perf_counter()
                rows.append(audit_option(o, off, WORKLOADS[wl], gens_off if off else gens_on, seed))
                r = rows[-1]
                log(f"  {wl:10s} {o.name:40s} {r['policy']:3s} ρ={r['rho']:.3g} "
                    f"ρ_step={r['rho_step']:.3f} dropped={r['dropped']:.3f} "
                    f"({time.perf_counter() - t0:.1f} s)")
    return rows


# ----------------------------------------------------------------------------- the table


def _num(x: float | None) -> str:
    import pandas as pd

    if x is None or pd.isna(x):
        return "—"
    return "≈0" if abs(x) < ON_TOL else f"{x:.3f}"


def verdict(on: pd.Series, off: pd.Series, base_off: pd.Series) -> str:
    """Whether an option breaks cancellation at full-group nodes, and by how much: on-policy ρ
    above round-off (ON_TOL), else off-policy ρ above the base's by more than OFF_TOL, else (an
    option that only changes the split) the per-step ρ."""
    if math.isnan(on.rho):
        return "— (no gradient left at full-group nodes on-policy: ρ undefined)"
    if on.rho > ON_TOL:
        return f"yes: ρ {_num(on.rho)} on-policy"
    if math.isnan(off.rho):
        return "— (no gradient left at full-group nodes off-policy: ρ undefined)"
    if off.rho - base_off.rho > OFF_TOL:
        return f"off-policy: ρ {_num(off.rho)} (base {_num(base_off.rho)})"
    if off.spg != base_off.spg:
        return f"by the split only: ρ per step {_num(off.rho_step)} (base {_num(base_off.rho_step)})"
    return "no"


def options_markdown(d: pd.DataFrame) -> list[str]:
    """Markdown lines of one workload's option table (rows of `run_options`)."""
    on, off = d[d.policy == "on"].set_index("option"), d[d.policy == "off"].set_index("option")
    base = off.loc[OPTIONS[0].name]
    out = [f"Options on `{BASE[0]}`, {BASE[1]} level (`gradlab audit trl --options`):", "",
           "| option | ρ full-group, on-policy | ρ trie, on-policy | ρ full-group, off-policy "
           "| ρ per optimizer step, off | steps per generation, off | split groups, off "
           "| tokens with W = 0 (A ≠ 0), on / off | breaks cancellation? |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name in on.index:
        a, b = on.loc[name], off.loc[name]
        out.append(f"| {name} | {_num(a.rho)} | {_num(a.rho_trie)} | {_num(b.rho)} | "
                   f"{_num(b.rho_step)} | {int(b.spg)} | {_num(b.split)} | "
                   f"{_num(a.dropped)} / {_num(b.dropped)} | {verdict(a, b, base)} |")
    return out + [""]


OPTIONS_NOTE = (
    f"Options: each on TRL's `{BASE[0]}` loss at {BASE[1]} level, everything else as the loss "
    "rows. 'tokens with W = 0' is the share of sampled tokens of non-zero advantage that carry "
    "no gradient (masked, truncated, clipped). 'breaks cancellation': on-policy ρ above "
    f"{ON_TOL:g} (float round-off), else off-policy ρ above the base row's by more than "
    f"{OFF_TOL:g} (the base's own off-policy residual comes from parameter drift between the "
    "optimizer steps), else, for a different steps_per_generation, the per-step ρ. "
    "mask_truncated_completions: the nodes keep the truncated completions (their sampled "
    "tokens, W = 0). vLLM IS rows: vLLM does not run here, so the sampler is emulated: its "
    "log-probs are the policy's own at generation plus seeded Gaussian noise of σ = "
    f"{NOISE_SIGMA:g} nats, one draw per (prompt, completion prefix) — rows that share a prefix "
    "see the same sampler error there — or, on the 'per-row' row, one draw per row and token; "
    "TRL's own correction code then runs (vllm_importance_sampling_clip_max 3, clip_min none: "
    "TRL's defaults), and on-policy W is checked against A·r_IS/N recomputed from TRL's "
    f"documented rule. off_policy_mask_threshold δ = {OPM_DELTA:g} nats (mean per-token KL of a "
    "sequence; the tiny policy drifts little in four steps, so TRL's example δ = 0.5 would drop "
    "nothing here).")
