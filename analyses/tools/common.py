"""Shared helpers of the analysis scripts (figure2, figure3, ablations); drawing and the
notebooks' helpers live in gradlab.viz.

Every training-based figure reads the run store's tidy table (`gradlab.load_run`): columns
run, objective, seed, step, tokens, metric, value (`load_seeds` drops the `undefined` reasons
beside them). Helpers here train seeds into run folders, put seeds on a common token axis,
bootstrap over seeds and evaluate final checkpoints.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from gradlab import jsonio
from gradlab.loop.config import RunConfig
from gradlab.loop.runs.store import REASON, load_run

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "figures"

# Quick mode: the tiniest loop that still has groups, minibatches and every probe (seconds).
QUICK = dict(steps=2, prompts=2, G=4, minibatches=2, probe_contexts=2, tax_every=1,
             ckpt_every=100, progress=False)


def set_threads(n: int = 1) -> None:
    """The tiny policy runs fastest on one intra-op thread (2 contended threads: ~50× slower)."""
    torch.set_num_threads(n)


def run_seeds(root: str | Path, seeds, ledger: list | None = None, reuse_any_code: bool = False,
              **cfg) -> Path:
    """Train `RunConfig(out=root/seed{k}, seed=k, **cfg)` for each seed; returns root.

    A seed whose folder already holds a finished run of the same configuration (final
    checkpoint at `steps`) *made by the current code* (gradlab.provenance.same_code) is reused,
    one with a checkpoint of the current code is resumed, anything else (another
    configuration, other or unrecorded code, no checkpoint) is wiped and trained from scratch:
    the run store appends, so a folder must never be trained into twice. reuse_any_code=True
    reuses a finished run whatever code made it (the ledger says so). `ledger`: a list that
    gets one row per seed (`run_row`: run, code hash, machine, reused).
    """
    from gradlab.loop.train import train
    from gradlab.provenance import same_code

    root = Path(root)
    for k in seeds:
        c = RunConfig(out=str(root / f"seed{k}"), seed=k, **cfg)
        state = _final_step(Path(c.out), c.objectives) if _same_config(c) else None
        if state is not None and not (reuse_any_code and state == c.steps) and not same_code(c.out):
            state = None  # made by other code: its numbers are not this code's
        reused = state == c.steps
        if not reused:
            if state is None and Path(c.out).exists():
                shutil.rmtree(c.out)
            train(c, resume=state is not None)
        if ledger is not None:
            ledger.append(run_row(c.out, reused))
    return root


def run_row(run: str | Path, reused: bool) -> dict:
    """A figure's provenance row for one run (`gradlab.provenance.summary`). It stores no
    flag for "made by the shipped code": that changes with every later commit, so
    `python -m analyses.tools.provenance` computes it when asked."""
    from gradlab.provenance import summary

    return summary(run, reused)


def _run_one(job: tuple) -> list:
    root, seed, reuse_any_code, cfg = job
    set_threads(1)
    ledger: list = []
    run_seeds(root, [seed], ledger=ledger, reuse_any_code=reuse_any_code, **cfg)
    return ledger


def run_jobs(jobs: list[tuple], processes: int = 1, ledger: list | None = None) -> None:
    """`run_seeds(root, [seed], reuse_any_code=…, **cfg)` for each job (root, seed,
    reuse_any_code, cfg), in `processes` worker processes (each one torch thread; every seed
    has its own folder, so they never share a writer). The ledgers come back in job order."""
    if processes <= 1:
        out = [_run_one(j) for j in jobs]
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as ex:
            out = list(ex.map(_run_one, jobs))
    if ledger is not None:
        for part in out:
            ledger.extend(part)


def _same_config(c: RunConfig) -> bool:
    f = Path(c.out) / "config.json"
    if not f.exists():
        return False
    old, new = RunConfig.from_json(f).to_json(), c.to_json()
    # the folder is the same by construction; `out` may be spelled relative or absolute
    for k in ("progress", "out"):
        old.pop(k), new.pop(k)
    return old == new


def _final_step(run: Path, names: list[str]) -> int | None:
    """Step of the checkpoints of every objective if they agree, else None."""
    import json

    steps = set()
    for n in names:
        f = run / "checkpoints" / n / "state.json"
        if not f.exists():
            return None
        steps.add(json.loads(f.read_text())["step"])
    return steps.pop() if len(steps) == 1 else None


def load_seeds(root: str | Path) -> pd.DataFrame:
    """The tidy table of every run folder under root (one per seed), `time_*` metrics dropped;
    the figures' columns (run, objective, seed, step, tokens, metric, value: an undefined value
    is NaN, the reasons stay with `load_run`)."""
    tidy = load_run(root).drop(columns=[REASON])
    return tidy[~tidy["metric"].str.startswith("time_")].reset_index(drop=True)


def mean_ci(x, level: float = 0.95) -> tuple:
    """(mean, lo, hi): Student-t interval of the mean of the finite values x (e.g. one per
    seed; gradlab.stats.mean_interval). One value: the interval is that value; none: NaNs."""
    from gradlab.stats import mean_interval

    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return (np.nan, np.nan, np.nan)
    r = mean_interval(x, level)
    return r["mean"], r["lo"], r["hi"]


def fmt_diff(r: dict, scale: float = 1.0) -> str:
    """'+1.6 [−2.3, +5.2], p 0.43' from a gradlab.stats.paired_interval result."""
    return (f"{scale * r['mean']:+.1f} [{scale * r['lo']:+.1f}, {scale * r['hi']:+.1f}], "
            f"p {r['p']:.2g}")


def fmt_ci(m: float, lo: float, hi: float, scale: float = 100.0) -> str:
    """'41.2 [38.0, 44.1]' (in %, by default)."""
    return f"{m * scale:.1f} [{lo * scale:.1f}, {hi * scale:.1f}]"


def load_run_policy(run: str | Path, objective: str | None = None):
    """(model, tokenizer) of a run: the initial policy, or an objective's final checkpoint."""
    from safetensors.torch import load_file

    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import get_task

    cfg = RunConfig.from_json(Path(run) / "config.json")
    arith = cfg.task == "arithmetic"
    task = get_task(cfg.task, difficulty=cfg.difficulty) if arith else get_task(cfg.task)
    builtin = cfg.task in ("arithmetic", "scaffold")  # the shipped policy of a built-in task
    model, tok = load_policy(cfg.model, task=task if builtin else None)
    if objective is not None:
        sd = load_file(Path(run) / "checkpoints" / objective / "model.safetensors")
        model.load_state_dict(sd, strict=False)  # tied weights are stored once
    return model.eval(), tok, task, cfg


