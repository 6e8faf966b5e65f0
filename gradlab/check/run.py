"""`gradlab check`: a regression check of shared-token cancellation, against the invariants of docs/concepts/shared-nodes.md and a baseline.

A fixed set of deterministic scenarios measures W = −∂loss/∂l (autograd on synthetic groups, a
`ModulationProbe` hook on a real tiny-model step) and the cancellation ratio ρ at full-group
("prefix") and trie nodes (docs/concepts/shared-nodes.md):

  synthetic/<variant>/<regime>  `random_batch` groups, seeds 0-2, regimes of `scenarios.REGIMES`:
                                on (on-policy, unequal lengths), near (off_policy 0.3), far
                                (off_policy 1.0: a PPO clip at eps 0.2 fires), on-eq (on-policy,
                                equal lengths), and close (off_policy 3e-3: sequence ratios
                                straddle GSPO's clip bounds 1 − 3e-4 and 1 + 4e-4)
  model/<variant>/on            the shipped tiny Qwen3: 4 prompts × G=8 sampled with a fixed
                                generator, measured before any update (every ratio 1)
  model/<variant>/off           the same rollout's 2nd minibatch (groups 2-3) after one AdamW
                                step on the 1st (groups 0-1) with the training loop's defaults
                                (`RunConfig()`: lr, weight decay, gradient clip, temperature,
                                advantage scale)

Each scenario is held to (1) the invariants of docs/concepts/shared-nodes.md (`EXPECT_PREFIX`, `EXPECT_TRIE`):
exchangeable objectives cancel (ρ ≈ 0), non-exchangeable ones do not (ρ > 0), and the hook
equals the closed form; (2) the committed baseline `gradlab/data/check_baseline.json`: ρ and
W itself per scenario (a compact exact record of W: a rescaled, sign-flipped or masked gradient
is seen, "W scaled ×2.00" names a consistent rescale), and per source the mean signed Δρ. The
baseline records the machine it was made on (`gradlab.check.baseline`): there every number must
agree to round-off (16 ulps of float64 synthetic, float32 model); on another machine tolerances
apply, and the output says which. A sampled rollout that differs on another machine skips the
model scenarios' baseline comparison (said; invariants still checked); on the same machine it
is a change. Exit code 0: all good; 1: a violation or a change (named); 2: bad arguments; 3:
the user's loss raised or returned a non-scalar (traceback shown). `--loss pkg.mod:fn` imports
from the working directory first.

    gradlab check                         # built-in objectives vs the invariants and the baseline
    gradlab check --only gspo             # scenarios whose name contains "gspo"
    gradlab check --update                # rewrite the baseline (refused if an invariant fails)
    gradlab check --loss my_pkg.losses:my_loss            # your loss: must cancel everywhere
    gradlab check --loss path/to/losses.py:my_loss --expect residual
    python -m gradlab.check --update      # the same, without the `gradlab` CLI

A user loss is `fn(batch: gradlab.TokenBatch) -> scalar tensor`, built from batch.logps (B, T)
(with batch.old_logps, batch.advantages (B,), batch.mask, batch.tokens, batch.group). It is
checked on every scenario above; `--update --baseline mine.json` records a baseline for it and
later runs with `--baseline mine.json` compare against it. In pytest (your CI):

    from gradlab.testing import assert_cancels_in_regimes, assert_matches_baseline
    def test_my_loss_cancels():
        assert_cancels_in_regimes(my_loss)  # fails on 1/|o_i| ("on") or asymmetric clip ("far")
    def test_my_loss_unchanged():           # ρ and W against a committed file (update=True once)
        assert_matches_baseline(my_loss, "tests/my_loss_baseline.json")
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.userloss import UserLossError, guarded, load_loss, report_raised
from . import baseline as cb
from .scenarios import REGIMES

BASELINE = Path(__file__).parent.parent / "data" / "check_baseline.json"
SEEDS = (0, 1, 2)
COLUMNS = ("on", "near", "far", "on-eq", "close", "model-on", "model-off")
# the synthetic regimes: scenarios.REGIMES and one near GSPO's tight clip, so its bounds are seen
SYNTHETIC = {**REGIMES, "close": {"off_policy": 3e-3}}
# variant → (objective name, parameters)
VARIANTS = {
    "grpo": ("grpo", {}), "grpo-const": ("grpo", {"norm": "const"}),
    "grpo-seq": ("grpo", {"norm": "seq"}), "grpo-fix": ("grpo-fix", {}), "gspo": ("gspo", {}),
    "gspo-token": ("gspo-token", {}), "dfpo-min": ("dfpo-min", {}), "dfpo-orth": ("dfpo-orth", {}),
    "dfpo-scale": ("dfpo-scale", {}), "dfpo-nosg": ("dfpo", {"stop_grad": False}),
}
# Expected ρ per regime column (COLUMNS): 0 = cancels (docs/concepts/shared-nodes.md: exchangeable), + = does not
# (a mechanism of §3 is active), . = baseline only (depends on the sample, e.g. real lengths).
# grpo far: asymmetric clipping; grpo-seq/gspo on: 1/T_i; gspo near/far/close/model-off:
# coupling and GSPO's tight sequence clip; on-eq: GSPO = GRPO; dfpo-scale = ½·GSPO at shared tokens;
# dfpo-nosg: the gradient through w̃ adds a row-dependent term.
EXPECT_PREFIX = """
grpo       0 0 + 0 0 0 .
grpo-const 0 0 + 0 0 0 .
grpo-seq   + + + 0 + . .
grpo-fix   0 0 0 0 0 0 0
gspo       + + + 0 + . +
gspo-token + + + 0 + . +
dfpo-min   0 0 0 0 0 0 0
dfpo-orth  0 0 0 0 0 0 0
dfpo-scale + + + 0 + . +
dfpo-nosg  + + + + + + +
"""
# Trie nodes: a subset's Σ A is legitimate credit; constant-scale token objectives stay
# exchangeable there (DFPO's default scope is the full-group prefix only: baseline only).
EXPECT_TRIE = """
grpo       0 0 . 0 0 0 .
grpo-const 0 0 . 0 0 0 .
grpo-fix   0 0 0 0 0 0 0
"""
EXPECT_LEGEND = ("expect: ρ prefix/ρ trie must be 0 = cancel (round-off), + = a residual "
                 "(≥ 1e-3), . = anything (the baseline only)")
DEFAULT_TOL = {
    "synthetic": {"max_abs": 1e-6, "mean": 1e-8, "zero": 1e-9, "hook": 1e-9},
    "model": {"max_abs": 1e-3, "mean": 1e-4, "zero": 1e-5, "hook": 1e-4},
    "positive": 1e-3,
    "W": cb.W_TOL,
    "exact_ulps": cb.EXACT_ULPS,
}
MODEL = {"prompts": 4, "G": 8, "problem_seed": 2024, "sample_seed": 0}


def _table(text: str) -> dict[str, dict[str, str]]:
    out = {}
    for line in text.strip().splitlines():
        name, *marks = line.split()
        out[name] = dict(zip(COLUMNS, marks))
    return out


@dataclass
class Scenario:
    key: str  # source/variant/regime
    loss: Callable  # () -> loss_fn(batch); built at run time so monkeypatches apply
    closed: Callable | None  # () -> objective with .modulation, or None (user loss)
    expect: dict[str, str]  # {"rho_prefix": "0" | "+" | ".", "rho_trie": ...}

    @property
    def source(self) -> str:
        return self.key.split("/")[0]

    @property
    def regime(self) -> str:
        return self.key.rsplit("/", 1)[1]


@dataclass
class Result:
    key: str
    rho_prefix: list[float]
    rho_trie: list[float]
    hook_dev: float | None  # max |W_hook − W_closed| / max |W_hook|
    W: list[dict] = field(default_factory=list)  # check_baseline.w_record per seed
    problems: list[str] = field(default_factory=list)
    delta: float | None = None  # max |Δρ| against the baseline
    w_base: str = "—"  # W against the baseline: same, ×c or changed
    note: str = ""
    # per metric, per seed: why ρ is undefined there (no node, or W ≡ 0 at the nodes), None
    # where it is defined; ρ is NaN there, null in the baseline, printed as —
    undefined: dict = field(default_factory=dict)


def builtin_scenarios() -> list[Scenario]:
    pre, tri = _table(EXPECT_PREFIX), _table(EXPECT_TRIE)
    out = []
    for v, (name, params) in VARIANTS.items():
        build = (lambda n=name, p=params: __import__("gradlab").objectives.get(n, **p))
        for col in COLUMNS:
            key = f"model/{v}/{col[6:]}" if col.startswith("model") else f"synthetic/{v}/{col}"
            exp = {"rho_prefix": pre[v][col], "rho_trie": tri.get(v, {}).get(col, ".")}
            out.append(Scenario(key, (lambda b=build: b().loss), build, exp))
    return out


def user_scenarios(spec: str, expect: str) -> list[Scenario]:
    """Scenarios for a user loss `module:function` or `path/file.py:function`."""
    return loss_scenarios(guarded(load_loss(spec), spec), "loss:" + spec.rsplit(":", 1)[1], expect)


def loss_scenarios(fn: Callable, label: str, expect: str = "cancels") -> list[Scenario]:
    """Every scenario for the loss `fn(batch) -> scalar`, named `<source>/<label>/<regime>`;
    expect: cancels (ρ ≈ 0 required everywhere), residual or none (baseline only)."""
    mark = {"cancels": "0", "residual": ".", "none": "."}[expect]
    return [Scenario(f"model/{label}/{c[6:]}" if c.startswith("model") else f"synthetic/{label}/{c}",
                     lambda: fn, None, {"rho_prefix": mark, "rho_trie": "."}) for c in COLUMNS]


# ----------------------------------------------------------------------------- measuring


NO_NODE = {"prefix": "no full-group token", "trie": "no shared token"}
NO_GRADIENT = "no gradient at the shared tokens (W ≡ 0 there)"


def _rhos(W, batch) -> tuple[float, float, str | None, str | None]:
    """ρ prefix, ρ trie (NaN where undefined) and why each is undefined (no node, or W ≡ 0 at
    the nodes: nothing to cancel), None where it is defined."""
    from ..core.cancellation import cancellation

    if not bool(torch.isfinite(W[batch.mask]).all()):  # check_invariants names a non-finite W
        return float("nan"), float("nan"), None, None
    c = [cancellation(W, batch, kind) for kind in ("prefix", "trie")]
    why = [None if x.mass > 0 else NO_NODE[x.kind] if x.n_nodes == 0 else NO_GRADIENT for x in c]
    return (*(x.ratio if w is None else float("nan") for x, w in zip(c, why)), *why)


def _hook_dev(W, closed, batch) -> float | None:
    if closed is None:
        return None
    Wc = closed().modulation(batch).to(W.dtype)
    return float((W - Wc).abs().max() / W.abs().max().clamp(min=1e-30))


def run_synthetic(sc: Scenario) -> Result:
    from .scenarios import measure_modulation, random_batch

    pre, tri, devs, rec, up, ut = [], [], [], [], [], []
    for s in SEEDS:
        b = random_batch(n_groups=4, G=4, T=12, seed=s, **SYNTHETIC[sc.regime])
        W = measure_modulation(sc.loss(), b)
        p, t, p_undef, t_undef = _rhos(W, b)
        pre.append(p), tri.append(t), devs.append(_hook_dev(W, sc.closed, b))
        rec.append(cb.w_record(W)), up.append(p_undef), ut.append(t_undef)
    return Result(sc.key, pre, tri, None if sc.closed is None else max(devs), rec,
                  undefined={"rho_prefix": up, "rho_trie": ut})


@dataclass
class ModelSteps:
    """The real-model batches: the policy before and after one step, one rollout (float32)."""

    on: torch.nn.Module
    off: torch.nn.Module
    ro: object
    adv: torch.Tensor
    rows_on: torch.Tensor
    rows_off: torch.Tensor
    rollout: str  # hash of the sampled responses' texts and rewards (not of the mask/padding)
    training: dict  # the RunConfig defaults used (testing.training_defaults)


def model_steps() -> ModelSteps:
    from ..core import objectives
    from ..core.batch import advantages
    from ..loop.rollouts.rollout import generate
    from ..loop.setup.policy import load_policy
    from ..loop.setup.task import ArithmeticTask
    from .scenarios import loop_step_on, training_defaults

    tr = training_defaults()
    model, tok = load_policy()
    task = ArithmeticTask()
    problems = task.problems(MODEL["prompts"], seed=MODEL["problem_seed"])
    g = torch.Generator().manual_seed(MODEL["sample_seed"])
    ro = generate(model, tok, problems, MODEL["G"], task.max_new_tokens, tr["temperature"],
                  generator=g, task=task)
    adv = advantages(ro.rewards, ro.group, scale=tr["adv_scale"])
    half = MODEL["prompts"] // 2
    first, second = (ro.group < half).nonzero()[:, 0], (ro.group >= half).nonzero()[:, 0]
    off = copy.deepcopy(model)
    loop_step_on(off, ro, first, adv, objectives.get("grpo", norm="const").loss, tr)
    # what was sampled, independent of how it is masked: a changed mask shows in W, compared
    h = hashlib.sha1("\0".join(ro.texts).encode() + ro.rewards.numpy().tobytes())
    return ModelSteps(model, off, ro, adv, torch.arange(len(ro.texts)), second,
                      h.hexdigest()[:16], tr)


def run_model(sc: Scenario, ms: ModelSteps) -> Result:
    from .scenarios import measure_on_model

    model, rows = (ms.on, ms.rows_on) if sc.regime == "on" else (ms.off, ms.rows_off)
    W, batch = measure_on_model(model, ms.ro, rows, ms.adv, sc.loss(), ms.training["temperature"])
    p, t, p_undef, t_undef = _rhos(W, batch)
    return Result(sc.key, [p], [t], _hook_dev(W, sc.closed, batch), [cb.w_record(W)],
                  undefined={"rho_prefix": [p_undef], "rho_trie": [t_undef]})


@contextlib.contextmanager
def one_thread():
    """1 intra-op thread: the same float summation order everywhere (and far faster than 2
    contended threads for a 0.1M-parameter model)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def run(scenarios: list[Scenario]) -> tuple[list[Result], dict]:
    """Measure every scenario; returns (results, this run's identity: machine fingerprint,
    code hash, rollout hash and training settings (None without model scenarios))."""
    ms = None
    out = []
    with one_thread():
        fp = cb.fingerprint(torch.get_num_threads())
        for sc in scenarios:
            if sc.source == "synthetic":
                out.append(run_synthetic(sc))
            else:
                ms = ms or model_steps()
                out.append(run_model(sc, ms))
    return out, {"fingerprint": fp, "code_hash": cb.code_hash(BASELINE),
                 "rollout": ms.rollout if ms else None, "training": ms.training if ms else None}


