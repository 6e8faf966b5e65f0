"""The `gradlab` command: run, tandem, reproduce, table, view, variance, check, audit, doctor.

Options of run/tandem/reproduce are the fields of `RunConfig` (`gradlab tandem --help`).
Every sub-command checks its arguments before any work: a mistake is one line naming the
option and its valid values, exit code 2. Options are never abbreviated (`--step` is refused,
not read as `--steps`). Exit codes: 0 ok, 1 a check failed (check, doctor), 2 bad arguments,
3 non-finite, 4 write failure, 130 / 143 stopped by a signal after checkpointing (the table:
gradlab/loop/faults/exitcodes.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path

# torch-free imports only: `gradlab --help`, `--version` and argument errors never load torch
from ..core.variants import split_top
from ..loop.config import ConfigError, RunConfig, check_types
from ..loop.runs.resume import given_options, read_config, with_stored_config
from .args import (
    Parser,
    _audit_args,
    _doctor_args,
    _eval_args,
    _table_args,
    _variance_args,
    _view_args,
    add_check_arg,
    failure_code,
    load_check_reference,
    regression_check_options,
)
from .help import HELP  # noqa: E402  (every run option's --help text)

# run/tandem/reproduce defaults that differ from RunConfig's (none at present)
CLI_DEFAULTS: dict = {}


Command = tuple[str, Callable[[Parser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {}  # name → (help, add_args, run), in --help order


def command(name: str, help: str, add_args: Callable[[Parser], None] = lambda p: None):
    """Register sub-command `name`: add_args(parser) declares its options, the decorated
    function runs it (import heavy modules inside it, never at module level)."""
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (help, add_args, fn)
        return fn
    return register


def _add_config_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    defaults = {**CLI_DEFAULTS, **(defaults or {})}
    for f in fields(RunConfig):
        default = defaults.get(f.name, f.default if f.default is not MISSING else f.default_factory())
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=HELP.get(f.name))
        elif f.name in ("objectives", "objective_params"):
            p.add_argument(flag, default=None, help=HELP.get(f.name))
        else:
            typ = float if isinstance(default, float) else int if isinstance(default, int) else str
            typ = int if f.name in ("max_new_tokens", "micro_batch", "max_prompt_len") else typ  # Optional[int]
            p.add_argument(flag, type=typ, default=default, help=HELP.get(f.name, "") + f" (default {default})")
    p.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_arg,
                   metavar="auto", help="continue from the last checkpoint; --resume auto: "
                   "continue if --out holds a run, else start it (torchrun restarts do this)")


def _run_args(p: Parser) -> None:
    p.add_argument("objective", help="objective name (gradlab.core.objectives.names())")
    _add_config_args(p)


def config_from_args(a: argparse.Namespace, objectives: list[str] | None = None) -> RunConfig:
    kw = {f.name: getattr(a, f.name) for f in fields(RunConfig) if hasattr(a, f.name)}
    if a.objectives and objectives:
        raise ConfigError(f"--objectives: `gradlab run` trains the one objective it is given "
                          f"({objectives[0]!r}); several side by side: gradlab tandem --objectives")
    if a.objectives:
        try:  # commas inside name[k=v, ...] brackets do not split
            kw["objectives"] = split_top(a.objectives)
        except ValueError as e:
            raise ConfigError(f"--objectives: {e}") from None
    elif objectives:
        kw["objectives"] = objectives
    else:
        kw.pop("objectives")
    if a.objective_params:
        try:
            kw["objective_params"] = json.loads(a.objective_params)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--objective-params: not valid JSON ({e})") from None
        params = kw["objective_params"]
        if not (isinstance(params, dict) and all(isinstance(v, dict) for v in params.values())):
            raise ConfigError("--objective-params: must be a JSON object of objective → "
                              'parameters, e.g. \'{"gspo": {"eps": [0.0003, 0.0004]}}\'')
    else:
        kw.pop("objective_params")
    try:
        return RunConfig(**kw)
    except ConfigError as e:  # `gradlab run NAME`: the mistake is in NAME, not in an option
        head = "--objectives: "
        if objectives and not a.objectives and str(e).startswith(head):
            raise ConfigError(f"argument objective: {str(e)[len(head):]}") from None
        raise


def _checked_config(a: argparse.Namespace) -> RunConfig:
    """RunConfig from the options (validated), the task file, the device and --model checked:
    before any work, torch-free up to the device and model checks."""
    from .args import check_context, check_device, check_model, check_policy, check_task_file

    check_task_file(a.task)  # a bad line is the first thing to fix, before the other options
    if not a.resume:  # a resumed run's model and length are the stored ones: checked below
        check_context(a.max_new_tokens, a.model)  # before the objectives are built (torch)
    stored = Path(a.out) / "config.json"
    if a.resume and stored.is_file():  # a hand-edited file: named before anything is built
        check_types(read_config(stored), str(stored))
    cfg = config_from_args(a, [a.objective] if getattr(a, "objective", None) else None)
    if a.resume:  # options not typed are the stored ones (loop/runs/resume.py)
        cfg = with_stored_config(cfg, given_options(build_parser(), a.argv))
    check_context(cfg.max_new_tokens, cfg.model)
    check_device(cfg.device)
    check_model(cfg.model, cfg.trust_remote_code)
    check_policy(cfg.task, cfg.difficulty, cfg.model)  # a shipped file missing from the install
    return cfg


def _stop_signals(a: argparse.Namespace) -> None:
    """The program (not main([...]) in a notebook or test) ignores a late signal once stopped:
    only the exit is left. Set after the checks, where torch loads anyway."""
    from ..loop.faults.preempt import StopSignals

    StopSignals.ignore_after_stop = getattr(a, "program", False)


@command("run", "train one objective", _run_args)
def cmd_train(a: argparse.Namespace) -> int:
    cfg = _checked_config(a)  # before the heavy imports: a mistake is answered at once
    if not a.resume and (Path(cfg.out) / "metrics.jsonl").is_file():  # a re-run: said at once
        from ..loop.scale.dist import restart_count

        if restart_count() == 0:  # (a job torchrun restarted resumes by itself)
            raise ConfigError(f"--out {cfg.out} already holds a run: pass --resume to continue "
                              "it, or choose another --out")
    from ..loop.train import train
    from ..viz.summary import write_run_summary

    _stop_signals(a)

    store = train(cfg, resume=a.resume)
    if not store.write:  # a data-parallel rank other than 0: rank 0 writes and reports
        return 0
    print(write_run_summary(store.path, cfg))
    print(f"run folder: {store.path}  (summary.md; gradlab view {shlex.quote(str(store.path))}; "
          "gradlab.load_run)")  # quoted: the hint pastes as one command
    return 0


command("tandem", "train several objectives side by side from one start", _add_config_args)(cmd_train)


def _reproduce_args(p: Parser) -> None:
    _add_config_args(p, {"out": "runs/reproduce"})
    add_check_arg(p)


@command("reproduce", "the main job: default tandem + figures + summary", _reproduce_args)
def cmd_reproduce(a: argparse.Namespace) -> int:
    cfg = _checked_config(a)  # before the heavy imports: a mistake is answered at once
    ref = load_check_reference(a)  # a bad file or option: refused before any work
    from ..loop.recipes.reproduce import reproduce
    from ..viz.summary import run_table

    _stop_signals(a)

    if ref is not None or a.save_reference:  # loop/recipes/reproduce.py
        from dataclasses import replace

        from ..loop.recipes.reproduce import check_against, reference_folder, save_reference

        typed = given_options(build_parser(), a.argv)
        if ref is not None:
            return check_against(cfg, typed, ref, a.seeds, a.fresh)
        if "out" not in typed:  # a reference's runs live beside it, apart from runs/reproduce
            cfg = replace(cfg, out=reference_folder(a.save_reference))
        save_reference(cfg, typed, a.save_reference, a.seeds or 1, a.fresh)
        return 0
    t0 = time.time()
    reproduce(cfg, resume=a.resume)  # the full summary: OUT/summary.md
    print(run_table(cfg.out))
    print(f"done in {time.time() - t0:.0f} s; run folder: {cfg.out} (summary.md, figures/)")
    return 0


@command("eval", "score a run, a checkpoint or a model on the held-out set: greedy, sampled and "
         "the exact expected accuracy", _eval_args)
def cmd_eval(a: argparse.Namespace) -> int:
    from .args import run_eval

    return run_eval(a)


IBPO_ROWS = ["ibpo[form=la]", "ibpo[form=togo]", "ibpo[form=ga+la,base=gspo]"]


@command("table", "ρ of every objective on synthetic groups", _table_args)
def cmd_table(a: argparse.Namespace) -> int:
    """Cancellation ratio of every built-in objective on synthetic groups (no model needed)."""
    from .args import require

    require("G", a.G, a.G >= 2, "≥ 2 (a group needs two responses to compare)")
    require("seed", a.seed, a.seed >= 0, "≥ 0")
    require("off-policy", a.off_policy, 0 < a.off_policy <= 10, "in (0, 10]")
    from ..check.scenarios import random_batch
    from ..core import objectives
    from ..core.cancellation import cancellation
    from ..probes.residuals import defined_ratio
    from ..viz.undefined import NO_GRAD_SHARED, NO_NODE, Footnotes

    notes = Footnotes()  # an undefined ρ (no node, or W ≡ 0 at the nodes: IBPO's prefix) is —
    print("| objective | policy | ρ full-group | ρ trie |\n|---|---|---|---|")
    for off in (0.0, a.off_policy):
        b = random_batch(n_groups=8, G=a.G, T=16, seed=a.seed, off_policy=off)
        for name in objectives.names() + IBPO_ROWS:
            obj = objectives.get(name)
            W, pb = obj.modulation(b), obj.prepare(b)  # IBPO: its token advantages
            cells = []
            for kind in ("prefix", "trie"):
                c = cancellation(W, pb, kind)
                why = NO_NODE[kind] if c.n_nodes == 0 else NO_GRAD_SHARED
                cells.append(notes.cell(defined_ratio(c), why))
            print(f"| {name} | {'on' if off == 0 else f'off ({off})'} | {' | '.join(cells)} |")
    legend = notes.legend()
    print(f"\n{legend}" if legend else "", end="\n" if legend else "")
    return 0


@command("instruments", "what a training step can measure: instruments and presets")
def cmd_instruments(a: argparse.Namespace) -> int:
    """One line per registered instrument (what it writes, phase, needs, cost, the hosts that
    run it and why not the others) and the presets."""
    from ..instruments import PRESETS, available
    from ..instruments.host import hosts

    print("| instrument | writes | phase | needs | cost | hosts |\n|---|---|---|---|---|---|")
    for name, cls in available().items():
        ok, why = hosts(cls.needs)
        where = ", ".join(ok) + "".join(f"; not {h}: {w}" for h, w in why.items())
        print(f"| {name} | {', '.join(cls.writes) or '—'} | {cls.phase} | "
              f"{', '.join(sorted(cls.needs))} | {cls.cost} | {where} |")
    print("\npresets (@k: every k-th step; 5 = --tax-every):")
    for name, items in PRESETS.items():
        print(f"  {name}: {', '.join(f'{n}@{k}' for n, k in items) or 'nothing'}")
    return 0


@command("view", "one self-contained HTML page of a run (curves, token strips)", _view_args)
def cmd_view(a: argparse.Namespace) -> int:
    from .args import check_run_folder, require

    require("watch", a.watch, a.watch >= 0, "≥ 0 seconds (0 = write once)")
    check_run_folder(a.run, need_metrics=not a.watch)
    from ..viz.html import view, watch

    if a.watch:
        try:
            watch(a.run, a.out, a.watch)
        except KeyboardInterrupt:
            pass  # Ctrl-C ends watching; the last page is whole (written by rename)
        return 0
    print(f"wrote {view(a.run, a.out)}")
    return 0


def version() -> str:
    """The installed distribution's version (pyproject.toml), as pip reports it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gradlab")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """--version, looked up only when asked (importlib.metadata costs ~0.2 s at every start)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"gradlab {version()}")
        parser.exit(0)


