"""The baseline of `gradlab check`: what it records, and how a run is compared against it.

Per scenario the baseline holds ρ (prefix and trie nodes, one value per seed) and a compact,
exact record of W itself per seed (`w_record`): Σ W, Σ|W|, ‖W‖₂, two fixed random projections
Σ W·r₁ and Σ W·r₂, and the number of tokens with W ≠ 0. ρ is scale-free; these are not, so a loss
whose gradient is consistently rescaled, sign-flipped, or that drops a token is seen.

The baseline also records the machine it was made on (`fingerprint`: CPU model and the
kernels torch uses on it, torch and transformers builds, the check's intra-op threads) and, for information only, the gradlab code
hash. Two modes:

  exact      same fingerprint: every number must agree to round-off: EXACT_ULPS ulps of the
             working precision (float64 synthetic batches, float32 model W) times its scale
             (1 for ρ, Σ|W| of the seed for a W statistic). One AdamW step with half the
             learning rate moves model W statistics by ~1e-3 of Σ|W|; torch's portable instead
             of its vectorised CPU kernels by ~1e-7.
  tolerance  another fingerprint: ρ within `tolerance[source]["max_abs"]`, each W statistic
             within `tolerance["W"][source]` × Σ|W| (float64 synthetic batches: 1e-9; the model:
             1e-3, ~10⁴ × the 1e-7 measured between torch's vectorised and portable CPU kernels,
             ~10⁻³ of a ×2 or ×0.5 rescale).

A change of W by one common factor c (every statistic × c, the same tokens non-zero) is reported
as "W scaled ×c against the baseline".
"""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import torch

from .. import jsonio

# the working precision per source: synthetic batches are float64, the model's W float32
EPS = {"synthetic": float(torch.finfo(torch.float64).eps),
       "model": float(torch.finfo(torch.float32).eps)}
EXACT_ULPS = 16
W_TOL = {"synthetic": 1e-9, "model": 1e-3}
SIGNED = ("sum", "dot_r1", "dot_r2")  # flip sign with W
UNSIGNED = ("sum_abs", "l2")
LABEL = {"sum": "ΣW", "sum_abs": "Σ|W|", "l2": "‖W‖₂", "dot_r1": "ΣW·r₁", "dot_r2": "ΣW·r₂",
         "nnz": "tokens with W≠0"}


# ----------------------------------------------------------------------------- recording


def _projection(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fixed standard-normal (B, T) float64 tensor: the same for the same shape everywhere."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def w_record(W: torch.Tensor) -> dict:
    """Statistics of W (B, T) (any float dtype; summed in float64): sum, sum_abs, l2, dot_r1,
    dot_r2 (Σ W·r for fixed random r), nnz (tokens with W ≠ 0). Units: those of W."""
    w = W.detach().double().cpu()
    return {"sum": float(w.sum()), "sum_abs": float(w.abs().sum()), "l2": float(w.norm()),
            "dot_r1": float((w * _projection(w.shape, 1)).sum()),
            "dot_r2": float((w * _projection(w.shape, 2)).sum()), "nnz": int((w != 0).sum())}


def fingerprint(threads: int) -> dict:
    """What makes the check's numbers bitwise reproducible: CPU model, the kernels torch picked
    for it (AVX512, AVX2, DEFAULT, …: a CPU model name can be generic), torch and transformers
    builds, and the intra-op threads the check computes with."""
    import transformers

    from ..provenance import cpu_model

    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": threads}


def code_hash(skip: Path) -> str:
    """`provenance.code_hash` without the file `skip` (the baseline itself, which is package
    data: writing it must not change the hash it records)."""
    from ..provenance import code_hash as package_hash

    return package_hash(skip)


def environment() -> dict:
    import transformers

    from .. import __version__

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gradlab": __version__,
            "platform": platform.platform(), "machine": platform.machine(), "threads": 1}


def diff(old: dict, new: dict) -> str:
    """`key: old → new` for every key that differs ("" when none)."""
    return "; ".join(f"{k}: {old.get(k)} → {v}" for k, v in new.items() if old.get(k) != v)