# ----------------------------------------------------------------------------- judging


def check_invariants(results: list[Result], scenarios: list[Scenario], tol: dict) -> None:
    """Append violations of the invariants (docs/concepts/shared-nodes.md) to each result's `problems`."""
    for r, sc in zip(results, scenarios):
        t = tol[sc.source]
        bad = [i for i, w in enumerate(r.W) if not torch.isfinite(torch.tensor(w["sum_abs"]))]
        if bad:  # ρ of a NaN W compares as neither 0 nor > 0: say so instead
            r.problems.append(f"W is not finite (NaN or inf) on seed(s) {bad}")
        for metric in ("rho_prefix", "rho_trie"):
            mark, defined = sc.expect[metric], _defined(getattr(r, metric))
            rho = max(defined) if defined else None  # None: undefined at every seed
            if mark == "0" and rho is not None and rho > t["zero"]:
                r.problems.append(f"{metric} {rho:.3g} > {t['zero']:g}: expected cancellation")
            if mark == "+" and rho is None and not bad:
                r.problems.append(f"{metric} undefined at every seed (no node, or W ≡ 0 there): "
                                  "expected a residual")
            if mark == "+" and rho is not None and rho < tol["positive"]:
                r.problems.append(f"{metric} {rho:.3g} < {tol['positive']:g}: expected a residual")
        if r.hook_dev is not None and r.hook_dev > t["hook"]:
            r.problems.append(f"hook W ≠ closed form (rel. {r.hook_dev:.2g})")


