"""Scoring a policy on the held-out set: the engine behind `gradlab eval`.

A final held-out score mixes two noises: *training* noise (where the run ended up) and
*evaluation* noise (which problems were drawn, which responses were sampled). Three scores, each
per problem and then averaged:

- `accuracy_greedy`   one argmax response per problem (0/1); noise: the problem draw only.
- `accuracy_sampled`  K responses per problem at the sampling temperature, share correct;
                      noise: the problem draw and the K samples (binomial, ~1/√(N·K)).
- `accuracy_expected` the exact probability that one sampled response is correct,
                      Σ_s π(s, EOS | prompt) over the task's correct responses s (teacher-forced
                      log-probs at the temperature). Where it applies it is the limit K → ∞ of
                      `accuracy_sampled` at no sampling cost: its only noise is the problem draw.
                      It applies to tasks whose verifier accepts exactly a known list of response
                      strings (`task.exact_answers`: the built-in arithmetic and scaffold tasks);
                      whitespace around a response, which the verifier also strips, is not summed
                      (a lower bound by the probability of such variants).

Problem draws: eval seed 0 is the loop's own held-out set (`eval_problems`: what `eval_accuracy`
scores during training); seed s > 0 draws N other distinct held-out problems. Sampling noise is
hashed from (seed, row), so a score is a function of (weights, N, K, seed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError, check_model_files, check_types
from ..runs.resume import read_config

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

# torch, numpy and the samplers load on first use: `targets` (what `gradlab eval PATH` scores)
# answers a wrong path or option before any of them (PEP 562 below)
_HELDOUT = ("eval_problems", "expected_accuracy", "heldout_prompts", "is_heldout")
_DRAW_SALT = 1_000_033  # eval seed s > 0 → held-out problem stream s · salt
_NOISE_SALT = 55_555_333  # eval seed → hashed sampling noise


def __getattr__(name: str):
    if name in _HELDOUT:  # re-exported from setup/heldout.py
        from ..setup import heldout

        return getattr(heldout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def heldout_split(task) -> list:
    """Every held-out problem of a task whose space can be listed (`task.all_problems()`: the
    built-in tasks) or of a finite (JSONL) task; ValueError otherwise."""
    from ..setup.heldout import heldout_prompts, is_heldout

    held = heldout_prompts(task)
    if held is not None:
        return [p for p in task.problems(len(task), seed=0) if p.prompt in held]
    if not hasattr(task, "all_problems"):
        raise ValueError(f"{type(task).__name__}: its problem space cannot be listed; give "
                         "--problems a number")
    return [p for p in task.all_problems() if is_heldout(p.prompt)]


def heldout_draw(task, n: int | str, seed: int = 0) -> list:
    """N distinct held-out problems: seed 0 the loop's evaluation set, seed s > 0 another draw
    (fewer than N when a finite task's held-out split is smaller); n = "all": the whole
    held-out split (`heldout_split`, the same for every seed)."""
    from ..setup.heldout import draw_problems, eval_problems, heldout_prompts

    if n == "all":
        return heldout_split(task)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--problems must be a number ≥ 1 or 'all', got {n!r}")
    if seed == 0:
        return eval_problems(task, n)
    held = heldout_prompts(task)
    if held is not None:
        n = min(n, len(held))
    return draw_problems(task, n, seed * _DRAW_SALT, held, want_heldout=True, distinct=True)


def sampled_accuracy(model, tok, task, problems: list, *, samples: int, temperature: float,
                     seed: int, max_new_tokens: int | None = None) -> np.ndarray:
    """(N,) share of `samples` responses per problem that the verifier accepts; temperature 0:
    one argmax response (0/1). Noise hashed from (seed, row)."""
    import numpy as np
    import torch

    from ..rollouts.rollout import generate

    if not problems:
        return np.zeros(0)
    k = 1 if temperature == 0 else samples
    dev = next(model.parameters()).device
    keys = (seed * 1_000_003 + _NOISE_SALT) * 1_000_003 + torch.arange(len(problems) * k)
    with torch.no_grad():
        ro = generate(model, tok, problems, k, max_new_tokens or task.max_new_tokens,
                      temperature, task=task, row_keys=keys.to(dev))
    ok = np.array([task.is_correct(p, t) for p, t in zip(ro.problems, ro.texts)], dtype=float)
    return ok.reshape(len(problems), k).mean(1)


def evaluate_policy(model, tok, task, problems: int | str = 256, *, samples: int = 1, seed: int = 0,
                    temperature: float = 1.0) -> pd.DataFrame:
    """Tidy scores of one policy: columns metric, value, se (standard error over problems),
    n_problems, samples, eval_seed, temperature. Accuracies in 0..1; `accuracy_expected` only
    where the task allows it (module docstring)."""
    import numpy as np
    import pandas as pd

    from ..setup.heldout import expected_accuracy

    if samples < 1:
        raise ValueError(f"--samples must be ≥ 1, got {samples}")
    probs = heldout_draw(task, problems, seed)
    per = {"accuracy_greedy": sampled_accuracy(model, tok, task, probs, samples=1,
                                               temperature=0.0, seed=seed),
           "accuracy_sampled": sampled_accuracy(model, tok, task, probs, samples=samples,
                                                temperature=temperature, seed=seed)}
    if getattr(task, "exact_answers", False):
        per["accuracy_expected"] = expected_accuracy(model, tok, task, probs, temperature)
    rows = []
    for name, v in per.items():
        se = float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")
        rows.append({"metric": name, "value": float(v.mean()) if v.size else float("nan"),
                     "se": se, "n_problems": int(v.size),
                     "samples": samples if name == "accuracy_sampled" else 1,
                     "eval_seed": seed, "temperature": 0.0 if name == "accuracy_greedy" else temperature})
    return pd.DataFrame(rows)


def _checkpoints(path: Path, objective: str | None) -> list[tuple[str, Path]]:
    ck = path / "checkpoints"
    names = sorted(p.name for p in ck.iterdir() if (p / "model.safetensors").is_file()) \
        if ck.is_dir() else []
    if objective is not None:
        if objective not in names:
            raise ConfigError(f"--objective {objective!r}: no checkpoint in {ck}; "
                              f"available: {', '.join(names) or 'none'}")
        names = [objective]
    if not names:
        raise ConfigError(f"{path}: a run folder without checkpoints (nothing to evaluate)")
    return [(n, ck / n) for n in names]


def targets(path: str | Path, objective: str | None = None,
            task: str | None = None) -> tuple[Path | None, list[tuple[str, Path]]]:
    """What `policies` loads, checked without torch: (the run folder, or None for a Hugging
    Face model folder; [(label, checkpoint or model folder)]). A wrong path, objective or task,
    or a run's config.json of the wrong types, is a ConfigError naming it; a folder that is
    none of the three, FileNotFoundError."""
    path = Path(path)
    if (path / "model.safetensors").is_file() and (path / "state.json").is_file():
        run, found = path.parent.parent, [(path.name, path)]  # one checkpoint of a run
    elif (path / "config.json").is_file() and "model_type" not in _json(path / "config.json"):
        run, found = path, _checkpoints(path, objective)  # a run folder
    elif (path / "config.json").is_file():
        check_model_files(path, option="path")
        return None, [(path.name, path)]
    else:
        raise FileNotFoundError(f"{path}: neither a run folder, a checkpoint folder "
                          "(model.safetensors + state.json) nor a model folder (config.json)")
    stored = read_config(run / "config.json")
    check_types(stored, str(run / "config.json"))
    if task is not None and task != stored.get("task"):
        raise ConfigError(f"--task {task!r}: the run at {run} was trained on "
                          f"{stored.get('task')!r}")
    return run, found


def policies(path: str | Path, objective: str | None = None, task: str | None = None,
             device: str = "cpu"):
    """Yield (label, model, tokenizer, task) for a run folder (each objective's final checkpoint,
    or `objective`), one checkpoint folder (run/checkpoints/<objective>) or a Hugging Face model
    folder (then `task`, default arithmetic)."""
    from safetensors.torch import load_file

    from ..config import RunConfig
    from ..setup.policy import load_policy
    from ..setup.task import get_task

    run, found = targets(path, objective, task)
    if run is None:
        model, tok = load_policy(found[0][1], device=device)
        yield found[0][0], model, tok, get_task(task or "arithmetic")
        return
    cfg = RunConfig.from_json(run / "config.json")
    t = get_task(cfg.task, **({"difficulty": cfg.difficulty} if cfg.task == "arithmetic" else {}))
    builtin = cfg.task in ("arithmetic", "scaffold")
    for name, ck in found:
        model, tok = load_policy(cfg.model, task=t if builtin else None, device=device,
                                 trust_remote_code=cfg.trust_remote_code)
        model.load_state_dict(load_file(ck / "model.safetensors"), strict=False)  # tied: once
        yield name, model.eval(), tok, t


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None


def evaluate_path(path: str | Path, problems: int | str = 256, *, samples: int = 1, seed: int = 0,
                  objective: str | None = None, task: str | None = None,
                  temperature: float = 1.0) -> pd.DataFrame:
    """`evaluate_policy` for every policy `policies(path, ...)` yields; a `policy` column."""
    import pandas as pd

    frames = [evaluate_policy(m, tok, t, problems, samples=samples, seed=seed,
                              temperature=temperature).assign(policy=label)
              for label, m, tok, t in policies(path, objective, task)]
    df = pd.concat(frames, ignore_index=True)
    return df[["policy"] + [c for c in df.columns if c != "policy"]]
