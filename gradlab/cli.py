"""The `gradlab` command: run, tandem, reproduce, table, view, variance, check, audit, doctor.

Options of run/tandem/reproduce are the fields of `RunConfig` (`gradlab tandem --help`).
Bad options get a one-line error naming the option and its valid values. Exit codes: 0 ok,
2 bad arguments, 3 non-finite, 4 write failure, 130 / 143 stopped by a signal after
checkpointing (the table: gradlab/loop/exitcodes.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import MISSING, fields

from .core.variants import split_top
from .loop.config import ConfigError, RunConfig
from .loop.resume import given_options, with_stored_config

HELP = {
    "out": "run folder", "objectives": "comma-separated objective names, each optionally with parameters: "
                  "'gspo,dfpo-orth[nodes=trie],gspo[eps=1e9]' (labelled by the whole string)",
    "objective_params": 'JSON, e.g. \'{"gspo": {"eps": [0.0003, 0.0004]}}\'',
    "mode": "tandem: each objective trains its own policy; same-batch: the first objective "
            "trains, the others' W and residuals are computed on its batches",
    "task": "'arithmetic', 'scaffold' (long shared preamble, large tax) or a .jsonl file of {prompt, answer}", "model": "local HF model folder",
    "steps": "rollout batches", "prompts": "prompts per rollout batch", "G": "responses per prompt",
    "minibatches": "optimizer steps per rollout batch", "split_groups": "let groups straddle steps",
    "micro_batch": "sequences per forward/backward in an optimizer step (a multiple of G; "
                   "gradient accumulation, same update; default: the whole step)",
    "fsdp": "shard the policy with FSDP2 under torchrun (≥ 2 ranks; sampling and probes "
            "gather the full weights, see docs/guides/real-models.md)",
    "amp": "bf16 autocast for every forward on any device (CPU included); float32 master "
           "weights, AdamW state, log-probs and checkpoints; FSDP2 gathers bf16, reduces fp32",
    "tax_every": "parameter-space tax and attribution every k rollout steps (0 = never)",
    "eval_every": "held-out evaluation (greedy and sampled at --temperature; keys eval_accuracy, "
                  "eval_accuracy_greedy) every k rollout steps and at the end (0 = off)",
    "eval_size": "held-out problems per evaluation (disjoint from training prompts)",
    "drift": "drift at each step's shared contexts (a small extra forward per step)",
    "trace_every": "token traces every k rollout steps (0 = none; gradlab.load_traces)",
    "trace_groups": "groups traced per traced rollout step",
    "log": "live logging while training: tensorboard and/or trackio (comma-separated)",
    "max_prompt_len": "longest prompt in tokens (longer: an error naming the prompt)",
    "chat_template": "wrap prompts in the tokenizer's chat template",
    "grad_checkpointing": "recompute activations in backward (model.gradient_checkpointing_enable)",
    "attn": "attention implementation: auto (SDPA where the architecture supports it, else "
            "eager), eager or sdpa",
    "dropout": "keep the model's dropout in training and probe forwards (default: off, so the "
               "training forward is the sampler's and the on-policy ratio is 1)",
    "verifier": "JSONL answers: exact (text after the last '=') or math (math-verify; "
                "pip install gradlab[math])",
    "on_nonfinite": "a non-finite loss, gradient or parameter: stop (exit code 3) or skip the "
                    "update (counted as nonfinite_steps)",
    "threads": "torch intra-op threads (0 = torch's current count); recorded in config.json: "
               "results are bitwise identical at a fixed thread count",
    "rollout": "group layout: independent (G samples), tree (roots re-sampled from chosen "
               "prefixes, KV cache reused) or repair (G samples + a corrected path per incorrect "
               "one); compare layouts at equal generated_tokens (docs/guides/rollouts.md)",
    "roots": "tree: independent starts per group", "branches": "tree: children per path",
    "branch_at": "tree: branch positions drawn by token entropy or uniformly",
    "branch_token": "tree/repair: the branch token is sampled, or an alternative (the "
                    "parent's token excluded; old_logps stay the policy's own log-probs)",
    "repair": "repair: resample the continuation from the departure, splice the reference, or "
              "local (re-sample from the response's last positions first, walking back)",
    "repair_tries": "repair resample/local: tries per incorrect response (first correct one "
                    "kept; local: each from one position earlier)",
    "probes": "gradlab's measurements (W, residuals, tax, drift, probe set); --no-probes "
              "trains with plain trainer metrics only",
}


def _add_config_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    for f in fields(RunConfig):
        default = (defaults or {}).get(f.name, f.default if f.default is not MISSING else f.default_factory())
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=HELP.get(f.name))
        elif f.name in ("objectives", "objective_params"):
            p.add_argument(flag, default=None, help=HELP.get(f.name))
        else:
            typ = float if isinstance(default, float) else int if isinstance(default, int) else str
            typ = int if f.name in ("max_new_tokens", "micro_batch", "max_prompt_len") else typ  # Optional[int]
            p.add_argument(flag, type=typ, default=default, help=HELP.get(f.name, "") + f" (default {default})")


def config_from_args(a: argparse.Namespace, objectives: list[str] | None = None) -> RunConfig:
    kw = {f.name: getattr(a, f.name) for f in fields(RunConfig) if hasattr(a, f.name)}
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
    else:
        kw.pop("objective_params")
    return RunConfig(**kw)


def cmd_train(a: argparse.Namespace) -> int:
    from .loop.train import train

    objectives = [a.objective] if getattr(a, "objective", None) else None
    cfg = config_from_args(a, objectives)
    if a.resume:  # options not typed are the stored ones (loop/resume.py)
        cfg = with_stored_config(cfg, given_options(build_parser(), a.argv))
    store = train(cfg, resume=a.resume)
    print(f"run folder: {store.path}  (read it with gradlab.load_run)")
    return 0


def cmd_reproduce(a: argparse.Namespace) -> int:
    from .loop.reproduce import reproduce

    cfg = config_from_args(a)
    if a.resume:
        cfg = with_stored_config(cfg, given_options(build_parser(), a.argv))
    t0 = time.time()
    summary = reproduce(cfg, resume=a.resume)
    print(summary)
    print(f"done in {time.time() - t0:.0f} s; run folder: {cfg.out}")
    return 0


IBPO_ROWS = ["ibpo[form=la]", "ibpo[form=togo]", "ibpo[form=ga+la,base=gspo]"]


def cmd_table(a: argparse.Namespace) -> int:
    """Cancellation ratio of every built-in objective on synthetic groups (no model needed)."""
    from .core import objectives
    from .core.cancellation import cancellation
    from .testing import random_batch

    rows = []
    for off in (0.0, a.off_policy):
        b = random_batch(n_groups=8, G=a.G, T=16, seed=a.seed, off_policy=off)
        for name in objectives.names() + IBPO_ROWS:
            obj = objectives.get(name)
            W, pb = obj.modulation(b), obj.prepare(b)  # IBPO: its token advantages
            rows.append((name, "on" if off == 0 else f"off ({off})",
                         cancellation(W, pb, "prefix").ratio, cancellation(W, pb, "trie").ratio))
    print("| objective | policy | ρ full-group | ρ trie |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.3g} | {r[3]:.3g} |")
    return 0


def cmd_view(a: argparse.Namespace) -> int:
    from .viz.html import view, watch

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


def cmd_variance(a: argparse.Namespace) -> int:
    """Gradient noise of each objective at a fixed policy: OUT/variance.csv and variance.png."""
    from pathlib import Path

    from .loop.variance import measure_variance
    from .viz.curves import save
    from .viz.variance import variance_figure

    try:
        names = split_top(a.objectives)
    except ValueError as e:
        raise ConfigError(f"--objectives: {e}") from None
    df = measure_variance(names, task=a.task, K=a.K, reference_batches=a.reference_batches,
                          prompts=a.prompts, G=a.G, checkpoint=a.checkpoint, seed=a.seed,
                          rollout=a.rollout, threads=a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "variance.csv", index=False)
    save(variance_figure(df, f"{a.task}: K={a.K} batches, reference {a.reference_batches} "
                             f"batches of {a.prompts}×{a.G}"), out / "variance.png")
    print(f"wrote {out / 'variance.csv'} and {out / 'variance.png'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradlab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"gradlab {version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="train one objective")
    run.add_argument("objective", help="objective name (gradlab.core.objectives.names())")
    tandem = sub.add_parser("tandem", help="train several objectives side by side from one start")
    rep = sub.add_parser("reproduce", help="the main job: default tandem + figures + summary")
    for sp, fn, defaults in ((run, cmd_train, None), (tandem, cmd_train, None),
                             (rep, cmd_reproduce, {"out": "runs/reproduce"})):
        _add_config_args(sp, defaults)
        sp.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_arg,
                        metavar="auto", help="continue from the last checkpoint; --resume auto: "
                        "continue if --out holds a run, else start it (torchrun restarts do this)")
        sp.set_defaults(fn=fn)
    tab = sub.add_parser("table", help="ρ of every objective on synthetic groups")
    tab.add_argument("--G", type=int, default=8)
    tab.add_argument("--seed", type=int, default=0)
    tab.add_argument("--off-policy", type=float, default=0.3)
    tab.set_defaults(fn=cmd_table)
    view = sub.add_parser("view", help="one self-contained HTML page of a run (curves, token strips)")
    view.add_argument("run", help="run folder")
    view.add_argument("--out", default=None, help="HTML file (default RUN/view.html)")
    view.add_argument("--watch", type=float, default=0, metavar="SECONDS",
                      help="re-write the page every SECONDS while the run trains (the page "
                           "reloads itself) until every step is checkpointed, or Ctrl-C")
    view.set_defaults(fn=cmd_view)
    var = sub.add_parser("variance", help="gradient noise of each objective at a fixed policy")
    _add_variance_args(var)
    var.set_defaults(fn=cmd_variance)
    chk = sub.add_parser("check", help="regression check of cancellation residuals vs a baseline",
                         add_help=False)
    chk.set_defaults(fn=lambda a: _delegate(DELEGATED["check"], a.rest))
    aud = sub.add_parser("audit", help="audit a trainer's loss settings (gradlab audit trl | verl)",
                         add_help=False)
    aud.set_defaults(fn=lambda a: _delegate(DELEGATED["audit"], a.rest))
    doc = sub.add_parser("doctor", help="check that gradlab works on this machine (device, bf16, "
                         "W exactness, a training step); writes a Markdown report", add_help=False)
    doc.set_defaults(fn=lambda a: _delegate(DELEGATED["doctor"], a.rest))
    for sp in (chk, aud, doc):
        sp.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _add_variance_args(p: argparse.ArgumentParser) -> None:
    from .loop.variance import DEFAULT_OBJECTIVES, ROLLOUTS

    p.add_argument("--task", default="arithmetic", help="'arithmetic', 'scaffold' or a .jsonl file")
    p.add_argument("--objectives", default=",".join(DEFAULT_OBJECTIVES),
                   help="comma-separated, with parameters as for tandem: 'grpo,ibpo[form=ga+la]'")
    p.add_argument("--K", type=int, default=32, help="rollout batches whose gradients give the "
                   "noise and its bootstrap interval (default 32)")
    p.add_argument("--reference-batches", type=int, default=128,
                   help="further batches whose mean gradient is the reference (default 128)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (the same in every batch)")
    p.add_argument("--G", type=int, default=8, help="responses per prompt")
    p.add_argument("--rollout", default="independent", choices=ROLLOUTS, help="rollout layout")
    p.add_argument("--checkpoint", default=None, help="a run's checkpoints/<objective> folder or "
                   "a Hugging Face model folder (default: the task's shipped warm start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/variance", help="folder for variance.csv and variance.png")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's count)")


def _resume_arg(v: str) -> str:
    if v != "auto":
        raise argparse.ArgumentTypeError(f"invalid value {v!r}: --resume takes no value or 'auto'")
    return v


def _resume_command(a: argparse.Namespace, out: str) -> str:
    """The command that continues a stopped run (untyped options come from config.json)."""
    import os
    import shlex

    cmd = f"gradlab {a.cmd}" + (f" {shlex.quote(a.objective)}" if a.cmd == "run" else "")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the same torchrun launch
        cmd = f"torchrun --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '?')} -m {cmd}"
    return f"{cmd} --out {shlex.quote(str(out))} --resume"


def _delegate(module: str, argv: list[str]) -> int:
    """Sub-commands that own their argument parsing: module.main(argv) -> exit code."""
    import importlib

    if module == DELEGATED["audit"] and argv[:1] == ["verl"]:  # gradlab audit verl
        module, argv = "gradlab.integrations.verl_audit", argv[1:]
    return importlib.import_module(module).main(argv)


DELEGATED = {"check": "gradlab.check", "audit": "gradlab.integrations.trl_audit",
             "doctor": "gradlab.doctor"}


def main(argv: list[str] | None = None) -> int:
    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:  # these parse their own options (incl. --help)
        return _delegate(DELEGATED[argv[0]], argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # what was typed (--resume takes the untyped options from config.json)
    from .loop.atomic import EXIT_WRITE, WriteError
    from .loop.guard import EXIT_NONFINITE, NonFiniteError
    from .loop.preempt import Preempted, StopSignals
    from .loop.store import CorruptFileError

    # the program (not main([...]) in a notebook or test): once stopped, only the exit is left
    StopSignals.ignore_after_stop = program

    try:
        return args.fn(args)
    except Preempted as e:  # checkpointed; rank 0 alone says how to resume
        if e.main:
            print(f"gradlab {args.cmd}: {e.describe(_resume_command(args, e.out))}", file=sys.stderr)
        return e.exit_code
    except WriteError as e:
        print(f"gradlab {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_WRITE
    except NonFiniteError as e:
        print(f"gradlab {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except (ConfigError, FileNotFoundError, FileExistsError, CorruptFileError) as e:
        print(f"gradlab {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