@command("variance", "gradient noise of each objective at a fixed policy", _variance_args)
def cmd_variance(a: argparse.Namespace) -> int:
    """Gradient noise of each objective at a fixed policy: OUT/variance.csv, variance.png, summary.md."""
    from .args import check_variance_args

    names = check_variance_args(a)

    from ..atomic import write_file
    from ..loop.recipes.variance import measure_variance
    from ..viz.curves import save
    from ..viz.summary import variance_table
    from ..viz.variance import variance_figure

    df = measure_variance(names, task=a.task, K=a.K, reference_batches=a.reference_batches,
                          prompts=a.prompts, G=a.G, checkpoint=a.checkpoint, seed=a.seed,
                          rollout=a.rollout, threads=a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "variance.csv", index=False)
    save(variance_figure(df, f"{a.task}: K={a.K} batches, reference {a.reference_batches} "
                             f"batches of {a.prompts}×{a.G}"), out / "variance.png")
    table = variance_table(df)
    write_file(out / "summary.md", f"# gradlab variance: {a.task}, {a.rollout}\n\n{table}\n")
    print(table)
    print(f"wrote {out / 'variance.csv'}, {out / 'variance.png'} and {out / 'summary.md'}")
    return 0


@command("check", "regression check of cancellation residuals vs a baseline",
         regression_check_options)
