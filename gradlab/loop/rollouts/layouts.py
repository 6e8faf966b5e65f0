"""Rollout layouts (`--rollout`) and what they are measured by.

- independent: G responses per prompt, each sampled from scratch (`rollout.generate`).
- tree: roots and branches re-sampled from chosen prefixes, G per group (`tree.generate_tree`).
- repair: G independent responses plus a corrected path per incorrect response whose group
  has a correct one; a group then holds G + its repairs rows (`repair.generate_repair`).

Every layout keys its noise by (seed, step, global group, path), so data-parallel ranks and
resumed runs sample the same groups. `layout_sums` gives the per-rollout-step accounting as
sums over groups (reduced over ranks by `StepMetrics`):

  generated_tokens     tokens the sampler newly produced (a branch or a re-sampled repair counts
                       only what follows its prefix; failed repair tries count too)
  trained_tokens       response tokens that enter the loss (shared prefixes count per row)
  distinct_responses / duplicate_responses   per group: distinct token sequences / rows − that
  branch_points        prefix-trie nodes of a group with ≥ 2 distinct next tokens
  informative_points   branch points whose children differ in mean reward
  branch_depth_sum     Σ response position of the branch points (→ mean depth `branch_depth`)
  repairs_tried / repairs_kept / edited_tokens   repair candidates, repairs added, and Σ over
                       kept repairs of the tokens between their first and last difference
                       from the row they correct (`repair.edited_span`)

Compute matching: layouts are compared at equal *generated* tokens (what sampling costs), not
equal rows or trained tokens. Σ generated_tokens over a run is in its metrics; to match, give
each layout the number of rollout steps that brings its Σ generated_tokens to the budget (the
independent layout's steps × its generated tokens per step), or compare runs at equal
cumulative generated_tokens (see docs/guides/rollouts.md).
"""

from __future__ import annotations

import torch

from .rollout import Rollout, generate
from .spec import SamplingSpec


def sample(model, tokenizer, problems: list, spec: SamplingSpec, row_keys: torch.Tensor,
           task=None) -> Rollout:
    """This rank's rollout of `problems` in the layout `spec.layout`; row_keys
    (len(problems)·spec.G,) long are the independent layout's row keys (tree paths and
    repaired rows derive theirs). task: rewards are scored when given (repair needs it)."""
    if spec.layout == "tree":
        from .tree import generate_tree

        return generate_tree(model, tokenizer, problems, spec, row_keys, task=task)
    if spec.layout == "repair":
        from .repair import generate_repair

        return generate_repair(model, tokenizer, problems, spec, row_keys, task)
    return generate(model, tokenizer, problems, spec.G, spec.max_new_tokens, spec.temperature,
                    amp=spec.amp, task=task, row_keys=row_keys, max_prompt_len=spec.max_prompt_len)


def sample_layout(cfg, model, tok, problems: list, task, keys: torch.Tensor) -> Rollout:
    """This rank's rollout of `problems` under the RunConfig `cfg` (`SamplingSpec.from_config`,
    then `sample`); keys (len(problems)·G,) are the independent layout's row keys."""
    return sample(model, tok, problems, SamplingSpec.from_config(cfg, task), keys, task)


def _trie_points(seqs: list[tuple], rewards: list[float]) -> tuple[int, int, int]:
    """(branch points, informative ones, Σ their depths) of one group's prefix trie."""
    root: dict = {}
    for s, r in zip(seqs, rewards):
        node = root
        for tokn in s:
            child = node.setdefault(tokn, [{}, []])
            child[1].append(r)
            node = child[0]
    bp = inf = depth = 0
    stack = [(root, 0)]
    while stack:
        node, t = stack.pop()
        if len(node) >= 2:
            means = [sum(c[1]) / len(c[1]) for c in node.values()]
            bp += 1
            depth += t
            inf += max(means) - min(means) > 1e-9
        stack.extend((c[0], t + 1) for c in node.values())
    return bp, inf, depth


def layout_sums(ro: Rollout) -> dict[str, float]:
    """The accounting of the module docstring for this rank's rollout, as sums over its groups."""
    from .repair import edited_span

    ids, mask = ro.response_ids.cpu(), ro.response_mask.cpu()
    seqs = [tuple(r[m].tolist()) for r, m in zip(ids, mask)]
    rewards = ro.rewards.cpu().tolist()
    group = ro.group.cpu().tolist()
    out = dict.fromkeys(("distinct_responses", "duplicate_responses", "branch_points",
                         "informative_points", "branch_depth_sum"), 0)
    for g in sorted(set(group)):
        rows = [i for i, x in enumerate(group) if x == g]
        distinct = len({seqs[i] for i in rows})
        bp, inf, depth = _trie_points([seqs[i] for i in rows], [rewards[i] for i in rows])
        for k, v in zip(out, (distinct, len(rows) - distinct, bp, inf, depth)):
            out[k] += v
    out["generated_tokens"] = int(ro.new_tokens.sum()) + ro.discarded_tokens
    out["trained_tokens"] = int(mask.sum())
    rep = ro.repair_of.cpu() if ro.repair_of is not None else torch.zeros(0, dtype=torch.long)
    r = (rep >= 0).nonzero().squeeze(-1)
    eff = torch.where(mask, ids, -1)
    edited = edited_span(torch.where(mask[rep[r]], ids[rep[r]], -2), mask[rep[r]].sum(-1),
                         eff[r], mask[r].sum(-1)) if r.numel() else torch.zeros(0)
    out.update(repairs_tried=ro.repairs_tried, repairs_kept=int(r.numel()),
               edited_tokens=int(edited.sum()))
    return out
