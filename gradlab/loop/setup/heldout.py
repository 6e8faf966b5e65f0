"""Held-out evaluation: a problem set disjoint from the training prompts by construction.

The split is a pure function of a problem's prompt, so no run, seed or step can move a problem
across it:
- tasks with an unbounded problem space (arithmetic, scaffold): a prompt is held out iff the
  SHA-1 of its text falls in the first 1/`EVAL_BUCKETS` of the hash range (~12.5 %);
- tasks with a finite list of lines (JSONL, anything with `len`): the floor(1/8) share of the
  distinct prompts with the smallest SHA-1 is held out (0 lines for a file of < 8 prompts:
  training never runs out of lines, and the evaluation is then empty and skipped).
Training draws through `TrainSplit.problems` (held-out problems skipped, the task's own stream
order kept); the evaluation set is `eval_problems`, a fixed list of distinct held-out problems
(the same for every seed and objective). `evaluate_heldout` scores a policy on it, greedy and
sampled at the training temperature with fixed hashed noise (common random numbers across
evaluation steps and objectives: the numbers are a function of the weights alone).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..numerics.logprobs import token_logps
from ..numerics.precision import autocast
from ..rollouts.rollout import encode_pairs, generate

EVAL_BUCKETS = 8  # 1 in 8 of the problem space is held out
_EVAL_SEED = 2_147_483_647  # the problem stream the evaluation set is drawn from
_EVAL_NOISE = 987_654_321  # salt of the sampled evaluation's hashed noise


def _h(prompt: str) -> int:
    return int.from_bytes(hashlib.sha1(prompt.encode("utf-8")).digest()[:8], "big")


def _finite(task) -> bool:
    return hasattr(task, "__len__")


def heldout_prompts(task) -> frozenset[str] | None:
    """The held-out prompts of a finite task (a set), or None for an unbounded problem space."""
    if not _finite(task):
        return None
    prompts = sorted({p.prompt for p in task.problems(len(task), seed=0)}, key=_h)
    return frozenset(prompts[: len(prompts) // EVAL_BUCKETS])


def is_heldout(prompt: str, held: frozenset[str] | None = None) -> bool:
    """True iff `prompt` belongs to the evaluation side of the split (see the module docstring);
    `held`: the task's `heldout_prompts` (None: the hash-bucket rule)."""
    if held is not None:
        return prompt in held
    return _h(prompt) % EVAL_BUCKETS == 0


def draw_problems(task, n: int, seed: int, held: frozenset[str] | None, want_heldout: bool,
                  distinct: bool = False) -> list:
    """The first `n` problems of the task's stream(s) on the requested side of the split
    (`want_heldout`; `held` the task's `heldout_prompts`), each prompt once if `distinct`: chunk
    k is task.problems(2n + 8, seed) for k = 0, then derived seeds (deterministic). Fewer than
    `n` when 100 chunks in a row add nothing (a small problem space, e.g. 1-digit sums)."""
    out, seen, idle = [], set(), 0
    for k in range(10_000):
        before = len(out)
        chunk = task.problems(2 * n + 8, seed=seed if k == 0 else seed * 1_000_003 + 7919 * k)
        for p in chunk:
            if is_heldout(p.prompt, held) == want_heldout and not (distinct and p.prompt in seen):
                out.append(p)
                seen.add(p.prompt)
                if len(out) == n:
                    return out
        idle = 0 if len(out) > before else idle + 1
        if idle >= 100:
            break
    return out


class TrainSplit:
    """The task with its held-out problems removed from `problems`; everything else (reward,
    verifier, key, max_new_tokens …) is the wrapped task's."""

    def __init__(self, task):
        self.task = task
        self.held = heldout_prompts(task)

    def __getattr__(self, name: str):
        return getattr(self.task, name)

    def problems(self, n: int, seed: int) -> list:
        """`n` training problems, deterministic in seed; never a held-out one."""
        return draw_problems(self.task, n, seed, self.held, want_heldout=False)


def eval_problems(task, size: int) -> list:
    """Up to `size` distinct held-out problems, fixed for the task (independent of the run)."""
    held = heldout_prompts(task)
    if held is not None and not held:
        return []
    if held is not None:
        size = min(size, len(held))
    return draw_problems(task, size, _EVAL_SEED, held, want_heldout=True, distinct=True)


@torch.no_grad()
def evaluate_heldout(model, tok, task, problems: list, *, temperature: float, max_new_tokens: int,
                     seed: int, amp: bool = False) -> dict:
    """Accuracy on `problems`, one response each: `eval_accuracy` sampled at `temperature`
    (noise hashed from (seed, row): the same at every call), `eval_accuracy_greedy` (argmax),
    and, where the verifier accepts a known list of strings (`task.exact_answers`),
    `eval_accuracy_expected`: the exact probability that one sample is correct, averaged over
    the problems (no sampling noise; loop/recipes/evaluation.py)."""
    if not problems:
        return {}
    out = {}
    dev = next(model.parameters()).device
    keys = (seed * 1_000_003 + _EVAL_NOISE) * 1_000_003 + torch.arange(len(problems))
    for name, temp in (("eval_accuracy", temperature), ("eval_accuracy_greedy", 0.0)):
        ro = generate(model, tok, problems, 1, max_new_tokens, temp, amp=amp, task=task,
                      row_keys=keys.to(dev))
        out[name] = sum(task.is_correct(p, t) for p, t in zip(ro.problems, ro.texts)) / len(problems)
    if getattr(task, "exact_answers", False):
        with autocast(dev, amp):
            out["eval_accuracy_expected"] = float(
                expected_accuracy(model, tok, task, problems, temperature).mean())
    return out


@torch.no_grad()
def expected_accuracy(model, tok, task, problems: list, temperature: float = 1.0,
                      chunk: int = 256) -> np.ndarray:
    """(N,) float64: probability that one response sampled at `temperature` is correct,
    Σ_s π(s, EOS | prompt) over `task.solutions(problem)` (teacher-forced log-probs, the
    training path), for a task whose verifier accepts exactly those strings
    (`task.exact_answers`); whitespace variants the verifier also strips are not summed."""
    if not getattr(task, "exact_answers", False):
        raise ValueError(f"accuracy_expected needs a task whose correct responses are a known "
                         f"list of strings; {type(task).__name__} is scored by samples only")
    was = model.training
    model.eval()
    sols = [task.solutions(p) for p in problems]
    k = len(sols[0]) if sols else 0
    prompts = [p.prompt for p, s in zip(problems, sols) for _ in s]
    resp = [x for s in sols for x in s]
    dev = next(model.parameters()).device
    out = []
    for s in range(0, len(resp), chunk):
        pid, pm, rid, rm = encode_pairs(tok, prompts[s:s + chunk], resp[s:s + chunk], dev)
        lp = token_logps(model, pid, pm, rid, rm, temperature=temperature)  # (c, T) nats
        out.append((lp.double() * rm).sum(-1).exp().cpu())
    model.train(was)
    if not out:
        return np.zeros(0)
    return torch.cat(out).view(len(problems), k).sum(-1).numpy()
