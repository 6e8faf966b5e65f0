"""Resume, exact about its configuration (docs/reliability.md).

- `gradlab tandem --out DIR --resume` alone continues DIR with DIR/config.json: options not
  typed are the stored ones (`with_stored_config`).
- A typed option that differs from the stored one is refused with the list of differences
  (`config_differences`, checked by the run store for the CLI and the Python API alike), except
  those that cannot change a result: `RESUMABLE_CHANGES` (more --steps extend the run; they are
  applied and recorded in config.json; fewer --steps than the run holds are refused, so
  config.json never disagrees with the metrics). Nothing is silently ignored.
- A folder without a checkpoint (killed before its first one) restarts from step 0 under
  --resume (`restore`).
- `--resume auto` resumes when the folder holds a run and starts fresh when it does not; a job
  that torchrun restarted (`--max-restarts N`, TORCHELASTIC_RESTART_COUNT > 0) does the same
  by itself, so a restarted job continues from the last checkpoint (`resolve_resume`).
- `gradlab reproduce` run again on a finished run re-makes its figures and summary; on a
  partial run it says exactly what to type (`run_status`, `reproduce_action`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from dataclasses import fields
from pathlib import Path

from ... import jsonio
from ..config import ConfigError, RunConfig, check_types, current_form


class CorruptFileError(ValueError):
    """A run file that cannot be read: the message names the path and what to do."""


RESUMABLE_CHANGES = ("out", "steps", "progress", "log", "ckpt_every")
log = logging.getLogger("gradlab")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def config_differences(stored: dict, given: dict) -> list[str]:
    """'--opt: stored S, given G' for every RunConfig option that differs (JSON-normalised),
    except `RESUMABLE_CHANGES`; options missing from an older config.json are not compared."""
    norm = lambda v: jsonio.loads(jsonio.dumps(v, sort_keys=True))  # noqa: E731  tuples → lists
    out = []
    for k in sorted(set(stored) & set(given)):
        if k not in RESUMABLE_CHANGES and norm(stored[k]) != norm(given[k]):
            out.append(f"{_flag(k)}: stored {stored[k]!r}, given {given[k]!r}")
    return out


def check_resume_config(path: Path, stored: dict, given: dict) -> None:
    """Raise ConfigError (one line) listing the differences between a run's stored
    configuration and the one it is resumed with."""
    diff = config_differences(stored, given)
    if diff:
        raise ConfigError(f"--resume: {path} was made with other options ({'; '.join(diff)}); "
                          "omit them to use the stored ones, or choose another --out")
    steps = int(given.get("steps", 0))
    if steps < int(stored.get("steps", 0)):
        # a partial run may be resumed to fewer steps than it planned (config.json records the
        # new total), never to fewer than it has done: its records would disagree with its data
        done = (run_status(path) or (0, 0))[0]
        if steps < done:
            raise ConfigError(f"--resume: {path} holds {done} steps done of {stored['steps']}; "
                              f"--steps {steps} is fewer (a run cannot be shortened: its "
                              "config.json would disagree with its metrics); omit --steps, or "
                              "choose another --out")


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """RunConfig option names typed in `argv` (a sub-command of `parser`): the same argv parsed
    again with every default suppressed (abbreviations and --no-x forms included)."""
    for act in parser._actions:  # the sub-command parsers
        for sub in getattr(act, "choices", None) or {}:
            for a in act.choices[sub]._actions:
                if a.dest != "help":
                    a.default = argparse.SUPPRESS
    typed = set(vars(parser.parse_args(argv)))
    if "objective" in typed:  # `gradlab run OBJ`
        typed.add("objectives")
    return typed & {f.name for f in fields(RunConfig)}


def with_stored_config(cfg: RunConfig, typed: set[str]) -> RunConfig:
    """For --resume: the stored DIR/config.json with the typed options on top (no config.json
    yet: `cfg` as given). Differences are refused later, by the run store."""
    path = Path(cfg.out) / "config.json"
    if not path.is_file():
        return cfg
    stored = read_config(path)
    check_types(stored, str(path))  # a hand-edited "lr": "0.0002": one line naming it
    known = {f.name for f in fields(RunConfig)}
    kw = {k: v for k, v in stored.items() if k in known}
    kw.update({k: getattr(cfg, k) for k in typed | {"out"}})
    return RunConfig(**kw)


def read_config(path: Path) -> dict:
    """DIR/config.json as a dict; a corrupt file is a one-line error naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is corrupt ({e}); restore it or start a new run in "
                          "another --out") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is corrupt (not a JSON object); restore it or start a new run")
    return current_form(data, str(path))  # a flat 0.1 file: its measuring flags as a spec


