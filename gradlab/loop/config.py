"""Run configuration: one dataclass, validated with errors that name the option at fault."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .faults.errors import ConfigError

DEFAULT_OBJECTIVES = ("grpo", "gspo", "dfpo-min", "dfpo-orth")
MODES = ("tandem", "same-batch")
# the rollout layouts' option values, here so validation needs no sampler code
LAYOUTS = ("independent", "tree", "repair")  # --rollout (rollouts/layouts.py)
BRANCH_AT = ("entropy", "uniform")  # --branch-at (rollouts/tree.py)
BRANCH_TOKEN = ("sample", "alternative")  # --branch-token
REPAIR_MODES = ("resample", "splice", "local")  # --repair (rollouts/repair.py)


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
    probes: bool = True
    drift: bool = True
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
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"config {path}: unknown option(s) {unknown}; valid: {sorted(known)}")
        return cls(**data)


def validate(c: RunConfig) -> None:
    from ..core import objectives, variants
    from ..core.batch import ADVANTAGE_SCALES

    if not c.objectives:
        raise ConfigError("--objectives: give at least one objective")
    for name in c.objectives:  # a name, optionally with [key=value, ...] (core/variants.py)
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
    if c.micro_batch is not None:
        if c.micro_batch < 1 or c.micro_batch % c.G:
            raise ConfigError(f"--micro-batch: {c.micro_batch} is not a positive multiple of --G "
                              f"{c.G} (micro-batches hold whole groups)")
        if c.split_groups:
            raise ConfigError("--micro-batch needs whole groups in every optimizer step: it "
                              "cannot be combined with --split-groups")
    _validate_layout(c)
    bad_log = sorted(set(filter(None, c.log.split(","))) - {"tensorboard", "trackio"})
    if bad_log:
        raise ConfigError(f"--log: unknown {bad_log}; valid: tensorboard, trackio (comma-separated)")
    if c.attn not in ("auto", "eager", "sdpa"):
        raise ConfigError(f"--attn: unknown {c.attn!r}; valid: auto, eager, sdpa")
    if c.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"--on-nonfinite: unknown {c.on_nonfinite!r}; valid: stop, skip")
    if c.mode not in MODES:
        raise ConfigError(f"--mode: unknown {c.mode!r}; valid: {', '.join(MODES)}")
    if c.mode == "same-batch" and not c.probes:
        raise ConfigError("--mode same-batch measures the other objectives: it needs --probes")
    if c.adv_scale not in ADVANTAGE_SCALES:
        raise ConfigError(f"--adv-scale: unknown {c.adv_scale!r}; valid: {', '.join(ADVANTAGE_SCALES)}")
    if c.model is not None and not (Path(c.model) / "config.json").is_file():
        raise ConfigError(f"--model: no Hugging Face model folder (config.json) at {c.model}")
    if c.model is not None:
        from .faults.untrusted import check_remote_code

        check_remote_code(c.model, c.trust_remote_code)  # auto_map: refused unless trusted
    if not (c.device == "cpu" or c.device.startswith("cuda")):
        raise ConfigError(f"--device: {c.device!r}; valid: cpu, cuda, cuda:N")
    if c.task not in ("arithmetic", "scaffold") and not (c.task.endswith(".jsonl") and Path(c.task).is_file()):
        raise ConfigError(f"--task: {c.task!r}; valid: arithmetic, scaffold or a path to an existing .jsonl file")
    if c.task.endswith(".jsonl"):
        from .faults.untrusted import check_task_size

        check_task_size(c.task)  # refused from its size, before anything reads it



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


def _is_repair_form(name: str, c: RunConfig) -> bool:
    from ..core import objectives

    obj = objectives.get(name, **c.objective_params.get(name, {}))
    return getattr(obj, "form", None) == "repair"
