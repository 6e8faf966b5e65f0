"""The setup `gradlab audit trl` and its option rows share: workloads, GRPOConfig, the
instrumented trainer on the tiny policy, quiet logs, and ρ's pooled over a run's windows."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass

GSPO_EPS = (3e-4, 4e-4)  # TRL's GSPO recipe, used for every clipped loss at sequence level
OFF_SPG = 4  # optimizer steps per generation batch off-policy (the GSPO recipe)


@dataclass(frozen=True)
class Workload:
    """Prompts (ArithmeticTask at `difficulty` digits) and a reward ("strict" | "odd-length")."""

    name: str
    difficulty: int
    reward: str
    about: str


WORKLOADS = {
    "lengths": Workload("lengths", 3, "odd-length",
                        "3-digit additions (outside the policy's 2-digit training range, so "
                        "responses vary in length but share the 'so ' template); synthetic reward "
                        "1 for an odd number of characters, so rewarded and unrewarded responses "
                        "differ in length"),
    "arithmetic": Workload("arithmetic", 2, "strict",
                           "the default task: 2-digit additions, strict verifier (correct and "
                           "wrong responses mostly have equal lengths)"),
}


# ----------------------------------------------------------------------------- TRL setup


def dataset_and_reward(workload: Workload, n: int, seed: int = 0):
    """(datasets.Dataset of n prompts, a TRL reward function) for a workload."""
    from datasets import Dataset

    from ...loop.setup.task import ArithmeticTask, Problem

    task = ArithmeticTask(difficulty=workload.difficulty)
    probs = task.problems(n, seed=seed)
    ds = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer,
                             "solutions": list(p.solutions)} for p in probs])

    def strict(prompts, completions, answer, solutions, **kw) -> list[float]:
        return [task.reward(Problem(p, a, tuple(s)), c)
                for p, c, a, s in zip(prompts, completions, answer, solutions)]

    def odd_length(prompts, completions, **kw) -> list[float]:
        return [float(len(c) % 2) for c in completions]

    return ds, {"strict": strict, "odd-length": odd_length}[workload.reward]


def grpo_args(loss_type: str, level: str, spg: int, steps: int, out_dir: str, *,
              prompts: int = 4, G: int = 8, lr: float = 1e-3, seed: int = 0,
              max_completion_length: int | None = None, **extra):
    """GRPOConfig for a CPU run: `prompts` × G rows per generation batch, cut into `spg`
    optimizer steps (gradient_accumulation_steps=1), `steps` optimizer steps in all. Clip
    ranges: TRL's defaults at token level, the GSPO recipe at sequence level, ε_high = 5 for
    cispo (TRL's recommendation); `extra` overrides."""
    from trl import GRPOConfig

    from ...loop.setup.task import ArithmeticTask

    kw = dict(  # noqa: C408 (keyword style mirrors GRPOConfig)
        output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to=[], save_strategy="no", disable_tqdm=True, seed=seed,
        per_device_train_batch_size=prompts * G // spg, steps_per_generation=spg,
        gradient_accumulation_steps=1, num_generations=G, max_steps=steps, logging_steps=spg,
        learning_rate=lr, loss_type=loss_type, importance_sampling_level=level,
        max_completion_length=max_completion_length or ArithmeticTask().max_new_tokens)
    if loss_type == "cispo":
        kw["epsilon_high"] = 5.0
    elif level == "sequence":
        kw["epsilon"], kw["epsilon_high"] = GSPO_EPS
    kw.update(extra)
    return GRPOConfig(**kw)


def make_trainer(args, workload: Workload, gradlab=None, instrumented: bool = True,
                 n_prompts: int = 64, cls: type | None = None):
    """A GradlabGRPOTrainer (or `cls`; plain GRPOTrainer when not instrumented) on the shipped
    tiny policy and its char tokenizer, with TRL's per-step printing off."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    from ...loop.setup.policy import load_policy
    from ..trl.trainer import GradlabGRPOTrainer

    model, tok = load_policy()
    ds, reward = dataset_and_reward(workload, n_prompts, seed=args.seed)
    kw = {"model": model, "reward_funcs": reward, "args": args, "train_dataset": ds, "processing_class": tok}
    if instrumented:
        tr = (cls or GradlabGRPOTrainer)(**kw, gradlab=gradlab)
    else:
        tr = GRPOTrainer(**kw)
    tr.remove_callback(PrinterCallback)
    return tr


@contextlib.contextmanager
def quiet():
    """Silence TRL / transformers warnings and info logs."""
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(n) for n in ("transformers", "trl", "accelerate", "datasets")]
    levels = [lg.level for lg in loggers]
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" bars of from_pretrained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)
            if bars:
                hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- measuring


def pool_windows(windows: list, objective=None) -> dict[str, float]:
    """ρ's pooled over windows (Σ|d| / Σ|W|), split share, closed-form ρ and attribution."""
    from ...core.batch import split_share
    from ...core.cancellation import attribution_sums, cancellation, stepwise_residual
    from ...core.nodes import shared_nodes

    acc = dict.fromkeys(("res", "mass", "res_step", "res_trie", "mass_trie", "res_cf", "mass_cf"), 0.0)
    shares, split = dict.fromkeys(("coupling", "length", "clip", "residual"), 0.0), []
    for w in windows:
        trie = shared_nodes(w.batch, "trie")
        sn = trie.full_group()
        c, ct = cancellation(w.W, w.batch, sn=sn), cancellation(w.W, w.batch, sn=trie)
        acc["res"] += c.residual
        acc["mass"] += c.mass
        acc["res_trie"] += ct.residual
        acc["mass_trie"] += ct.mass
        acc["res_step"] += stepwise_residual(w.W, sn, w.opt)[0]
        split.append(split_share(w.batch.group, w.opt))
        if objective is not None:
            cf = cancellation(objective.modulation(w.batch), w.batch, sn=sn)
            acc["res_cf"] += cf.residual
            acc["mass_cf"] += cf.mass
            att = attribution_sums(objective, w.batch, "prefix")  # res − res_off: they add
            for k in shares:
                shares[k] += att[k]
    r = lambda a, b: acc[a] / acc[b] if acc[b] > 0 else math.nan  # Σ|W| = 0: undefined
    out = {"rho": r("res", "mass"), "rho_trie": r("res_trie", "mass_trie"),
           "rho_step": r("res_step", "mass"), "split": sum(split) / len(split) if split else math.nan}
    # Share of the per-step residual that splitting adds; undefined (NaN, printed "—") when the
    # per-step residual is nothing but round-off (≤ 1e-6 of the mass): nothing to attribute.
    real = acc["res_step"] > 1e-6 * acc["mass"]
    out["split_attr"] = (acc["res_step"] - acc["res"]) / acc["res_step"] if real else math.nan
    if objective is not None:
        out["rho_closed_form"] = r("res_cf", "mass_cf")
        res = shares.pop("residual")  # Σ res of the same batches and nodes as the numerators
        out.update({f"attr_{k}": v / res if res > 0 else math.nan for k, v in shares.items()})
    return out
