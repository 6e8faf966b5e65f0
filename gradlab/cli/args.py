"""The options of the `gradlab` sub-commands other than run/tandem/reproduce (whose options are
RunConfig's fields, gradlab/cli/main.py), and the argument checks that need the file system or torch.

Each check raises `ConfigError` with one line naming the option and its valid values; the CLI
prints it and exits 2. They run before any work (no model is loaded, nothing is written).
Nothing here imports torch at module level: `gradlab --help` stays fast. A failure of the loop
itself (pre-emption, a write, a non-finite step) becomes one line and its exit code in
`failure_code`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from ..core.variants import split_top
from ..loop.config import ConfigError, check_model_files, check_objective_names


def _table_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--G", type=int, default=8, help="responses per group (≥ 2; default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic groups (≥ 0)")
    p.add_argument("--off-policy", type=float, default=0.3,
                   help="log-ratio scale of the off-policy rows (> 0; default 0.3)")


def _view_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run folder")
    p.add_argument("--out", default=None, help="HTML file (default RUN/view.html)")
    p.add_argument("--watch", type=float, default=0, metavar="SECONDS",
                   help="re-write the page every SECONDS while the run trains (the page "
                        "reloads itself) until every step is checkpointed, or Ctrl-C")


ROLLOUTS = ("independent", "tree", "repair")  # gradlab.loop.recipes.variance.ROLLOUTS (torch-free copy)
VARIANCE_OBJECTIVES = "grpo,gspo,dfpo-min,dfpo-orth,ibpo[form=ga],ibpo[form=la],ibpo[form=ga+la],ibpo[form=togo],ibpo[base=gspo]"


def _variance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="arithmetic", help="'arithmetic', 'scaffold' or a .jsonl file")
    p.add_argument("--objectives", default=VARIANCE_OBJECTIVES,
                   help="comma-separated, with parameters as for tandem: 'grpo,ibpo[form=ga+la]'")
    p.add_argument("--K", type=int, default=32, help="rollout batches whose gradients give the "
                   "noise and its bootstrap interval (≥ 2; default 32)")
    p.add_argument("--reference-batches", type=int, default=128,
                   help="further batches whose mean gradient is the reference (≥ 2; default 128)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (the same in every batch)")
    p.add_argument("--G", type=int, default=8, help="responses per prompt (≥ 2)")
    p.add_argument("--rollout", default="independent", choices=ROLLOUTS, help="rollout layout")
    p.add_argument("--checkpoint", default=None, help="a run's checkpoints/<objective> folder or "
                   "a Hugging Face model folder (default: the task's shipped warm start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/variance", help="folder for variance.csv, variance.png "
                   "and summary.md")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's count)")


def regression_check_options(p: argparse.ArgumentParser) -> None:
    """Add the options of `gradlab check` to `p` (the one definition: the long help of
    `gradlab check --help`, gradlab.check.run's parser, uses it too)."""
    p.add_argument("--update", action="store_true", help="rewrite the baseline (ρ and W per "
                   "scenario, with this machine's fingerprint)")
    p.add_argument("--baseline", help="baseline JSON (default: the committed one; with --loss: "
                                      "none unless given); compared exactly on the machine "
                                      "that wrote it, with tolerances on another")
    p.add_argument("--loss", help="check your loss instead: module:function or file.py:function")
    p.add_argument("--expect", choices=("cancels", "residual", "none"), default="cancels",
                   help="for --loss: must it cancel everywhere (default), show a residual "
                        "somewhere, or only match the baseline")
    p.add_argument("--only", help="only scenarios whose name contains this string")
    p.add_argument("--no-model", action="store_true", help="synthetic scenarios only (no model)")


def check_loss_spec(spec: str) -> None:
    """`--loss module:fn` or `path/file.py:fn`: the form, and that the file or the module exists
    (found from the working directory, as the loader finds it), without importing it."""
    import importlib.util

    mod, sep, fn = spec.rpartition(":")
    if not (sep and mod and fn.isidentifier()):
        raise ConfigError(f"--loss {spec!r}: expected module:function or path/file.py:function")
    if mod.endswith(".py"):
        if not Path(mod).is_file():
            raise ConfigError(f"--loss {spec!r}: no file {mod}")
        return
    sys.path.insert(0, os.getcwd())
    try:
        missing = None if importlib.util.find_spec(mod) is not None else mod
    except ModuleNotFoundError as e:  # a parent package is missing
        missing = e.name or mod
    except (ImportError, ValueError):
        missing = mod
    finally:
        sys.path.remove(os.getcwd())
    if missing:
        raise ConfigError(f"--loss {spec!r}: no module {missing!r} (looked in {os.getcwd()} and "
                          "the installed packages)")


def _audit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trainer", choices=["trl", "verl"], help="the trainer to audit "
                   "(its options: gradlab audit TRAINER --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when "
                   "present; default auto)")
    p.add_argument("--out", default=None, help="also write the Markdown report to this file "
                   "(default: printed only)")
    p.add_argument("--no-loop", dest="loop", action="store_false",
                   help="skip the one-step training run")