# ----------------------------------------------------------------------------- comparing W


def _changes(new: list[dict], old: list[dict], atol: list[float]) -> list[str]:
    """Every W statistic (per seed) outside its tolerance, as `stat [seed s] old → new`."""
    out = []
    for s, (n, o, a) in enumerate(zip(new, old, atol)):
        where = f" [seed {s}]" if len(new) > 1 else ""
        if n["nnz"] != o["nnz"]:
            out.append(f"{LABEL['nnz']}{where} {o['nnz']} → {n['nnz']}")
        for k in (*SIGNED, *UNSIGNED):
            if not abs(n[k] - o[k]) <= a:  # NaN counts as a change
                out.append(f"{LABEL[k]}{where} {o[k]:.6g} → {n[k]:.6g}")
    return out


def common_factor(new: list[dict], old: list[dict], atol: list[float]) -> float | None:
    """c when every statistic of `new` is c × that of `old` within c × atol (the same tokens
    non-zero), else None. c < 0: the sign flipped."""
    if any(n["nnz"] != o["nnz"] for n, o in zip(new, old)):
        return None
    uo = [o[k] for o in old for k in UNSIGNED]
    un = [n[k] for n in new for k in UNSIGNED]
    den = sum(x * x for x in uo)
    if not den > 0 or not all(math.isfinite(x) for x in un):
        return None
    c = sum(x * y for x, y in zip(un, uo)) / den
    so = [(o[k], a) for o, a in zip(old, atol) for k in SIGNED]
    sn = [n[k] for n in new for k in SIGNED]
    flip = sum(x * y for x, (y, _) in zip(sn, so)) < 0
    signed = -c if flip else c
    ok_u = all(abs(n[k] - c * o[k]) <= c * a for n, o, a in zip(new, old, atol) for k in UNSIGNED)
    ok_s = all(abs(x - signed * y) <= c * a for x, (y, a) in zip(sn, so))
    return signed if c > 0 and ok_u and ok_s else None


def factor_text(c: float) -> str:
    """×c with enough digits to differ from ×1.00 (a factor 1.0001 is not "×1.00")."""
    for d in (2, 4, 6, 8):
        txt = f"{c:.{d}f}"
        if float(txt) not in (1.0, 0.0):
            break
    return "×" + txt.replace("-", "−")


def compare_w(new: list[dict], old: list[dict], rel: float) -> str | None:
    """None when W matches the baseline (each statistic within rel × Σ|W| of its seed), else
    one message: "W scaled ×c against the baseline" or the statistics that changed."""
    if len(new) != len(old):
        return f"W: baseline has {len(old)} seed(s), this run {len(new)}"
    lacking = sorted({k for o in old for k in (*SIGNED, *UNSIGNED, "nnz") if k not in o})
    if lacking:
        return f"W: the baseline's W record lacks {', '.join(lacking)} (--update rewrites it)"
    atol = [rel * o["sum_abs"] for o in old]
    changed = _changes(new, old, atol)
    if not changed:
        return None
    c = common_factor(new, old, atol)
    if c is not None:
        flip = " (sign flipped)" if c < 0 else ""
        return f"W scaled {factor_text(c)} against the baseline{flip}"
    cs = [common_factor([n], [o], [a]) for n, o, a in zip(new, old, atol)]
    if len(cs) > 1 and None not in cs:  # each seed rescaled, by a factor of its own batch
        return ("W scaled per seed: " + ", ".join(f"{factor_text(c)} [seed {s}]"
                                                  for s, c in enumerate(cs))
                + " against the baseline (a factor that depends on the batch: a normalisation?)")
    nnz = _nnz_text(new, old)
    return "W changed: " + (nnz + ": " if nnz else "") + listed(changed)