def resolve_resume(resume: bool | str, out: str | Path, D) -> bool:
    """Whether to resume run folder `out`: `resume` True/False as given; "auto" (or any run
    restarted by torchrun) when it holds a run (metrics.jsonl or checkpoints). Under torchrun
    rank 0 looks and every rank takes its answer (a collective), so all ranks agree."""
    from ..scale.dist import restart_count

    if resume != "auto" and (resume or restart_count() == 0):
        return bool(resume)
    out = Path(out)
    have = (out / "metrics.jsonl").exists() or (out / "checkpoints").is_dir()
    if D.enabled:
        have = D.gather(have)[0]
    if have and restart_count() and D.main:
        log.warning("gradlab: restart %d of this torchrun job: resuming %s", restart_count(), out)
    return bool(have)


def restore(store, learners: list, D) -> int:
    """Restore every learner from its checkpoint and drop metrics written after it; returns
    the step to continue from. No checkpoint at all: start over from step 0."""
    store.recover_checkpoints()  # a crash between the renames of a checkpoint swap
    D.barrier()
    have = [(store.path / "checkpoints" / L.name / "state.json").exists() for L in learners]
    if any(have) and not all(have):  # killed while saving the first checkpoints
        raise CorruptFileError(
            f"{store.path} has checkpoints for some objectives only (a crash while saving "
            f"them); delete {store.path / 'checkpoints'} to start the run over with --resume")
    if not any(have):
        log.warning("gradlab: no checkpoint in %s: starting from step 0", store.path)
        D.barrier()
        store.truncate_after(-1)
        return 0
    steps = []
    for L in learners:
        state, extra = store.load_checkpoint(L.name, L.model, L.opt)
        L.gen.set_state(extra["gen"])
        L.tokens = state["tokens"]
        steps.append(state["step"])
    if len(set(steps)) != 1:  # killed between two objectives' checkpoint saves
        raise CorruptFileError(
            f"checkpoints of {store.path} are at different steps "
            f"{dict(zip([L.name for L in learners], steps))} (a crash while saving them); "
            f"delete {store.path / 'checkpoints'} to start the run over with --resume")
    D.barrier()  # every rank has read the files before rank 0 rewrites the metrics
    store.truncate_after(steps[0] - 1)
    return steps[0]


def run_status(path: str | Path) -> tuple[int, int] | None:
    """(steps checkpointed by every objective, steps configured) of run folder `path`, or None
    when it holds no run (no metrics.jsonl). An unreadable checkpoint state.json counts as no
    checkpoint, with a warning naming it (resuming then refuses it, naming what to do)."""
    path = Path(path)
    if not (path / "metrics.jsonl").exists() or not (path / "config.json").is_file():
        return None
    cfg = read_config(path / "config.json")
    names = list(cfg.get("objectives", []))
    done = []
    for name in names if cfg.get("mode", "tandem") == "tandem" else names[:1]:
        st = path / "checkpoints" / _label(name) / "state.json"
        try:
            done.append(int(json.loads(st.read_text())["step"]) if st.exists() else 0)
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
            log.warning("%s: not a readable checkpoint state (%s: %s); counted as no checkpoint",
                        st, type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
            done.append(0)
    return (min(done) if done else 0), int(cfg.get("steps", 0))


def _label(spec) -> str:
    """The checkpoint folder of objective `spec` (a user loss's is its label)."""
    from ...core.variants import label

    try:
        return label(str(spec))
    except ValueError:
        return str(spec)


def reproduce_action(cfg: RunConfig, resume: bool) -> str:
    """What `gradlab reproduce` does with folder cfg.out: "train" or "redraw" (a finished run
    with the same options); a partial run without --resume raises ConfigError saying what to
    type, a different finished run the list of differences."""
    status = None if resume else run_status(cfg.out)
    if status is None:
        return "train"
    done, total = status
    diff = config_differences(read_config(Path(cfg.out) / "config.json"), cfg.to_json())
    if diff:
        raise ConfigError(f"--out {cfg.out} already holds a different run ({'; '.join(diff)}); "
                          "choose another --out")
    if done >= total:
        if cfg.steps == total:
            return "redraw"
        if cfg.steps < total:
            raise ConfigError(f"--out {cfg.out} holds a finished run of {total} steps, longer "
                              f"than --steps {cfg.steps} (a run cannot be shortened): choose "
                              f"another --out, or --steps {total} to re-make its figures")
        raise ConfigError(f"--out {cfg.out} holds a finished run of {total} steps: type "
                          f"`gradlab reproduce --out {shlex.quote(cfg.out)} --steps {cfg.steps} "
                          "--resume` to extend it")
    raise ConfigError(f"--out {cfg.out} holds a partial run (checkpointed {done} of {total} "
                      f"steps): type `gradlab reproduce --out {shlex.quote(cfg.out)} --resume` "
                      "to continue it")