def final_accuracy(run: str | Path, objective: str, n: int = 256, seed: int = 777_000) -> float:
    """Held-out accuracy (temperature 1, n fresh problems) of an objective's final policy."""
    from gradlab.loop.setup.policy import evaluate

    model, tok, task, _ = load_run_policy(run, objective)
    return evaluate(model, tok, task, n=n, seed=seed)["accuracy"]


def provenance(module: str, argv: list[str] | None) -> dict:
    """What a committed figure's data must record: the code (hash of the package source,
    commit, whether gradlab/ had uncommitted changes), the machine (CPU model, torch, intra-op
    threads) and the command that made it (gradlab.provenance). `module` is the script's module
    name (`analyses.figures.figure3`); the command reads `python -m <module> <argv...>`."""
    from gradlab.provenance import current

    args = sys.argv[1:] if argv is None else list(argv)
    return {**current(), "command": " ".join(["python", "-m", module, *args])}


def stamp(prov: dict) -> str:
    """One line for a table's footnote: command, code hash, commit, CPU, torch, threads."""
    commit = (prov.get("commit") or "no git")[:10] + (" + uncommitted" if prov.get("dirty") else "")
    return (f"`{prov['command']}`, code {prov['code_hash']} (commit {commit}), "
            f"{prov['cpu_model']}, torch {prov['torch']}, {prov['threads']} thread(s)")


# ----------------------------------------------------------------------------- per-seed rows
# What each table row reports besides accuracy: the run's own measurements (docs/concepts/shared-nodes.md, docs/concepts/drift.md).
MEASURED = {"rho_prefix": "mean over rollout steps of ρ at full-group nodes",
            "rho_trie": "mean over rollout steps of ρ at trie nodes",
            "tax_share": "mean over measured steps of ‖g_tax‖/‖g_total‖",
            "probe_kl": "drift: cumulative KL at shared probe contexts, mean of the last 5 steps",
            "tokens": "rollout tokens consumed by the end (compute)"}