def _nnz_text(new: list[dict], old: list[dict]) -> str:
    """What a changed count of tokens with W ≠ 0 means ("" when no seed's count changed); a
    count that fell by n means at least n tokens lost their gradient."""
    def seeds(d: list[int]) -> str:
        if len(d) == 1:
            return f"{d[0]} token(s)"
        if len(set(d)) == 1:
            return f"{d[0]} token(s) at each of {len(d)} seeds"
        return ", ".join(f"{x} [seed {s}]" for s, x in enumerate(d)) + " token(s)"
    lost = [max(o["nnz"] - n["nnz"], 0) for n, o in zip(new, old)]
    gained = [max(n["nnz"] - o["nnz"], 0) for n, o in zip(new, old)]
    parts = ([f"W is 0 on {seeds(lost)} where the baseline had a gradient (a detached or "
              "missing gradient, or a clip?)"] if any(lost) else []) + (
             [f"W is non-zero on {seeds(gained)} where the baseline had none (a gradient the "
              "baseline lacked: a mask, or a detach removed?)"] if any(gained) else [])
    return "; ".join(parts)


def listed(items: list[str], n: int = 4) -> str:
    """The first n items, comma-separated, and how many more."""
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# ----------------------------------------------------------------------------- comparing a run


def mode(base: dict, now: dict, tol: dict) -> tuple[bool, str]:
    """(exact?, the line saying how the run is compared): exact on the baseline's fingerprint."""
    fp, old = now["fingerprint"], base.get("fingerprint") or {}
    if old == fp:
        syn, mod = exact_tol("synthetic", tol), exact_tol("model", tol)
        return True, (f"baseline made on this machine ({fp['cpu_model']}, torch {fp['torch']}, "
                      f"{fp['threads']} thread(s)): compared exactly, to round-off "
                      f"({tol.get('exact_ulps', EXACT_ULPS)} ulps of the working precision: "
                      f"|Δρ| ≤ {syn:.1e} synthetic (float64), {mod:.1e} model (float32); each "
                      f"W statistic within the same × Σ|W|)")
    w = tol.get("W", W_TOL)
    why = diff(old, fp) if old else "no machine fingerprint in the baseline"
    return False, (f"baseline made on another machine ({why}): compared with tolerances "
                   f"(|Δρ| ≤ {tol['synthetic']['max_abs']:g} synthetic, "
                   f"{tol['model']['max_abs']:g} model; each W statistic within "
                   f"{w['synthetic']:g} × Σ|W| synthetic, {w['model']:g} × Σ|W| model)")


def exact_tol(src: str, tol: dict) -> float:
    """The exact mode's tolerance: `exact_ulps` ulps of the source's working precision."""
    return tol.get("exact_ulps", EXACT_ULPS) * EPS[src]


def _undefined(x: float | None) -> bool:
    """ρ undefined: null in a baseline file (None), NaN in a run."""
    return x is None or x != x


def _rho_text(x: float | None) -> str:
    return "undefined" if _undefined(x) else f"{x:.6g}"


def _rho_changes(new: list[float], old: list[float | None], atol: float,
                 name: str) -> list[str]:
    """`name [seed s] old → new` for each seed whose ρ moved by more than atol, or turned from
    undefined to defined or back (both undefined: the same)."""
    seeds = len(new) > 1
    return [f"{name}{f' [seed {s}]' if seeds else ''} {_rho_text(o)} → {_rho_text(n)}"
            for s, (n, o) in enumerate(zip(new, old))
            if _undefined(n) != _undefined(o) or not (_undefined(n) or abs(n - o) <= atol)]