def check_doctor_args(a: argparse.Namespace) -> None:
    """`gradlab doctor`'s options, before torch loads (gradlab/cli/doctor.py checks them again
    for `python -m gradlab.cli.doctor`)."""
    if not (a.device in ("auto", "cpu", "cuda") or (a.device.startswith("cuda:")
                                                    and a.device[5:].isdigit())):
        raise ConfigError(f"--device: {a.device!r}; valid: auto, cpu, cuda, cuda:N")
    if a.out is not None and not Path(a.out).parent.is_dir():
        raise ConfigError(f"--out: folder {Path(a.out).parent} does not exist")


def require(option: str, value: object, ok: bool, valid: str) -> None:
    """`--option: value is invalid; must be valid` unless ok."""
    if not ok:
        raise ConfigError(f"--{option}: {value!r} is invalid; must be {valid}")


def check_device(device: str) -> None:
    """A CUDA device must exist here (the name itself is checked by RunConfig)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--device: {device!r}, but torch {torch.__version__} sees no CUDA GPU "
                          "on this machine; valid here: cpu")
    index = device.partition(":")[2]
    n = torch.cuda.device_count()
    if index and (not index.isdigit() or int(index) >= n):
        raise ConfigError(f"--device: {device!r}; valid here: cpu, cuda, "
                          + ", ".join(f"cuda:{i}" for i in range(n)))


def _model_config(path: str, option: str) -> dict:
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{option}: no Hugging Face model folder (config.json) at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{option}: {path}/config.json is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{option}: {path}/config.json is not a JSON object")
    return data


def check_model(path: str | None, trust_remote_code: bool = False, option: str = "--model") -> None:
    """A model folder whose config.json names a model_type this transformers knows (or code
    it is allowed to run: `--trust-remote-code` with an auto_map)."""
    if path is None:
        return
    data = _model_config(path, option)
    check_model_files(path, trust_remote_code, option)  # weights and tokenizer, named
    if trust_remote_code and "auto_map" in data:
        return
    import transformers
    from transformers import CONFIG_MAPPING

    kind = data.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ConfigError(f"{option}: {path}/config.json names model_type {kind!r}, which "
                          f"transformers {transformers.__version__} does not know (e.g. qwen3, "
                          "llama, qwen2; a newer transformers may)")


# the shipped tiny policies (every task's warm start shares their configuration)
TINY_POLICY = Path(__file__).resolve().parent.parent / "data" / "default_policy"


def check_policy(task: str, difficulty: int, model: str | None) -> None:
    """The shipped policy that a run without --model loads (loop/train.py: the built-in task's
    own, the default one for a JSONL task) is whole in this install; else `MissingPolicyError`
    naming the file and how to restore it, before any work. Torch-free."""
    if model is not None:
        return
    from ..loop.setup.shipped import check_shipped_policy

    key = {"arithmetic": f"arithmetic-d{difficulty}", "scaffold": "scaffold-t4"}
    check_shipped_policy(key.get(task, "arithmetic-d2"))  # a JSONL task: the default policy
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context(model: str | None) -> int | None:
    """The context length in tokens of model folder `model` (None: gradlab's tiny policies),
    read from its config.json (a multimodal model's text_config); None where it names none."""
    if model is None:  # a missing shipped file is named as such, not as a bad --model
        from ..loop.setup.shipped import check_shipped_policy

        check_shipped_policy()
    data = _model_config(str(model or TINY_POLICY), "--model")
    for conf in (data, data.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(conf.get(key), int) and not isinstance(conf.get(key), bool):
                return conf[key]
    return None


def check_context(max_new_tokens: int | None, model: str | None) -> None:
    """--max-new-tokens must leave room for a prompt in the model's context."""
    ctx = model_context(model) if max_new_tokens is not None else None
    if ctx is not None and max_new_tokens >= ctx:
        what = f"of {model}" if model else "of the task's policy"
        raise ConfigError(f"--max-new-tokens: {max_new_tokens} is invalid; must be < {ctx}, the "
                          f"context {what} (max_position_embeddings), which also holds the prompt")


def check_task_file(task: str | None) -> None:
    """A JSONL --task is read once here, so a bad line is named before any other option."""
    if task and task.endswith(".jsonl") and Path(task).is_file():
        from ..loop.setup.task import JsonlTask

        JsonlTask(task)  # TaskFileError: one line naming the file and line


def check_run_folder(run: str, need_metrics: bool = True) -> None:
    """A run folder with a readable config.json and (unless watching) some metrics."""
    from ..loop.runs.resume import read_config

    path = Path(run)
    if not path.is_dir():
        raise ConfigError(f"run folder {run!r} does not exist (give the --out of a run)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{run} is not a run folder (no config.json)")
    read_config(path / "config.json")  # a corrupt file: one line naming it
    metrics = [path / "metrics.jsonl", *path.glob("*/metrics.jsonl")]
    if need_metrics and not any(m.is_file() and m.stat().st_size > 0 for m in metrics):
        raise ConfigError(f"{run} has no metrics yet (metrics.jsonl is missing or empty): nothing "
                          "to show; use --watch SECONDS while it trains")


def check_task(task: str) -> None:
    if task not in ("arithmetic", "scaffold") and not (task.endswith(".jsonl") and Path(task).is_file()):
        raise ConfigError(f"--task: {task!r}; valid: arithmetic, scaffold or a path to an "
                          "existing .jsonl file")


def check_variance_args(a: argparse.Namespace) -> list[str]:
    """The options of `gradlab variance`; returns the objective names (each one built once)."""
    check_task(a.task)
    for opt, value, ok, valid in (
            ("K", a.K, a.K >= 2, "≥ 2 (the interval is a bootstrap over K batches)"),
            ("reference-batches", a.reference_batches, a.reference_batches >= 2, "≥ 2"),
            ("prompts", a.prompts, a.prompts >= 1, "≥ 1"),
            ("G", a.G, a.G >= 2, "≥ 2 (a group needs two responses to compare)"),
            ("seed", a.seed, a.seed >= 0, "≥ 0"),
            ("threads", a.threads, a.threads >= 0, "≥ 0 (0 = torch's current count)")):
        require(opt, value, ok, valid)
    ckpt = Path(a.checkpoint) if a.checkpoint is not None else None
    if ckpt is not None and (ckpt / "config.json").is_file():  # a Hugging Face model folder
        check_model(a.checkpoint, option="--checkpoint")
    elif ckpt is not None and not ((ckpt / "model.safetensors").is_file()
                                   and (ckpt.parent.parent / "config.json").is_file()):
        raise ConfigError(f"--checkpoint: {a.checkpoint!r} is neither a Hugging Face model "
                          "folder (config.json) nor a run's checkpoints/<objective> folder")
    try:
        names = split_top(a.objectives)
    except ValueError as e:
        raise ConfigError(f"--objectives: {e}") from None
    if not names:
        raise ConfigError("--objectives: give at least one objective")
    check_objective_names(names)  # torch-free; the parameters are checked next, by building
    from ..core import objectives

    for name in names:
        try:
            objectives.get(name)
        except ValueError as e:
            raise ConfigError(f"--objectives: {e}") from None
    return names


class Parser(argparse.ArgumentParser):
    """argparse that refuses abbreviated options and reports a mistake in one line."""

    def __init__(self, *args, **kw) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str) -> None:  # argparse prints usage + message; one line is enough
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


# the main job's reference bands (gradlab/loop/recipes/reference.py), named without importing it
REFERENCE = str(Path(__file__).resolve().parent.parent / "data" / "reproduce_reference.json")


def add_check_arg(p: argparse.ArgumentParser) -> None:
    """reproduce's --check [REFERENCE], --save-reference FILE, --seeds K and --fresh."""
    p.add_argument("--check", nargs="?", const=REFERENCE, default=None, metavar="REFERENCE",
                   help="run the main job with the current code and compare it with a "
                   "reference: one saved by --save-reference on the same CPU model, torch and "
                   "threads is re-run at its own configuration and compared exactly (every "
                   "summary number and per-step series), otherwise each number gets a t test "
                   "against the reference's seeds (the shipped reference by default); exit 1 "
                   "on any change (docs/guides/comparisons.md)")
    p.add_argument("--save-reference", default=None, metavar="FILE",
                   help="run the main job (--seeds K seeds from --seed) and save this machine's "
                   "reference for --check FILE: configuration, summary numbers, per-step "
                   "series, CPU model, torch, threads, code hash and the user's files; the runs "
                   "go to --out, by default beside FILE (ref.json: ref.runs, ref.runs-seed1, …)")
    p.add_argument("--seeds", type=int, default=None, metavar="K",
                   help="seeds of --check (default 1; a saved reference: all its seeds) and "
                   "--save-reference (default 1); more seeds detect smaller shifts")
    p.add_argument("--fresh", action="store_true",
                   help="--check / --save-reference: re-train even where --out holds a "
                   "finished run of this code (a run of other code, gradlab's or the user's "
                   "files, is never reused); an old run is moved to <out>.prev-N, never deleted")


def load_check_reference(a: argparse.Namespace) -> dict | None:
    """The reference of --check (None without it), after the options of the check are checked;
    a missing or corrupt file, or options that do not go together, is a one-line error."""
    if a.seeds is not None:
        require("seeds", a.seeds, a.seeds >= 1, "≥ 1")
    if a.check and a.save_reference:
        raise ConfigError("--check and --save-reference: one at a time (save the reference, "
                          "then check against it)")
    if not (a.check or a.save_reference) and (a.seeds is not None or a.fresh):
        raise ConfigError(f"{'--seeds' if a.seeds is not None else '--fresh'}: only with "
                          "--check or --save-reference")
    if a.save_reference and a.resume:
        raise ConfigError("--save-reference with --resume: a reference is made from finished "
                          "runs of the current code; drop --resume")
    if a.save_reference and not Path(a.save_reference).resolve().parent.is_dir():
        raise ConfigError(f"--save-reference: folder {Path(a.save_reference).parent} does not "
                          "exist (the file is written after every seed has trained)")
    if not a.check:
        return None
    if not Path(a.check).is_file():  # before scipy loads
        raise ConfigError(f"--check: no reference at {a.check}")
    from ..loop.recipes.reference import load_reference

    try:
        return load_reference(a.check)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--check: {e}") from None


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a run folder (each objective's final checkpoint), one "
                   "checkpoint folder (RUN/checkpoints/NAME) or a Hugging Face model folder")
    p.add_argument("--problems", default="256", help="held-out problems: a number ≥ 1, or 'all' "
                   "(the whole held-out split of a built-in or JSONL task; default 256)")
    p.add_argument("--samples", type=int, default=1,
                   help="sampled responses per problem (≥ 1; default 1)")
    p.add_argument("--seed", type=int, default=0, help="evaluation seed (≥ 0): 0 = the loop's "
                   "own held-out set; another seed draws other problems and samples")
    p.add_argument("--objective", default=None, help="one objective of a run folder (default: all)")
    p.add_argument("--task", default=None, choices=("arithmetic", "scaffold"),
                   help="the task of a model folder (default arithmetic; a run names its own)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (> 0; default 1)")
    p.add_argument("--out", default=None, help="also write the tidy table as CSV to this file")


def run_eval(a: argparse.Namespace) -> int:
    """`gradlab eval`: check the options, score every policy at PATH, print the table."""
    problems = a.problems if a.problems == "all" else (
        int(a.problems) if a.problems.isdigit() else None)
    require("problems", a.problems, problems == "all" or (problems or 0) >= 1,
            "a number ≥ 1 or 'all'")
    require("samples", a.samples, a.samples >= 1, "≥ 1")
    require("seed", a.seed, a.seed >= 0, "≥ 0")
    require("temperature", a.temperature, a.temperature > 0, "> 0")
    if not Path(a.path).exists():
        raise ConfigError(f"{a.path}: no such run, checkpoint or model folder")
    from ..loop.recipes.evaluation import evaluate_path, targets

    targets(a.path, a.objective, a.task)  # torch-free: a wrong folder or option at once

    try:
        df = evaluate_path(a.path, problems, samples=a.samples, seed=a.seed, objective=a.objective,
                           task=a.task, temperature=a.temperature)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = df.assign(score=(100 * df["value"]).map("{:.1f}".format) + " ± " +
                  (100 * df["se"]).map("{:.1f}".format))
    print(t.pivot(index="policy", columns="metric", values="score").to_markdown())
    n = int(df["n_problems"].iloc[0])
    print(f"held-out accuracy (%) ± its standard error over {n} problems, eval seed {a.seed}; "
          "accuracy_expected: exact, no sampling noise")
    if a.out:
        df.to_csv(a.out, index=False)
        print(f"wrote {a.out}")
    return 0


def failure_code(e: Exception, args: argparse.Namespace) -> int | None:
    """The exit code of a loop failure `e` after printing its line; None for anything else.
    A failure class is looked up only where its module is loaded (one that is not loaded
    raised nothing), so the argument checks before it never import torch."""
    from ..atomic import EXIT_WRITE, WriteError
    from ..loop.runs.resume import CorruptFileError

    preempt, guard, userloss = (sys.modules.get(f"gradlab.{m}") for m in (
        "loop.faults.preempt", "loop.faults.guard", "core.userloss"))
    say = lambda msg: print(f"gradlab {args.cmd}: {msg}", file=sys.stderr)  # noqa: E731
    if preempt is not None and isinstance(e, preempt.Preempted):  # checkpointed
        if e.main:  # rank 0 alone says how to resume
            say(e.describe(resume_command(args, e.out)))
        return e.exit_code
    if isinstance(e, WriteError):
        say(f"error: {e}")
        return EXIT_WRITE
    if guard is not None and isinstance(e, guard.NonFiniteError):
        say(f"error: {e}")
        return guard.EXIT_NONFINITE
    if userloss is not None and isinstance(e, userloss.UserLossError):  # --objectives file.py:fn
        say(f"error: {e} (exit code 3: a fault in the loss)")
        return 3
    if isinstance(e, (FileNotFoundError, FileExistsError, CorruptFileError)):
        say(f"error: {e}")
        return 2
    return None


def resume_command(a: argparse.Namespace, out: str) -> str:
    """The command that continues a stopped run (untyped options come from config.json)."""
    import os

    cmd = f"gradlab {a.cmd}" + (f" {shlex.quote(a.objective)}" if a.cmd == "run" else "")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the same torchrun launch
        cmd = f"torchrun --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '?')} -m {cmd}"
    return f"{cmd} --out {shlex.quote(str(out))} --resume"