def _defined(rhos: list[float | None]) -> list[float]:
    """The values of ρ that are numbers (undefined: NaN, or None as read from a baseline)."""
    return [x for x in rhos if x is not None and x == x]


UNDEFINED = "—⁰"  # ρ undefined at every seed: W ≡ 0 at the nodes (legend under the table)


def _worst(rhos: list[float], undefined: list = ()) -> str:
    """The largest ρ over the seeds where it is defined; "—" for a non-finite W (the FAIL line
    says so), UNDEFINED where no seed defines it."""
    why = list(undefined) or [None] * len(rhos)
    if any(x != x and not w for x, w in zip(rhos, why)):
        return "—"
    defined = _defined(rhos)
    return f"{max(defined):.3g}" if defined else UNDEFINED


def render(results: list[Result], scenarios: list[Scenario]) -> str:
    """The readable table (markdown-ish, fixed width), then one line per failed scenario
    naming every problem. Columns: |Δρ| base = max |Δρ| against the baseline; W base = "same",
    the common factor ("×2.00") or "changed" (— where not compared)."""
    head = (f"{'scenario':<30} {'ρ prefix':>9} {'ρ trie':>9} {'expect':>6} {'hook−closed':>11} "
            f"{'|Δρ| base':>9} {'W base':>8}  status")
    lines = [head, "-" * len(head)]
    for r, sc in zip(results, scenarios):
        exp = f"{sc.expect['rho_prefix']}/{sc.expect['rho_trie']}"
        dev = "—" if r.hook_dev is None else f"{r.hook_dev:.1e}"
        dlt = "—" if r.delta is None else f"{r.delta:.1e}"
        status = "FAIL" if r.problems else "ok" + (f" ({r.note})" if r.note else "")
        rp, rt = (_worst(getattr(r, m), r.undefined.get(m, ())) for m in ("rho_prefix", "rho_trie"))
        lines.append(f"{r.key:<30} {rp:>9} {rt:>9} {exp:>6} "
                     f"{dev:>11} {dlt:>9} {r.w_base:>8}  {status}")
    lines.append(EXPECT_LEGEND)
    if any(UNDEFINED in ln for ln in lines[2:]):
        lines.append(f"{UNDEFINED} undefined: no node, or no gradient at the shared tokens (W ≡ 0 "
                     "there, so nothing to cancel) at every seed; null in the baseline, never 0")
    lines += [f"FAIL {r.key}: " + "; ".join(r.problems) for r in results if r.problems]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    # one definition of the options, shared with `gradlab check`
    from ..cli.args import Parser, regression_check_options

    p = Parser(prog="gradlab check", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    regression_check_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_checked(_parser().parse_args(argv[1:] if argv[:1] == ["--"] else argv))


def run_checked(a: argparse.Namespace) -> int:
    """`gradlab check` with parsed options: exit code 0 pass, 1 a violation, 2 bad arguments."""
    path = Path(a.baseline) if a.baseline else None if a.loss else BASELINE
    try:
        base = cb.read_baseline(path, a.update)
        scenarios = user_scenarios(a.loss, a.expect) if a.loss else builtin_scenarios()
        if a.loss and a.update and not a.baseline:
            raise ValueError("--update with --loss needs --baseline PATH (your own file)")
        with one_thread():
            cb.refuse_mixed_update(bool(a.update and (a.only or a.no_model)), base,
                                   cb.fingerprint(torch.get_num_threads()))
    except (ValueError, ImportError) as e:
        print(f"gradlab check: error: {e}", file=sys.stderr)
        return 2
    except UserLossError as e:
        return report_raised(e)
    scenarios = [s for s in scenarios if (not a.only or a.only in s.key)
                 and not (a.no_model and s.source == "model")]
    if not scenarios:
        print(f"gradlab check: error: no scenario matches --only {a.only!r}", file=sys.stderr)
        return 2
    try:
        return check_scenarios(scenarios, base, path if a.update else None,
                               partial=bool(a.only or a.no_model),
                               residual=a.loss if a.expect == "residual" else None)
    except UserLossError as e:
        return report_raised(e)


def check_scenarios(scenarios: list[Scenario], base: dict, update: Path | None = None,
                    partial: bool = False, residual: str | None = None) -> int:
    """Measure `scenarios`, hold them to the invariants and to `base` (a baseline dict, {} for
    none), print the report; with `update`, write the baseline there instead of comparing
    (merged into `base` when `partial`). residual: a loss that must show ρ > 0 somewhere.
    Returns the exit code (0 pass, 1 a violation or change); raises UserLossError."""
    tol = {**DEFAULT_TOL, **base.get("tolerance", {})}
    results, now = run(scenarios)
    check_invariants(results, scenarios, tol)
    msgs, notes = ([], []) if update else cb.compare(results, base, now, tol)
    defined = [x for r in results for x in _defined(r.rho_prefix)]
    if residual and (not defined or max(defined) < tol["positive"]):
        msgs.append(f"{residual}: expected a residual somewhere, but " + (
            f"ρ < {tol['positive']:g} in every scenario" if defined else
            "ρ is undefined in every scenario (no full-group token, or W ≡ 0 there)"))
    print(render(results, scenarios))
    print("".join(f"note: {n}\n" for n in notes) + "".join(f"FAIL: {m}\n" for m in msgs), end="")
    if update:
        return cb.write_baseline(update, base, results, now=now, tol=tol, partial=partial,
                           model_setup=MODEL, seeds=SEEDS)
    bad = [r.key for r in results if r.problems]
    if bad or msgs:
        print(f"gradlab check: {len(bad)} scenario(s) failed{': ' if bad else ''}{', '.join(bad)}")
        return 1
    print(f"gradlab check: all {len(results)} scenarios pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