def compare_one(r, b: dict, src: str, exact: bool, tol: dict) -> list[float]:
    """ρ and W of result `r` against its baseline entry `b`: problems appended to r.problems
    (every changed number named; a ρ that turned from undefined to defined, or back, is a
    change), r.delta set (max |Δρ| over the seeds where both are defined); returns the signed
    Δρ of those seeds (for the mean drift)."""
    if any(not math.isfinite(w["sum_abs"]) for w in r.W):
        return []  # a non-finite W: named by the invariants, nothing to compare
    atol = exact_tol(src, tol) if exact else tol[src]["max_abs"]
    new, old = r.rho_prefix + r.rho_trie, b["rho_prefix"] + b["rho_trie"]
    if len(new) != len(old):
        r.problems.append("baseline has a different number of seeds")
        return []
    d = [x - y for x, y in zip(new, old) if not (_undefined(x) or _undefined(y))]
    r.delta = max((abs(x) for x in d), default=0.0)
    flips = sum(_undefined(x) != _undefined(y) for x, y in zip(new, old))
    if flips or not r.delta <= atol:
        ch = (_rho_changes(r.rho_prefix, b["rho_prefix"], atol, "ρ prefix")
              + _rho_changes(r.rho_trie, b["rho_trie"], atol, "ρ trie"))
        what = (f"|Δρ| {r.delta:.3g} > {atol:.2g}" if not r.delta <= atol else
                f"ρ undefined ↔ defined on {flips} value(s)")
        r.problems.append(f"{what} vs baseline ({listed(ch)})")
    if "W" not in b:
        r.note = "baseline has no W record: ρ only; --update records W"
    else:
        rel = exact_tol(src, tol) if exact else tol.get("W", W_TOL)[src]
        msg = compare_w(r.W, b["W"], rel)
        r.w_base = "same" if msg is None else (msg.split()[2] if msg.startswith("W scaled ×")
                                                else "per seed" if msg.startswith("W scaled")
                                                else "changed")
        if msg:
            r.problems.append(msg)
    return d


def compare(results: list, base: dict, now: dict, tol: dict) -> tuple[list[str], list[str]]:
    """Every result against the baseline (see the module doc). now: this run's fingerprint,
    rollout hash (None without model scenarios), code hash and training settings. Returns
    (failures not tied to one scenario, notes); per-scenario problems go to each result."""
    if not base:
        for r in results:
            r.note = "no baseline"
        return [], []
    exact, line = mode(base, now, tol)
    notes, msgs = [line], []
    scen = base.get("scenarios", {})
    same_rollout = now["rollout"] is not None and now["rollout"] == base.get("rollout")
    if now["rollout"] is not None and not same_rollout:
        text = f"the model rollout differs from the baseline's ({now['rollout']} vs {base.get('rollout')})"
        (msgs if exact else notes).append(
            text + (" on the same machine: the sampler, task or policy changed" if exact else
                    f" ({diff(base.get('environment', {}), environment()) or 'same environment'});"
                    " model scenarios are checked against the invariants only"))
    if exact and base.get("code_hash") not in (None, now["code_hash"]):
        notes.append(f"code differs from the baseline's (code hash {base['code_hash']} → "
                     f"{now['code_hash']}): not part of the match")
    old_train = base.get("model_setup", {}).get("training")
    if now["rollout"] is not None and old_train and old_train != now["training"]:
        notes.append(f"RunConfig training defaults differ from the baseline's "
                     f"({diff(old_train, now['training'])}): model/*/off scenarios see it in W")
    deltas: dict[str, list[float]] = {"synthetic": [], "model": []}
    for r in results:
        src = r.key.split("/")[0]
        if r.key not in scen:
            r.note = "no baseline"
        elif src == "model" and not same_rollout:
            if exact:
                r.problems.append("rollout differs from the baseline's")
            else:
                r.note = "samples differ from baseline: not compared"
        else:
            deltas[src] += compare_one(r, scen[r.key], src, exact, tol)
    for src, d in deltas.items():
        if d and not abs(sum(d) / len(d)) <= tol[src]["mean"]:
            msgs.append(f"{src}: mean Δρ {sum(d) / len(d):+.3g} over {len(d)} values exceeds "
                        f"the mean-drift tolerance {tol[src]['mean']:g}")
    return msgs, notes


# ----------------------------------------------------------------------------- the file


