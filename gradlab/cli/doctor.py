"""`gradlab doctor`: does gradlab work on this machine? One command, a short Markdown report.

    gradlab doctor                      # the best device here (CUDA if present, else CPU)
    gradlab doctor --device cpu --out report.md   # the report also written to a file

Checks, each on the tiny shipped policy (a 2-layer Qwen3) and one off-policy rollout batch:
- device: what torch sees (CUDA name and memory, or CPU threads);
- bf16 autocast: a bf16 matmul under `torch.autocast` runs on the device;
- W exact: the W a backward hook measures equals each objective's closed form (docs/concepts/modulation.md#closed-forms) to
  float32 rounding (`precision.W_EXACT_RTOL`);
- amp: under bf16 autocast the same identity holds, and log-probs, W and the policy gradient
  sit within the documented bf16 bounds of float32 (`precision.AMP_*`);
- CPU = device (CUDA only): the float32 readings on the device equal the CPU's;
- loop: a one-step tandem (`--amp` where bf16 works) trains end to end with finite metrics.
Timings (s) and peak memory (CUDA: `torch.cuda.max_memory_allocated`; CPU: the process's peak
RSS) go in the report. Exit code 0 when every check passes, 1 otherwise (the failing checks
are named on stderr, one line each).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core import objectives
from ..core.batch import advantages
from ..loop.numerics.logprobs import token_logps
from ..loop.numerics.precision import (
    AMP_GRAD_COS,
    AMP_LOGP_ATOL,
    AMP_LOGP_MEAN,
    AMP_W_L1,
    W_EXACT_RTOL,
    amp_failures,
    amp_gap,
    autocast,
    bf16_autocast_ok,
)
from ..probes import ModulationProbe

OBJECTIVES = ("grpo", "gspo", "dfpo-min")  # token ratio, sequence ratio, a within-group transform
CPU_DEVICE_RTOL = 1e-4  # float32 CPU against float32 CUDA: kernel rounding (W L1, gradient)


@dataclass
class Reading:
    """One forward/backward of a loss on a batch. logps, W, closed: (B, T) float32 (nats; W and
    closed = −∂L/∂l measured by the hook and from the closed form); grad: (P,) float32 flat
    policy-loss gradient; seconds: wall time of the forward/backward."""

    logps: torch.Tensor
    W: torch.Tensor
    closed: torch.Tensor
    grad: torch.Tensor
    seconds: float

    @property
    def closed_gap(self) -> float:
        """max |W_hook − W_closed| / max |W|: 0 where the two agree exactly (an all-zero W
        included), inf where W ≡ 0 but the closed form is not."""
        scale, gap = float(self.W.abs().max()), float((self.W - self.closed).abs().max())
        return gap / scale if scale > 0 else 0.0 if gap == 0 else math.inf


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


@dataclass
class Case:
    """A tiny policy and one of its rollout batches, made off-policy: the policy's weights are
    moved after sampling, so ratios differ from 1 and clipping is exercised."""

    model: torch.nn.Module
    ro: object  # gradlab.loop.rollouts.rollout.Rollout, on the model's device
    adv: torch.Tensor  # (N,) group-relative advantages


def tiny_case(device: str = "cpu", prompts: int = 4, G: int = 4, seed: int = 0,
              shift: float = 0.02) -> Case:
    """The shipped tiny policy on `device`, `prompts` × G responses sampled on the CPU with
    hashed noise (the same tokens on every device), then every weight moved by `shift` × a
    seeded normal draw (the same on every device)."""
    from ..loop.rollouts.rollout import generate
    from ..loop.setup.policy import load_policy
    from ..loop.setup.task import ArithmeticTask

    task = ArithmeticTask()
    model, tok = load_policy(None, task=task)
    keys = torch.arange(prompts * G) + 1_000_003 * seed
    ro = generate(model, tok, task.problems(prompts, seed=seed + 1), G, task.max_new_tokens, 1.0,
                  task=task, row_keys=keys)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift * torch.randn(p.shape, generator=g))
    return Case(model.to(device), ro.to(device), advantages(ro.rewards, ro.group).to(device))


def read_step(model: torch.nn.Module, ro, adv: torch.Tensor, objective, *, amp: bool,
              rows: torch.Tensor | None = None, norms: tuple[int, int, int] | None = None,
              grad_scale: float = 1.0) -> Reading:
    """Forward (under bf16 autocast when `amp`), the objective's loss, backward, on rollout rows
    `rows` (default all). norms: the loss normalisers' totals (sequences, tokens, width) when
    `rows` is part of a larger batch. The gradient is read from `.grad` (full tensors of a
    sharded model), times grad_scale, then cleared."""
    rows = torch.arange(ro.response_ids.shape[0], device=adv.device) if rows is None else rows
    t0 = time.perf_counter()
    with autocast(adv.device, amp):
        s = ro.rows(rows)
        lp = token_logps(model, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                         ro.temperature)
    batch = ro.token_batch(lp, adv, rows, norms=norms, validate=False)
    with ModulationProbe() as probe:
        objective.loss(batch.replace(logps=probe.watch(lp))).backward()
    if adv.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    grads = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        grads.append(g.detach().float().flatten() * grad_scale)
    model.zero_grad(set_to_none=True)
    closed = objective.modulation(batch.replace(logps=lp.detach()))
    return Reading(lp.detach().float(), probe.W.float(), closed.float(), torch.cat(grads),
                   seconds)


def check_exact(case: Case, amp: bool) -> tuple[Check, dict[str, Reading]]:
    """Hook W = closed form for each objective in OBJECTIVES (fp32 or under autocast)."""
    reads = {n: read_step(case.model, case.ro, case.adv, objectives.get(n), amp=amp)
             for n in OBJECTIVES}
    worst = max(r.closed_gap for r in reads.values())
    name = "W exact under bf16 autocast" if amp else "W exact (float32)"
    return Check(name, worst <= W_EXACT_RTOL,
                 f"max |W_hook − W_closed| / max|W| = {worst:.2e} (bound {W_EXACT_RTOL:g}; "
                 f"{', '.join(OBJECTIVES)})", sum(r.seconds for r in reads.values())), reads


def check_amp(ref: dict[str, Reading], amp: dict[str, Reading], mask: torch.Tensor) -> Check:
    """The autocast readings within the AMP_* bounds of the float32 ones."""
    gaps = {n: amp_gap(ref[n].logps, amp[n].logps, ref_W=ref[n].W, W=amp[n].W, ref_grad=ref[n].grad,
                       grad=amp[n].grad, mask=mask) for n in ref}
    bad = [f"{n}: {b}" for n, gap in gaps.items() for b in amp_failures(gap)]
    worst = {k: max(g[k] for g in gaps.values()) for k in ("logp_max", "logp_mean", "w_l1")}
    worst["grad_cos"] = min(g["grad_cos"] for g in gaps.values())
    detail = (f"log-prob gap max {worst['logp_max']:.3f} / mean {worst['logp_mean']:.4f} nats "
              f"(bounds {AMP_LOGP_ATOL}, {AMP_LOGP_MEAN}); W L1 gap {worst['w_l1']:.3f} "
              f"(bound {AMP_W_L1}); gradient cosine {worst['grad_cos']:.4f} (≥ {AMP_GRAD_COS})")
    return Check("bf16 within bounds of float32", not bad, "; ".join(bad) or detail,
                 sum(r.seconds for r in amp.values()))


def check_cpu_equals(device: str, ref: dict[str, Reading]) -> Check:
    """float32 on the CPU against float32 on `device`, same tokens and weights."""
    cpu = tiny_case("cpu")
    worst = 0.0
    for n, r in ref.items():
        c = read_step(cpu.model, cpu.ro, cpu.adv, objectives.get(n), amp=False)
        w = float((r.W.cpu() - c.W).abs().sum() / c.W.abs().sum().clamp(min=1e-30))
        g = float((r.grad.cpu() - c.grad).norm() / c.grad.norm().clamp(min=1e-30))
        worst = max(worst, w, g)
    return Check(f"CPU = {device} (float32)", worst <= CPU_DEVICE_RTOL,
                 f"largest relative W L1 / gradient gap {worst:.2e} (bound {CPU_DEVICE_RTOL:g})")


def check_loop(device: str, amp: bool) -> Check:
    """A one-step tandem (gspo, dfpo-min) in a temporary folder: finite metrics."""
    import gradlab

    from ..loop.config import RunConfig
    from ..loop.train import train

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(objectives=["gspo", "dfpo-min"], out=tmp, steps=1, prompts=4, G=4,
                        minibatches=2, device=device, amp=amp, eval_every=0, tax_every=1,
                        probe_contexts=4, progress=False, ckpt_every=1)
        train(cfg)
        wide = gradlab.load_run(tmp, wide=True)
    keys = ["loss", "grad_norm", "w_max", "rho_prefix", "entropy", "tax_share"]
    bad = [k for k in keys if not all(math.isfinite(float(v)) for v in wide[k])]
    return Check(f"loop (one tandem step{', --amp' if amp else ''})", not bad,
                 f"non-finite: {', '.join(bad)}" if bad else f"finite {', '.join(keys)}",
                 time.perf_counter() - t0)


def peak_memory_mib(device: str) -> float:
    """Peak memory so far (MiB): CUDA allocator peak, or this process's peak RSS on CPU."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def pick_device(name: str) -> str:
    """"auto" → "cuda" when torch sees a GPU, else "cpu"; any other name as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def describe_device(device: str) -> str:
    """One line: torch version and what the device is."""
    if device.startswith("cuda"):
        i = torch.device(device).index or 0
        prop = torch.cuda.get_device_properties(i)
        what = f"{prop.name}, {prop.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}"
    else:
        what = f"CPU, {torch.get_num_threads()} intra-op threads"
    return f"{device}: {what}; torch {torch.__version__}"


def run_checks(device: str, loop: bool = True) -> tuple[list[Check], dict]:
    """Every check on `device`; returns (checks, facts for the report)."""
    facts = {"device": describe_device(device)}
    bf16 = bf16_autocast_ok(device)
    checks = [Check("bf16 autocast", bf16, "a bf16 matmul under torch.autocast runs"
                    if bf16 else "unavailable: --amp cannot be used here")]
    t0 = time.perf_counter()
    case = tiny_case(device)
    facts["setup_s"] = time.perf_counter() - t0
    exact, ref = check_exact(case, False)
    checks.append(exact)
    if bf16:
        exact_amp, amp = check_exact(case, True)
        checks += [exact_amp, check_amp(ref, amp, case.ro.response_mask)]
    if device != "cpu":
        checks.append(check_cpu_equals(device, ref))
    if loop:
        checks.append(check_loop(device, bf16))
    facts["peak_mib"] = peak_memory_mib(device)
    return checks, facts


def report(checks: list[Check], facts: dict) -> str:
    """The Markdown report."""
    ok = all(c.ok for c in checks)
    memory = "peak CUDA memory allocated" if "cuda" in facts["device"].split(":")[0] else \
        "peak RSS of the process"
    lines = ["# gradlab doctor", "", f"**{'PASS' if ok else 'FAIL'}** — {facts['device']}", "",
             "| check | result | detail | time (s) |", "|---|---|---|---|"]
    for c in checks:  # a "|" inside a cell would end it
        detail = c.detail.replace("|", "\\|")
        lines.append(f"| {c.name} | {'ok' if c.ok else 'FAIL'} | {detail} | {c.seconds:.2f} |")
    if "peak_mib" in facts:  # absent when no check could run
        lines += ["", f"Setup (tiny policy and rollout): {facts['setup_s']:.2f} s; {memory}: "
                  f"{facts['peak_mib']:.0f} MiB."]
    lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    # one definition of the options, shared with `gradlab doctor`
    from .args import Parser, _doctor_args

    p = Parser(prog="gradlab doctor", description="Check that gradlab works on this machine "
               "(device, bf16 autocast, W exactness, amp bounds, a training step) and print a "
               "Markdown report (--out FILE also writes it).")
    _doctor_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_doctor(build_parser().parse_args(argv))


def run_doctor(a: argparse.Namespace) -> int:
    """`gradlab doctor` with parsed options: 0 every check passes, 1 one failed, 2 bad options."""
    if not (a.device in ("auto", "cpu", "cuda") or (a.device.startswith("cuda:")
                                                    and a.device[5:].isdigit())):
        print(f"gradlab doctor: error: --device: {a.device!r}; valid: auto, cpu, cuda, cuda:N",
              file=sys.stderr)
        return 2
    if a.out is not None and not Path(a.out).parent.is_dir():
        print(f"gradlab doctor: error: --out: folder {Path(a.out).parent} does not exist",
              file=sys.stderr)
        return 2
    device = pick_device(a.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        checks = [Check("device", False, f"{device}: torch {torch.__version__} sees no CUDA GPU")]
        facts = {"device": f"{device}: not available"}
    elif device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        checks = [Check("device", False, f"{device}: this machine has "
                        f"{torch.cuda.device_count()} CUDA GPU(s)")]
        facts = {"device": f"{device}: not available"}
    else:
        checks, facts = run_checks(device, a.loop)
    text = report(checks, facts)
    if a.out is not None:
        Path(a.out).write_text(text)
    else:
        print(text)
    failed = [c for c in checks if not c.ok]
    for c in failed:
        print(f"gradlab doctor: FAIL — {c.name}: {c.detail}", file=sys.stderr)
    print(f"gradlab doctor: {'FAIL' if failed else 'PASS'} on {facts['device']}"
          + (f"; report: {a.out}" if a.out else ""))
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