def heldout(run: Path, objective: str, sampled: pd.Series, eval_n: int,
            exact_n: int | None = None, seed: int = 777_000) -> tuple[float, str]:
    """(accuracy, source) of an objective's final policy, the least noisy score the run allows:
    `exact_split` — the exact expected accuracy over the task's whole held-out split (its first
    `exact_n` problems when given) where the verifier accepts a known list of strings (the
    built-in tasks; no evaluation noise, figures/noise_budget.md); else `eval_accuracy` — the
    store's last sampled held-out score (`sampled`: the run's eval_accuracy by step; disjoint
    from training prompts); else `fresh{eval_n}` (eval_n fresh problems at temperature 1, the
    same for every objective, not disjoint; as `final_accuracy`). The policy is loaded once."""
    from gradlab.loop.recipes.evaluation import expected_accuracy, heldout_split
    from gradlab.loop.setup.policy import evaluate

    model, tok, task, _ = load_run_policy(run, objective)
    if getattr(task, "exact_answers", False):
        split = heldout_split(task)[:exact_n]
        return float(expected_accuracy(model, tok, task, split).mean()), "exact_split"
    if len(sampled):
        return float(sampled.iloc[-1]), "eval_accuracy"
    return evaluate(model, tok, task, n=eval_n, seed=seed)["accuracy"], f"fresh{eval_n}"


def per_seed(root: Path, seeds, names, eval_n: int, last: int = 5,
             exact_n: int | None = None) -> pd.DataFrame:
    """One row per (seed, objective) of the runs root/seed{k}: heldout_acc (+ its source, see
    `heldout`; the loop's last sampled held-out score in heldout_sampled),
    train_acc_last5 (mean training accuracy of the last `last` rollout steps), the MEASURED
    columns and opt_steps (despite the name: rollout steps taken; each is `minibatches` optimizer
    steps). Accuracies in 0..1."""
    tidy = load_seeds(root)
    rows = []
    for k in seeds:
        t = tidy[tidy["run"] == f"seed{k}"]
        for n in names:
            o = t[t["objective"] == n]
            if o.empty:
                raise ValueError(f"{root}/seed{k}: no rows for objective {n!r}")
            m = {x: o[o["metric"] == x].sort_values("step") for x in
                 ("accuracy", "rho_prefix", "rho_trie", "tax_share", "probe_kl", "eval_accuracy")}
            end = o["step"].max()
            ev = m["eval_accuracy"]["value"]
            acc, src = heldout(root / f"seed{k}", n, ev, eval_n, exact_n)
            rows.append({"seed": k, "objective": n, "heldout_acc": acc, "heldout_source": src,
                         "heldout_sampled": float(ev.iloc[-1]) if len(ev) else float("nan"),
                         "train_acc_last5": m["accuracy"][m["accuracy"]["step"] > end - last]["value"].mean(),
                         "rho_prefix": m["rho_prefix"]["value"].mean(),
                         "rho_trie": m["rho_trie"]["value"].mean(),
                         "tax_share": m["tax_share"]["value"].mean(),
                         "probe_kl": m["probe_kl"]["value"].iloc[-last:].mean(),
                         "tokens": float(o["tokens"].max()),
                         "opt_steps": int(end + 1)})
    return pd.DataFrame(rows)


def paired_table(wide: pd.DataFrame, labels: dict, base: str = "gspo") -> pd.DataFrame:
    """Markdown-ready rows per objective: accuracies as mean [95 % t interval] over seeds, the
    paired difference to `base` (same seeds: same start, same prompts) with its 95 % paired t
    interval and p-value (gradlab.stats.paired_interval), and the MEASURED means."""
    from gradlab.stats import paired_interval

    b = wide[wide["objective"] == base].set_index("seed")
    rows = []
    for n in labels:
        o = wide[wide["objective"] == n].set_index("seed").loc[b.index]
        row = {"variant": labels[n], "objective": n, "seeds": len(o)}
        for col, name in (("heldout_acc", "held-out"), ("train_acc_last5", "train, last 5")):
            row[f"{name} acc. (%)"] = fmt_ci(*mean_ci(o[col]))
            ok = n != base and len(o) >= 2
            row[f"{name} − {base} (points)"] = fmt_diff(
                paired_interval(100 * o[col], 100 * b[col])) if ok else "—"
        row.update({"ρ prefix": f"{o['rho_prefix'].mean():.2g}", "ρ trie": f"{o['rho_trie'].mean():.2g}",
                    "tax share": f"{o['tax_share'].mean():.2g}",
                    "drift (KL, nats)": f"{o['probe_kl'].mean():.2g}",
                    "tokens": f"{o['tokens'].mean():.0f}"})
        rows.append(row)
    return pd.DataFrame(rows)


def write_meta(path: Path, prov: dict, **extra) -> dict:
    """A JSON file beside a figure's data: provenance (commit, threads, command; take it with
    `provenance` when the script starts) and extra. Strict JSON (`gradlab.jsonio`)."""
    meta = {"provenance": prov, **extra}
    path.write_text(jsonio.dumps(meta, indent=1, default=str))
    return meta