def read_baseline(path: Path | None, update: bool) -> dict:
    """The baseline at `path` ({} for none); a missing file is an error unless --update writes it."""
    if path is None:
        return {}
    if not path.is_file():
        if update:
            return {}
        raise ValueError(f"--baseline: {path} does not exist (--update writes a new one)")
    try:
        base = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--baseline: {path} is not readable JSON ({e})") from None
    if not isinstance(base, dict) or not isinstance(base.get("scenarios", {}), dict):
        raise ValueError(f"--baseline: {path} is not a gradlab check baseline (a JSON object "
                         "with 'scenarios')")
    if isinstance(base.get("fingerprint"), str):  # a ρ-only baseline: its rollout hash
        base = {**base, "rollout": base["fingerprint"], "fingerprint": {}}
    return base


def baseline_dict(results: list, now: dict, tol: dict, model_setup: dict, seeds) -> dict:
    """The baseline file's content: machine fingerprint, code hash (recorded, not matched),
    rollout hash and training settings of the model scenarios, ρ and W per scenario."""
    from ..provenance import git_state

    return {"gradlab_check": 2, "environment": environment(), "fingerprint": now["fingerprint"],
            "code_hash": now["code_hash"], "commit": git_state()["commit"], "tolerance": tol,
            "rollout": now["rollout"], "model_setup": {**model_setup, "training": now["training"]},
            "seeds": list(seeds),
            "scenarios": {r.key: _scenario(r) for r in results}}


def _scenario(r) -> dict:
    """One scenario's baseline entry: ρ per seed (null where undefined, the reasons per seed
    under "undefined", gradlab.jsonio's convention) and the W record per seed."""
    out = {"rho_prefix": r.rho_prefix, "rho_trie": r.rho_trie, "W": r.W}
    why = {}
    for m, ws in getattr(r, "undefined", {}).items():
        seeds: dict[str, list[str]] = {}
        for s, w in enumerate(ws):
            if w:
                seeds.setdefault(w, []).append(str(s))
        if seeds:
            why[m] = "; ".join(w if len(ws) == 1 else
                               f"{w} at seed{'s' * (len(s) > 1)} {', '.join(s)}"
                               for w, s in seeds.items())
    return {**out, "undefined": why} if why else out


def write_baseline(path: Path, base: dict, results: list, *, now: dict, tol: dict, partial: bool,
                   model_setup: dict, seeds) -> int:
    """Write the baseline (merged into `base` when only some scenarios ran); refused (1) when a
    scenario violates the invariants."""
    bad = [r.key for r in results if r.problems]
    if bad:
        print(f"gradlab check: not updating {path}: {len(bad)} scenario(s) violate the "
              "invariants (docs/concepts/shared-nodes.md)")
        return 1
    if now["rollout"] is None:  # no model scenario ran: keep the baseline's model setup
        now = {**now, "rollout": base.get("rollout"),
               "training": base.get("model_setup", {}).get("training")}
    new = baseline_dict(results, now, tol, model_setup, seeds)
    new["scenarios"] = {**(base.get("scenarios", {}) if partial else {}), **new["scenarios"]}
    path.write_text(dumps(new))
    print(f"baseline written: {path} ({len(new['scenarios'])} scenarios)")
    return 0


def refuse_mixed_update(partial_update: bool, base: dict, fp: dict) -> None:
    """ValueError for --update with --only/--no-model into a baseline made on another machine:
    its other scenarios would then be judged exactly as this machine's."""
    if partial_update and base.get("scenarios") and base.get("fingerprint") != fp:
        raise ValueError("--update with --only/--no-model would merge into a baseline made on "
                         "another machine; rerun --update without them")


def dumps(d: dict) -> str:
    """Strict JSON (`gradlab.jsonio`: an undefined ρ is null) with one line per scenario
    (readable diffs in review)."""
    d = dict(d)
    scen = d.pop("scenarios")
    body = jsonio.dumps(d, indent=1)[:-2]
    rows = ",\n".join(f"  {json.dumps(k)}: {jsonio.dumps(v)}" for k, v in scen.items())
    return body + ',\n "scenarios": {\n' + rows + "\n }\n}\n"
