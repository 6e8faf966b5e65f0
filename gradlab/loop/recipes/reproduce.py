"""The main job: the default tandem on the built-in task, its figures and a summary table."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from ... import jsonio
from ... import viz as plots
from ...atomic import write_file, writing
from ..config import ConfigError, RunConfig
from ..runs.lock import acquire
from ..runs.resume import reproduce_action
from ..runs.store import load_run
from ..train import train

SUMMARY_METRICS = ["accuracy", "reward", "rho_prefix", "rho_trie", "shared_frac_prefix",
                   "tax_share", "probe_kl", "entropy", "logodds_abs", "w_dev"]


def summarize(tidy: pd.DataFrame, last: int = 5) -> pd.DataFrame:
    """Per objective: first-step and last-`last`-steps training accuracy, held-out accuracy at
    the last evaluation (sampled and greedy, when evaluated), means of the diagnostics, tokens
    consumed and seconds per rollout step (median)."""
    wide = tidy.pivot_table(index=["objective", "seed", "step"], columns="metric",
                            values="value").reset_index()
    rows = []
    for obj, d in wide.groupby("objective", sort=False):
        d = d.sort_values("step")
        tail = d[d["step"] > d["step"].max() - last]
        row = {"objective": obj, "acc_first": d["accuracy"].iloc[0],
               f"acc_last{last}": tail["accuracy"].mean()}
        for m in ("eval_accuracy", "eval_accuracy_greedy", "eval_accuracy_expected"):  # held-out
            if m in d and d[m].notna().any():
                row[f"{m}_final"] = d[m].dropna().iloc[-1]
        for m in SUMMARY_METRICS[1:]:
            if m in d:
                row[m] = d[m].mean()
        row["tokens"] = tidy[tidy["objective"] == obj]["tokens"].max()
        for t in ("time_step", "time_rollout", "time_update", "time_probes"):
            if t in d:
                row[f"{t}_s"] = d[t].median()
        rows.append(row)
    return pd.DataFrame(rows)


def reproduce(cfg: RunConfig, resume: bool = False) -> str:
    """Train, draw, summarise; returns the summary as markdown (also in <out>/summary.md).

    Run again on a finished run with the same options it re-makes the figures and summary
    without training; a partial run needs resume=True (the error says what to type).
    """
    action = reproduce_action(cfg, resume)  # loop/runs/resume.py
    t0 = time.time()
    if action == "train":
        train(cfg, resume=resume)
    t_train = time.time() - t0
    path = Path(cfg.out)
    lock = acquire(path)  # the figures and summary are written by the folder's one writer
    try:
        tidy = load_run(path)
        if action == "redraw":
            t_train = float(tidy.loc[tidy["metric"] == "time_step", "value"].sum())
        text = _write(cfg, tidy, path, t_train, action)
    finally:
        lock.release()
    return text


def _write(cfg: RunConfig, tidy: pd.DataFrame, path: Path, t_train: float, action: str) -> str:
    png = path / "figures" / "training_curves.png"
    with writing(png):  # a full disk: exit code 4 naming the file (gradlab/atomic.py)
        plots.save(plots.training_curves(tidy, smooth=3), png)
    table = summarize(tidy)
    took = (f"training took {t_train:.0f} s" if action == "train" else
            f"training took {t_train:.0f} s (recorded step times; figures re-made from the "
            "stored run)")
    md = ["# gradlab reproduce — summary", "",
          f"{cfg.steps} rollout steps × {cfg.prompts} prompts × G={cfg.G}, "
          f"{cfg.minibatches} optimizer steps per rollout, seed {cfg.seed}, task {cfg.task}"
          f" (difficulty {cfg.difficulty}); {took}.", "",
          markdown_table(shown(table)), "",
          "Accuracies in percent: acc_first (the first step), acc_last5 (the last 5 steps; the "
          "end-of-run table's reward on this task), eval_* (held-out, the last evaluation); "
          "other columns are means over the run's steps. —: undefined (no finite value at any "
          "step, e.g. a ratio whose denominator was 0) or not measured.", "",
          "Figures: figures/training_curves.png. Metrics: metrics.jsonl (gradlab.load_run)."]
    text = "\n".join(md)
    write_file(path / "summary.md", text + "\n")
    return text


def shown(table: pd.DataFrame) -> pd.DataFrame:
    """`summarize`'s frame as summary.md prints it: accuracies in percent (as the end-of-run
    table and `gradlab eval`), the run-mean reward named as such."""
    acc = [c for c in table.columns if c.startswith(("acc_", "eval_accuracy"))]
    out = table.copy()
    out[acc] = 100 * out[acc]
    return out.rename(columns={**{c: f"{c} (%)" for c in acc}, "reward": "reward (run mean)"})


def markdown_table(df: pd.DataFrame) -> str:
    """A frame as a Markdown table, numbers to 3 significant digits and NaN as "—"."""
    from .reference import fmt

    cells = df.astype(object).map(lambda v: fmt(v) if isinstance(v, (float, int)) and
                                  not isinstance(v, bool) else str(v))
    return cells.to_markdown(index=False, disable_numparse=True)


# ---- `gradlab reproduce --check` and `--save-reference` -------------------------------------

# options a check may set itself over a saved reference's: where the runs go and how they show
# progress (they cannot change a number), and the thread count (part of the fingerprint: another
# count is another machine, compared statistically)
CHECK_OVERRIDES = ("out", "progress", "log", "threads")
NOT_COMPARED = ("out", "progress", "log", "ckpt_every", "threads", "seed")


def seed_folder(out: str, seed: int, first: int) -> str:
    """The run folder of `seed` in a several-seed check: `out` for the first, out-seed{s} else."""
    return out if seed == first else f"{out}-seed{seed}"


def reference_folder(path: str | Path) -> str:
    """Where `--save-reference FILE` trains when --out is not typed: beside FILE, named after
    it (ref.json → ref.runs, and ref.runs-seed1 … for further seeds), apart from the main job's
    runs/reproduce."""
    return str(Path(path).with_suffix(".runs"))


def set_aside(out: Path) -> Path:
    """Rename run folder `out` to the first free `<out>.prev-N` (N = 1, 2, …) and return it:
    an old run is kept, never replaced."""
    n = 1
    while out.with_name(f"{out.name}.prev-{n}").exists():
        n += 1
    prev = out.with_name(f"{out.name}.prev-{n}")
    out.rename(prev)
    return prev


def prepare_folder(cfg: RunConfig, fresh: bool) -> str:
    """Before a check or reference run in cfg.out: a finished run of this code (gradlab's and
    the user's files, `gradlab.provenance.same_code`) with these options is reused (the returned
    note says so); a run made by other code, a run of another length, or any run with `fresh`,
    is moved to the first free <out>.prev-N (nothing is deleted; the note names it) and trained
    afresh. A run with other options, a partial run of this code or a folder in use is refused
    (one line)."""
    from ... import provenance
    from ..runs.resume import config_differences, read_config, run_status

    out = Path(cfg.out)
    status = run_status(out)
    if status is None:
        return ""
    stored = read_config(out / "config.json")
    diff = config_differences(stored, cfg.to_json())
    if diff:
        raise ConfigError(f"--out {out} already holds a different run ({'; '.join(diff)}); "
                          "choose another --out")
    code = provenance.code_hash()
    segs = (provenance.read(out) or {}).get("segments", [])
    files = provenance.changed_files(segs, provenance.user_files(cfg.to_json()))
    other_steps = status[1] != cfg.steps
    if provenance.same_code(out) and not fresh and not other_steps:
        reproduce_action(cfg, False)  # a partial run: what to type
        return f"reused {out}: a finished run of this code ({code}), not re-trained (--fresh re-trains)"
    made = ",".join(dict.fromkeys(s.get("code_hash", "?") for s in segs)) or "unrecorded code"
    acquire(out).release()  # a folder that a live process is writing is refused, not moved
    prev = set_aside(out)
    if made != code:
        why = f"made by other code ({made}; this is {code})"
    elif files:
        why = f"made with other user files ({'; '.join(files)})"
    elif other_steps:
        why = f"of {status[1]} steps (this is {cfg.steps})"
    else:
        why = "(--fresh)"
    return f"{out} held a run {why}: moved to {prev}, trained afresh"


def run_seeds(cfg: RunConfig, seeds: list[int], fresh: bool, say=print) -> list[Path]:
    """Train (or reuse, see `prepare_folder`) the main job at each seed; returns the folders."""
    folders = []
    for s in seeds:
        c = replace(cfg, seed=s, out=seed_folder(cfg.out, s, seeds[0]))
        note = prepare_folder(c, fresh)
        t0 = time.time()
        reproduce(c)
        say(note or f"trained {c.out} (seed {s}) in {time.time() - t0:.0f} s")
        folders.append(Path(c.out))
    return folders


def save_reference(cfg: RunConfig, typed: set[str], path: str | Path, k: int, fresh: bool,
                   say=print) -> dict:
    """`--save-reference FILE`: run seeds cfg.seed … cfg.seed + k − 1 and write this machine's
    reference (config, typed options, per-seed fingerprint, summary and series) to `path`."""
    from ... import provenance
    from .baseline import run_record
    from .reference import numbers_of

    seeds = list(range(cfg.seed, cfg.seed + k))
    folders = run_seeds(cfg, seeds, fresh, say)
    summaries = [summarize(load_run(f)) for f in folders]
    runs = [run_record(f, s) for f, s in zip(folders, summaries)]
    ref = {"gradlab_reference": 2, "config": {**cfg.to_json(), "seed": seeds[0]},
           "typed": sorted(typed - {"seed"}), "seeds": seeds,
           "fingerprint": runs[0]["fingerprint"], "code_hash": provenance.code_hash(),
           "user_files": provenance.user_files(cfg.to_json()),
           "commit": provenance.git_state()["commit"], "runs": runs,
           "numbers": numbers_of(summaries)}
    write_file(Path(path), jsonio.dumps(ref) + "\n")  # strict: undefined is null + its reason
    fp = ref["fingerprint"]
    files = "".join(f", {f} {h}" for f, h in ref["user_files"].items())
    say(f"wrote {path}: {k} seed(s) {seeds} of this configuration on {fp['cpu_model']}, torch "
        f"{fp['torch']}, {fp['threads']} thread(s), code {ref['code_hash']}{files}; runs in "
        f"{', '.join(map(str, folders))}")
    if k == 1:
        say("one seed: --check compares it exactly on this CPU model, torch build and thread "
            "count; a check elsewhere needs a reference of ≥ 2 seeds (--seeds 3)")
    return ref


def check_config(cfg: RunConfig, typed: set[str], ref: dict,
                 overrides: tuple[str, ...] = CHECK_OVERRIDES) -> tuple[RunConfig, list[str]]:
    """The configuration a saved reference is checked at: the options typed when it was saved,
    over the current defaults, with `CHECK_OVERRIDES` typed now on top (out: the reference's
    unless typed). Returns it and one line per other option whose current default differs from
    the reference's value (a changed default is a change). Another option typed now that
    differs from the reference is refused."""
    stored, then = ref["config"], set(ref.get("typed", []))
    now = cfg.to_json()
    norm = lambda v: json.loads(json.dumps(v, sort_keys=True))  # noqa: E731  tuples → lists
    clash = [f"--{k.replace('_', '-')} {now[k]!r} (the reference: {stored.get(k)!r})"
             for k in sorted(typed - set(overrides)) if norm(now[k]) != norm(stored.get(k))]
    if clash:
        raise ConfigError(f"--check: a reference is checked at its own configuration; "
                          f"typed: {', '.join(clash)} (only {', '.join(overrides)} may be set)")
    kw = dict(now)
    kw.update({k: stored[k] for k in then | {"seed"} if k in stored and k in now
               and not (k in typed and k in overrides)})
    if "out" not in typed:
        kw["out"] = stored.get("out", now["out"])
    defaults = [f"--{k.replace('_', '-')}: {stored[k]!r} → {kw[k]!r}" for k in sorted(stored)
                if k in kw and k not in then and k not in NOT_COMPARED
                and norm(stored[k]) != norm(kw[k])]
    return RunConfig(**kw), defaults


def check_seeds(cfg: RunConfig, ref: dict, k: int | None) -> list[int]:
    """The seeds a check runs: the shipped reference, cfg.seed … + k − 1 (k default 1); a saved
    one, its first k seeds (default all). Too many is refused before any work."""
    if ref["gradlab_reference"] == 1:
        return list(range(cfg.seed, cfg.seed + (k or 1)))
    n = len(ref["seeds"])
    if k is not None and k > n:
        raise ConfigError(f"--seeds: {k} but the reference holds {n} seed(s) {ref['seeds']}; "
                          f"give at most {n}")
    return list(ref["seeds"][: k or n])


def check_against(cfg: RunConfig, typed: set[str], ref: dict, k: int | None, fresh: bool,
                  say=print) -> int:
    """`gradlab reproduce --check`: run the check seeds and compare them with `ref` (exactly on
    the reference's machine fingerprint, else statistically); prints the report; returns the
    exit code (0 identical / nothing flagged, 1 otherwise)."""
    from .baseline import fingerprint
    from .reference import stat_check, stat_report

    defaults: list[str] = []
    if ref["gradlab_reference"] == 2:
        cfg, defaults = check_config(cfg, typed, ref)
    elif "config" in ref:  # the shipped reference: the main job's options, any seed
        seed = cfg.seed
        cfg, defaults = check_config(cfg, typed, {**ref, "typed": []},
                                     CHECK_OVERRIDES + ("seed",))
        cfg = replace(cfg, seed=seed, out=cfg.out if "out" in typed else "runs/reproduce")
    seeds = check_seeds(cfg, ref, k)
    if ref["gradlab_reference"] == 2 and len(ref["seeds"]) < 2:  # before any work
        gap = _machine_gap(ref["runs"][0]["fingerprint"], _this_machine(cfg))
        if gap:
            raise ConfigError(_one_seed_elsewhere(ref, gap))
    folders = run_seeds(replace(cfg, seed=seeds[0]), seeds, fresh, say)
    summaries = [summarize(load_run(f)) for f in folders]
    if ref["gradlab_reference"] == 2:
        code = _code_line(ref, folders)
        say(code)
        for line in defaults:
            say(f"default changed since the reference: {line}")
        exact = _exact_if_same_machine(ref, seeds, folders, summaries, say)
        if exact is not None:
            return 1 if exact or defaults else 0
        if len(ref["seeds"]) < 2:  # the run's own fingerprint differs from the one foreseen
            say(_one_seed_elsewhere(ref, _machine_gap(ref["fingerprint"],
                                                      fingerprint(folders[0]))))
            return 1
    values: dict[str, list[float]] = {}
    for s in summaries:
        for obj, row in s.set_index("objective").iterrows():
            for metric, v in row.items():
                values.setdefault(f"{obj}/{metric}", []).append(float(v))
    for line in defaults if ref["gradlab_reference"] == 1 else []:
        say(f"default changed since the reference: {line}")
    rows = stat_check(values, ref)
    why = (" against the shipped reference (another machine)" if ref["gradlab_reference"] == 1
           else " (fallback: another machine than the reference's: "
           f"{_machine_gap(ref['fingerprint'], fingerprint(folders[0]))})")
    say(stat_report(rows, ref, why))
    untested = rows["t"].isna() & (rows["test"] == "t") & ~rows["flagged"] & \
        (rows["reason"] != "no seed spread: compared exactly")
    return 1 if rows["flagged"].any() or untested.any() or defaults else 0


def _code_line(ref: dict, folders: list[Path]) -> str:
    """Whether gradlab's code and the user's files (where the reference records them) are the
    reference's, naming each file that changed."""
    from ... import provenance
    from .baseline import fingerprint

    now = ",".join(dict.fromkeys(fingerprint(f)["code_hash"] for f in folders))
    line = (f"code: the reference's ({now})" if now == ref["code_hash"] else
            f"code changed since the reference: {ref['code_hash']} → {now}")
    if "user_files" not in ref:
        return line
    segs = [{"user_files": ref["user_files"]}]
    files = provenance.changed_files(segs, fingerprint(folders[0])["user_files"])
    if files:
        return line + "\nuser files changed since the reference: " + "; ".join(files)
    if ref["user_files"]:
        return line + "; user files: the reference's (" + ", ".join(ref["user_files"]) + ")"
    return line


def _machine_gap(a: dict, b: dict) -> str:
    """'key a → b' for each fingerprint entry that differs ("" on the same machine)."""
    from .baseline import FINGERPRINT

    return "; ".join(f"{k} {a.get(k)!r} → {b.get(k)!r}" for k in FINGERPRINT
                     if a.get(k) != b.get(k))


def _this_machine(cfg: RunConfig) -> dict:
    """The fingerprint a run of `cfg` gets here (its provenance records the same keys)."""
    import torch

    from ... import provenance

    return {"cpu_model": provenance.cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": cfg.threads}


def _one_seed_elsewhere(ref: dict, gap: str) -> str:
    """One line: a one-seed reference is compared exactly on its own machine only, and what to
    run for a statistical check here."""
    typed = [k for k in ref.get("typed", []) if k not in ("out", "progress", "log")]
    opts = "".join(f" {_option(k, ref['config'][k])}" for k in typed if k in ref["config"])
    return (f"--check: the reference has 1 seed, compared exactly only on its own machine, and "
            f"this is another ({gap}); a statistical check needs a reference of ≥ 2 seeds: "
            f"`gradlab reproduce{opts} --seeds 3 --save-reference FILE` on the reference's "
            "code, then --check FILE")


def _option(key: str, value) -> str:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + key.replace("_", "-")
    if isinstance(value, list):
        value = ",".join(map(str, value))
    return f"{flag} {shlex.quote(str(value))}"


def _exact_if_same_machine(ref: dict, seeds: list[int], folders: list[Path],
                           summaries: list[pd.DataFrame], say) -> bool | None:
    """On the reference's fingerprint: print the exact comparison and return whether anything
    changed; on another machine None (the caller compares statistically)."""
    from .baseline import (
        compare_numbers,
        compare_series,
        exact_report,
        fingerprint,
        same_machine,
        series,
        summary_numbers,
    )

    index = {s: i for i, s in enumerate(ref["seeds"])}
    if not all(same_machine(fingerprint(f), ref["runs"][index[s]]["fingerprint"])
               for s, f in zip(seeds, folders)):
        return None
    numbers, changed = [], []
    for s, f, summ in zip(seeds, folders, summaries):
        i = index[s]
        numbers += [{**r, "seed": s} for r in compare_numbers(ref, i, summary_numbers(summ))]
        changed += [{**r, "seed": s} for r in compare_series(ref, i, series(load_run(f)))]
    say(exact_report(numbers, changed, seeds))
    return bool(numbers or changed)