def cmd_check(a: argparse.Namespace) -> int:
    if a.baseline and not a.update and not Path(a.baseline).is_file():  # before torch loads
        raise ConfigError(f"--baseline: {a.baseline} does not exist (--update writes a new one)")
    if a.loss:  # its form, file or module, before torch loads (loading it is core/userloss.py's)
        from .args import check_loss_spec

        check_loss_spec(a.loss)
    from ..check.run import run_checked

    return run_checked(a)


@command("audit", "audit a trainer's loss settings (gradlab audit trl | verl)", _audit_args)
def cmd_audit(a: argparse.Namespace) -> int:
    import importlib

    module = {"trl": "gradlab.integrations.audit.trl", "verl": "gradlab.integrations.audit.verl"}
    argv = (["trl"] if a.trainer == "trl" else []) + a.rest  # the TRL audit names its trainer itself
    return importlib.import_module(module[a.trainer]).main(argv)


@command("doctor", "check that gradlab works on this machine (device, bf16, W exactness, a "
         "training step); prints a Markdown report", _doctor_args)
def cmd_doctor(a: argparse.Namespace) -> int:
    from .args import check_doctor_args

    check_doctor_args(a)  # before torch loads
    from .doctor import run_doctor

    return run_doctor(a)


def build_parser() -> Parser:
    p = Parser(prog="gradlab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version, nargs=0, help="show gradlab's version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p.commands = {}
    for name, (help, add_args, fn) in COMMANDS.items():
        sp = p.commands[name] = sub.add_parser(name, help=help, description=help)
        add_args(sp)
        sp.set_defaults(fn=fn)
    return p


def _resume_arg(v: str) -> str:
    if v != "auto":
        raise argparse.ArgumentTypeError(f"invalid value {v!r}: --resume takes no value or 'auto'")
    return v


def main(argv: list[str] | None = None) -> int:
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["check", "--"]:  # `gradlab check -- --update`
        argv = ["check", *argv[2:]]
    if argv[:1] in (["check"], ["doctor"]) and {"-h", "--help"} & set(argv):
        return _long_help(argv[0], argv[1:])  # their help is their module's docstring
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra:  # named by the sub-command, whose --help lists its options
        p.commands[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv  # what was typed (--resume takes the untyped options from config.json)
    try:
        return _run(args, program)
    except ConfigError as e:  # raised by the argument checks before any work
        print(f"gradlab {args.cmd}: error: {e}", file=sys.stderr)
        return 2


LONG_HELP = {"check": "gradlab.check.run", "doctor": "gradlab.cli.doctor"}  # command → its module


def _long_help(cmd: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(LONG_HELP[cmd]).main(argv)


def _run(args: argparse.Namespace, program: bool) -> int:
    """args.fn(args), with the loop's failures as one line and their exit codes."""
    args.program = program  # read by _stop_signals
    try:
        return args.fn(args)
    except Exception as e:
        code = failure_code(e, args)
        if code is None:
            raise
        return code


if __name__ == "__main__":
    sys.exit(main())
