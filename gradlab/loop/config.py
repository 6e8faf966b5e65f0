"""Run configuration: one dataclass, validated with errors that name the option at fault."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .. import jsonio
from .faults.errors import ConfigError

DEFAULT_OBJECTIVES = ("grpo", "gspo", "dfpo-min", "dfpo-orth")
MODES = ("tandem", "same-batch")
# the rollout layouts' option values, here so validation needs no sampler code
LAYOUTS = ("independent", "tree", "repair")  # --rollout (rollouts/layouts.py)
BRANCH_AT = ("entropy", "uniform")  # --branch-at (rollouts/tree.py)
BRANCH_TOKEN = ("sample", "alternative")  # --branch-token
REPAIR_MODES = ("resample", "splice", "local")  # --repair (rollouts/repair.py)
# torch-free copies, so a mistaken option is answered before torch loads (tests/test_newcomer.py
# holds them equal to gradlab.core.objectives.names() and gradlab.core.batch.ADVANTAGE_SCALES)
OBJECTIVE_NAMES = ("grpo", "grpo-fix", "gspo", "gspo-token", "dfpo", "dfpo-min", "dfpo-orth",
                   "dfpo-scale", "ibpo")
ADV_SCALES = ("group", "batch", "none")
# what a --model folder needs besides config.json (the names transformers loads)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


@dataclass
class RunConfig:
    """Everything a run needs; saved as config.json in the run folder.

    Units: `steps` = rollout batches; each is cut into `minibatches` optimizer steps, so the
    run makes steps × minibatches optimizer steps per objective. `prompts` × `G` responses per
    rollout batch. `micro_batch`: sequences per forward/backward inside an optimizer step
    (gradient accumulation over whole groups; None = the whole step in one pass).
    """

    out: str = "runs/default"
    objectives: list[str] = field(default_factory=lambda: list(DEFAULT_OBJECTIVES))
    objective_params: dict[str, dict] = field(default_factory=dict)
    mode: str = "tandem"
    task: str = "arithmetic"
    difficulty: int = 2
    model: str | None = None
    trust_remote_code: bool = False  # run code a --model folder ships (config auto_map)
    steps: int = 150
    prompts: int = 8
    G: int = 8
    rollout: str = "independent"  # group layout: independent, tree or repair (loop/rollouts/layouts.py)
    roots: int = 2  # tree: independent starts per group
    branches: int = 2  # tree: children per path (branch points per path)
    branch_at: str = "entropy"  # tree: where children branch (entropy-weighted or uniform)
    branch_token: str = "sample"  # tree and repair: the branch token sampled or an alternative
    repair: str = "resample"  # repair: re-sample from the departure, splice the reference, or local
    repair_tries: int = 4  # repair resample/local: tries per incorrect response
    minibatches: int = 4
    split_groups: bool = False
    balance_polarity: bool = False  # each optimizer step gets its share of + and − rows (update/batches.py)
    micro_batch: int | None = None
    lr: float = 2e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    max_new_tokens: int | None = None
    max_prompt_len: int | None = None  # prompt tokens; longer prompts are an error
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    grad_checkpointing: bool = False  # model.gradient_checkpointing_enable()
    attn: str = "auto"  # attention implementation: auto (SDPA where supported), eager or sdpa
    dropout: bool = False  # keep the model's dropout in training forwards (off by default)
    verifier: str = "exact"  # JSONL answers: exact string or "math" (math-verify)
    adv_scale: str = "group"
    seed: int = 0
    device: str = "cpu"
    amp: bool = False
    fsdp: bool = False
    ckpt_every: int = 10
    tax_every: int = 5
    eval_every: int = 10  # held-out evaluation every k rollout steps and at the end (0 = off)
    eval_size: int = 64  # held-out problems per evaluation (loop/setup/heldout.py)
    instruments: str = "default"  # what each step measures: a spec (gradlab/instruments)
    probe_contexts: int = 16
    progress: bool = True
    trace_every: int = 10
    trace_groups: int = 2
    log: str = ""
    on_nonfinite: str = "stop"  # non-finite loss/gradient/parameter: stop (exit 3) or skip
    threads: int = 1  # torch intra-op threads (as the CLI); 0 = torch's current count, resolved and recorded

    def __post_init__(self) -> None:
        if self.threads == 0:  # record the count actually used: results are bitwise per count
            import torch

            self.threads = torch.get_num_threads()
        validate(self)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> RunConfig:
        data = current_form(json.loads(Path(path).read_text()), str(path))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"config {path}: unknown option(s) {unknown}; valid: {sorted(known)}")
        check_types(data, str(path))
        return cls(**data)


# the measuring flags of a config.json written by gradlab 0.1 before `instruments` chose
FLAT_FLAGS = ("probes", "drift", "flips")


def flat_instruments(probes: bool = True, drift: bool = True, flips: bool = False,
                     tax_every: int = 5) -> str:
    """The instrument spec that measures what the 0.1 flags did: with probes, W's deviation and
    ρ every step, attribution and the learning tax every `tax_every` steps (the other
    objectives' ρ in same-batch mode, which the loop adds to any spec); with drift, drift at
    the nodes every step and at divergent tokens every `tax_every` steps; with flips, the
    token-flip ledger every `tax_every` steps. A preset name where one measures exactly that."""
    k = tax_every
    if probes and drift:
        return "full" if flips else "default"
    items = ["modulation", "residual", f"attribution@{k}", f"tax@{k}"] if probes else []
    items += [f"flips@{k}"] if flips else []
    return ",".join(items) or "off"


def current_form(data: dict, source: str = "config") -> dict:
    """A config.json's options (`source` names it in errors) in the current form: a flat 0.1
    file's `probes`, `drift` and `flips` (with no `instruments`, or an empty one) become the
    `instruments` spec that measures the same (`flat_instruments`). Anything else is returned
    unchanged."""
    if not isinstance(data, dict) or not (any(k in data for k in FLAT_FLAGS)
                                          or data.get("instruments") == ""):
        return data
    out = {k: v for k, v in data.items() if k not in FLAT_FLAGS}
    if not out.get("instruments"):
        flags = {k: data[k] for k in FLAT_FLAGS if k in data}
        tax = data.get("tax_every", RunConfig.tax_every)
        for k, v, ok, want in [*((k, v, isinstance(v, bool), "true or false")
                                 for k, v in flags.items()),
                               ("tax_every", tax, isinstance(tax, int) and not isinstance(tax, bool)
                                and tax >= 0, "an integer ≥ 0")]:
            if not ok:
                raise ConfigError(f"{source}: option {k!r} is {jsonio.dumps(v)}; expected {want}")
        out["instruments"] = flat_instruments(**flags, tax_every=tax)
    return out


def check_types(data: dict, source: str) -> None:
    """ConfigError naming the first option of `data` (a config.json read back) whose value is
    not of its declared RunConfig type, with the value and the type expected. null is allowed
    only where the default is None; an integer is a float; true/false are not numbers."""
    import typing

    hints = typing.get_type_hints(RunConfig)
    for f in fields(RunConfig):
        if f.name in data and not _has_type(data[f.name], hints[f.name]):
            v = data[f.name]
            kind = _JSON_KIND.get(type(v), type(v).__name__)
            raise ConfigError(f"{source}: option {f.name!r} is {jsonio.dumps(v)}"
                              + (f" ({kind})" if v is not None else "") + "; expected "
                              f"{_type_name(hints[f.name])}; correct the file or start a new "
                              "run in another --out")


_JSON_KIND = {str: "a string", bool: "true/false", int: "an integer", float: "a number",
              list: "a list", dict: "an object"}


def _has_type(v: object, t: object) -> bool:
    import typing

    args = typing.get_args(t)
    if type(None) in args:  # X | None
        return v is None or _has_type(v, next(a for a in args if a is not type(None)))
    origin = typing.get_origin(t)
    if origin is list:
        return isinstance(v, list) and all(_has_type(x, args[0]) for x in v)
    if origin is dict:
        return isinstance(v, dict) and all(isinstance(k, str) and _has_type(x, args[1])
                                           for k, x in v.items())
    if t is float:  # JSON writes 2.0 as 2 in some tools
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, t)


def _type_name(t: object) -> str:
    import typing

    args = typing.get_args(t)
    if type(None) in args:
        return _type_name(next(a for a in args if a is not type(None))) + " or null"
    origin = typing.get_origin(t)
    if origin is list:
        return f"a list of {_type_name(args[0]).split(' ', 1)[1]}s"
    if origin is dict:
        return "an object of objects"
    return {str: "a string", bool: "true or false", int: "an integer", float: "a number"}[t]


def validate(c: RunConfig) -> None:
    """ConfigError naming the first bad option: the files (a task or model folder that cannot
    be used is the first thing to fix), then every value that needs no torch (a mistake is
    answered at once), then the objectives with parameters or code, which are built (torch is
    imported); a plain registry name builds with its defaults."""
    _validate_files(c)
    _validate_values(c)
    from ..core import variants

    if not c.objectives:
        raise ConfigError("--objectives: give at least one objective")
    for name in filter(lambda n: _built(n, c), c.objectives):  # [key=value, ...]: variants.py
        from ..core import objectives

        try:
            objectives.get(name, **c.objective_params.get(name, {}))  # parameters checked there
        except ValueError as e:
            raise ConfigError(f"--objectives: {e}") from None
    if c.adv_scale == "batch" and c.micro_batch is not None and any(
            n.split("[")[0] == "ibpo" for n in c.objectives):
        raise ConfigError("--adv-scale batch with --micro-batch: IBPO scales its token "
                          "advantages by the std of the rows in each loss call; use group or none")
    labels = [variants.label(n) for n in c.objectives]  # a user loss: its name= or function
    if len(set(labels)) != len(labels):
        dup = sorted({x for x in labels if labels.count(x) > 1})
        raise ConfigError(f"--objectives: duplicate names {dup} in {c.objectives} (a user loss "
                          "is named by its function; give another with [name=...])")
    _validate_layout(c)


def _validate_files(c: RunConfig) -> None:
    """--task and --model: the files exist and can be used (read before any value check)."""
    if c.task not in ("arithmetic", "scaffold") and not (c.task.endswith(".jsonl") and Path(c.task).is_file()):
        raise ConfigError(f"--task: {c.task!r}; valid: arithmetic, scaffold or a path to an existing .jsonl file")
    if c.task.endswith(".jsonl"):
        from .faults.untrusted import check_task_size

        check_task_size(c.task)  # refused from its size, before anything reads it
    if c.model is not None:
        check_model_files(c.model, c.trust_remote_code)


def _validate_values(c: RunConfig) -> None:
    """Every option that needs no torch: numbers, names and their combinations."""
    check_objective_names(c.objectives)
    if not (c.device in ("cpu", "cuda") or (c.device.startswith("cuda:") and c.device[5:].isdigit())):
        raise ConfigError(f"--device: {c.device!r}; valid: cpu, cuda, cuda:N")
    checks = [
        ("G", c.G >= 2, "≥ 2 (a group needs two responses to compare)"),
        ("prompts", c.prompts >= 1, "≥ 1"),
        ("steps", c.steps >= 1, "≥ 1"),
        ("minibatches", c.minibatches >= 1, "≥ 1"),
        ("lr", c.lr > 0, "> 0"),
        ("temperature", c.temperature > 0, "> 0"),
        ("grad_clip", c.grad_clip > 0, "> 0"),
        ("ckpt_every", c.ckpt_every >= 1, "≥ 1"),
        ("threads", c.threads >= 1, "≥ 1 (0 = torch's current count)"),
        ("tax_every", c.tax_every >= 0, "≥ 0 (0 = never)"),
        ("eval_every", c.eval_every >= 0, "≥ 0 (0 = no held-out evaluation)"),
        ("eval_size", c.eval_size >= 1, "≥ 1"),
        ("trace_every", c.trace_every >= 0, "≥ 0 (0 = no token traces)"),
        ("trace_groups", c.trace_groups >= 0, "≥ 0"),
        ("difficulty", 1 <= c.difficulty <= 9, "in 1..9"),
        ("max_new_tokens", c.max_new_tokens is None or 1 <= c.max_new_tokens <= 4096,
         "in 1..4096 or unset (the task's default)"),
        ("max_prompt_len", c.max_prompt_len is None or c.max_prompt_len >= 1, "≥ 1 or unset"),
        ("verifier", c.verifier in ("exact", "math"), "exact or math"),
    ]
    for opt, ok, valid in checks:
        if not ok:
            raise ConfigError(f"--{opt.replace('_', '-')}: {getattr(c, opt)!r} is invalid; must be {valid}")
    units = c.prompts * c.G if c.split_groups else c.prompts
    if c.minibatches > units:
        what = "responses" if c.split_groups else "prompts (groups stay whole)"
        raise ConfigError(f"--minibatches: {c.minibatches} > {units} {what} per rollout batch")
    if not isinstance(c.instruments, str) or not c.instruments.strip():
        raise ConfigError(f"--instruments: {c.instruments!r} names no instrument; give a preset "
                          "(off, cheap, default, full) or instrument names")
    if c.micro_batch is not None:
        if c.micro_batch < 1 or c.micro_batch % c.G:
            raise ConfigError(f"--micro-batch: {c.micro_batch} is not a positive multiple of --G "
                              f"{c.G} (micro-batches hold whole groups)")
        if c.split_groups:
            raise ConfigError("--micro-batch needs whole groups in every optimizer step: it "
                              "cannot be combined with --split-groups")
    bad_log = sorted(set(filter(None, c.log.split(","))) - {"tensorboard", "trackio"})
    if bad_log:
        raise ConfigError(f"--log: unknown {bad_log}; valid: tensorboard, trackio (comma-separated)")
    if c.attn not in ("auto", "eager", "sdpa"):
        raise ConfigError(f"--attn: unknown {c.attn!r}; valid: auto, eager, sdpa")
    if c.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"--on-nonfinite: unknown {c.on_nonfinite!r}; valid: stop, skip")
    if c.mode not in MODES:
        raise ConfigError(f"--mode: unknown {c.mode!r}; valid: {', '.join(MODES)}")
    if c.adv_scale not in ADV_SCALES:
        raise ConfigError(f"--adv-scale: unknown {c.adv_scale!r}; valid: {', '.join(ADV_SCALES)}")


def check_objective_names(names: list[str], option: str = "--objectives") -> None:
    """ConfigError naming the first unknown objective name, without torch (the parameters in
    its brackets are checked when it is built, `gradlab.core.objectives.get`)."""
    from ..core import variants

    for name in names:
        try:
            base = name if variants.is_user(name) else variants.parse(name)[0]
        except ValueError as e:
            raise ConfigError(f"{option}: {e}") from None
        if not variants.is_user(name) and base not in OBJECTIVE_NAMES:
            raise ConfigError(f"{option}: unknown objective {name!r}; valid: "
                              f"{', '.join(OBJECTIVE_NAMES)} (each optionally with [key=value, ...])")


def check_model_files(path: str | Path, trust_remote_code: bool = False,
                      option: str = "--model") -> None:
    """ConfigError naming what a Hugging Face model folder lacks: config.json, weights
    (`WEIGHT_FILES`) or tokenizer files (`TOKENIZER_FILES`; a tokenizer with its own code,
    trusted, may name its files as it likes); then its remote code, refused unless trusted."""
    from .faults.untrusted import check_remote_code

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{option}: no Hugging Face model folder (config.json) at {path}")
    if not any((folder / n).is_file() for n in WEIGHT_FILES):
        raise ConfigError(f"{option}: {path} has no weights (none of {', '.join(WEIGHT_FILES)})")
    own_code = trust_remote_code and _auto_map(folder / "tokenizer_config.json")
    if not own_code and not (any((folder / n).is_file() for n in TOKENIZER_FILES)
                             or any(folder.glob("*.tiktoken"))):
        raise ConfigError(f"{option}: {path} has no tokenizer files (none of "
                          f"{', '.join(TOKENIZER_FILES)}); save the tokenizer into the folder "
                          "(tokenizer.save_pretrained)")
    check_remote_code(folder, trust_remote_code)  # auto_map: refused unless trusted


def _auto_map(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("auto_map"))


def _validate_layout(c: RunConfig) -> None:
    """The rollout layout options (loop/rollouts/layouts.py)."""
    for opt, valid in (("rollout", LAYOUTS), ("branch_at", BRANCH_AT),
                       ("branch_token", BRANCH_TOKEN), ("repair", REPAIR_MODES)):
        if getattr(c, opt) not in valid:
            raise ConfigError(f"--{opt.replace('_', '-')}: unknown {getattr(c, opt)!r}; "
                              f"valid: {', '.join(valid)}")
    for opt, ok, valid in (("roots", 1 <= c.roots <= c.G, f"in 1..G ({c.G})"),
                           ("branches", c.branches >= 1, "≥ 1"),
                           ("repair_tries", c.repair_tries >= 1, "≥ 1")):
        if not ok:
            raise ConfigError(f"--{opt.replace('_', '-')}: {getattr(c, opt)!r} is invalid; "
                              f"must be {valid}")
    if c.rollout != "repair" and any(_is_repair_form(n, c) for n in c.objectives):
        raise ConfigError("--objectives: ibpo[form=repair] trains on repairs: it needs "
                          "--rollout repair")
    if c.rollout == "repair" and c.split_groups:
        raise ConfigError("--rollout repair: a repair trains next to the row it corrects; it "
                          "cannot be combined with --split-groups")


def _built(name: str, c: RunConfig) -> bool:
    """Whether validating objective `name` needs building it: parameters or a user's code."""
    from ..core import variants

    return "[" in name or bool(c.objective_params.get(name)) or variants.is_user(name)


def _is_repair_form(name: str, c: RunConfig) -> bool:
    if not _built(name, c):  # a plain name takes its defaults: IBPO's form is ga+la
        return False
    from ..core import objectives

    obj = objectives.get(name, **c.objective_params.get(name, {}))
    return getattr(obj, "form", None) == "repair"
