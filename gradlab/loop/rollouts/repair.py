"""Repair rollouts: G independent responses per group, then a corrected path for each incorrect
response whose group holds a correct one (docs/concepts/ibpo.md#reading-2-credit-on-the-edited-tokens-of-a-repair).

For an incorrect row i the reference is the correct row of its group that agrees with it
longest from the start (ties: the lower row); the departure d is the first response position
where the two token sequences differ (`first_departure`). The repair keeps i's tokens before
the position it starts from (d, except for "local"):
- "resample": the policy re-samples the continuation from d (reusing i's KV cache, as a tree
  branch does), up to `tries` times; the first correct try is kept, a repair whose tries all
  fail adds no row. With branch_token "alternative" the token at d may not be i's own.
- "splice": the reference's tokens from d on. Since i and the reference agree before d, the
  repair equals the reference as a token sequence; it costs no sampling. Its old log-probs are
  teacher-forced (`token_logps` on the spliced row).
- "local": repair i as late as possible. Try k (k = 0..tries−1) re-samples the continuation
  from position p_k = max(e − 1, d) − k of i, where e is the position of i's stop token (its
  length if it has none): the last token before the stop first, then one position earlier per
  try, never before d; the first correct try is kept (KV cache reused as in "resample"). This is
  our reading of "local repair works better than rewriting" (docs/concepts/ibpo.md): edit the fewest final
  tokens that fix the response. Why late positions: any p > d lies in i's own branch (no correct
  row shares i's first p + 1 tokens, since the reference is the longest-agreeing one), so a
  correct try that leaves i at q ≥ p makes the trie node i[:q] informative (children: i,
  incorrect; the repair, correct), a node no sampled row made informative; at p = d the
  reference already parts from i. And a try generates only L − p tokens. A response wrong early
  on (its error before the last `tries` positions) is not fixed by a local repair.
Each repair joins its group with `repair_of` = the row of i in the returned Rollout (rows are
group-major: a group's G sampled rows, then its repairs in the order of the rows they repair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics.logprobs import token_logps
from .rollout import Rollout
from .spec import Decoding, SamplingSpec
from .tree import Paths, assemble, branch, mix_keys, sample_roots


def first_departure(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M,) long: the first position where rows of a and b (M, T) differ; T where none do.
    Give masked-out positions distinct fill values (e.g. −1 and −2) so a length difference
    counts as a departure."""
    neq = a != b
    T = a.shape[-1]
    return torch.where(neq.any(-1), neq.long().argmax(-1), torch.full_like(neq[:, 0], T, dtype=torch.long))


def edited_span(a: torch.Tensor, la: torch.Tensor, b: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """(M,) long: tokens of b (M, T) between its first and its last difference from a: b's
    length minus the common prefix and the common suffix (which may not overlap the prefix).
    la/lb (M,): lengths. a and b should hold distinct fills past their lengths."""
    d = first_departure(a, b)
    T = a.shape[-1]
    t = torch.arange(T, device=a.device)
    ia, ib = (la[:, None] - 1 - t).clamp(min=0), (lb[:, None] - 1 - t).clamp(min=0)
    ok = (t < torch.minimum(la, lb)[:, None]) & (a.gather(1, ia) == b.gather(1, ib))
    suffix = ok.long().cumprod(-1).sum(-1)  # trailing tokens equal, counted from the end
    suffix = torch.minimum(suffix, torch.minimum(la, lb) - d)
    return (lb - d - suffix).clamp(min=0)


def repair_plan(tokens: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor,
                group: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row i, reference row, departure d) for every incorrect row whose group has a correct
    one and that can continue at d (d < T). tokens/mask (N, T), correct (N,) bool, group (N,)."""
    eff = torch.where(mask, tokens, torch.full_like(tokens, -1))
    T = tokens.shape[1]
    out = []
    for g in torch.unique(group).tolist():
        rows = (group == g).nonzero().squeeze(-1)
        good, bad = rows[correct[rows]], rows[~correct[rows]]
        if good.numel() == 0:
            continue
        for i in bad.tolist():
            d = first_departure(eff[i].expand(good.numel(), T), eff[good])
            k = int(torch.argmax(d))  # longest agreement; argmax returns the first (lowest row)
            if int(d[k]) < T:
                out.append((i, int(good[k]), int(d[k])))
    return out


@dataclass
class RepairRows:
    """The sampled rows of a repair rollout, group-major (N = n·G): prompt_ids/prompt_mask
    (N, P), problems (N,) the Problem of each row, keys (N,) long noise keys, group (N,) long."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    problems: list
    keys: torch.Tensor
    group: torch.Tensor


@torch.no_grad()
def generate_repair(model, tokenizer, problems: list, spec: SamplingSpec,
                    row_keys: torch.Tensor, task) -> Rollout:
    """spec.G independent responses per problem (keyed like `rollout.generate`, the same rows)
    plus the repairs of the module docstring (spec.repair, spec.repair_tries,
    spec.branch_token). Returns a Rollout with `repair_of`, `parent` and `branch_at` (= the
    repaired row and the position its repair re-samples or splices from: d, or a local
    repair's p_k; −1 elsewhere), `generated` (a sampled repair: its tokens from branch_at; a
    splice: 0), `repairs_tried` (candidates) and `discarded_tokens` (tokens sampled by failed
    tries). row_keys (len(problems)·G,) long; task: scores the rows and judges the tries."""
    from ..numerics.precision import autocast
    from .rollout import _encode_prompts, check_prompt_lengths

    G = spec.G
    if spec.repair_tries < 1 or spec.temperature <= 0:
        raise ValueError(f"repair {spec.repair!r}, tries {spec.repair_tries} (≥ 1), "
                         f"temperature {spec.temperature} (> 0)")
    device = next(model.parameters()).device
    dec, n = Decoding.of(spec, model, tokenizer), len(problems)
    problem_of_row = [p for p in problems for _ in range(G)]
    prompt_ids, prompt_mask = _encode_prompts(tokenizer, [p.prompt for p in problem_of_row],
                                              device)  # (N, P)
    check_prompt_lengths(prompt_mask.sum(-1)[::G].tolist(), spec.max_prompt_len,
                         getattr(model.config, "max_position_embeddings", None), spec.max_new_tokens)
    rows = RepairRows(prompt_ids, prompt_mask, problem_of_row, row_keys.to(device),
                      torch.arange(n * G, device=device) // G)
    was_training = model.training
    model.eval()
    try:
        with autocast(device, spec.amp):
            base = sample_roots(model, prompt_ids, prompt_mask, rows.keys, dec)
            first = assemble(tokenizer, dec, prompt_ids, prompt_mask, problems=problem_of_row,
                             group=rows.group, parts=[base], pick=[(0, r) for r in range(n * G)])
            correct = torch.tensor([task.is_correct(p, t)
                                    for p, t in zip(problem_of_row, first.texts)], device=device)
            plan = repair_plan(base.tokens, base.mask, correct, rows.group)
            if spec.repair == "splice":
                parts, kept, discarded = _splice(model, base, plan, rows, dec)
            else:
                parts, kept, discarded = _resample(model, tokenizer, task, base, plan=plan,
                                                   rows=rows, spec=spec, dec=dec)
    finally:
        model.train(was_training)
    return _repair_rollout(tokenizer, rows, parts, kept=kept, tried=len(plan), discarded=discarded,
                           dec=dec, task=task)


def local_positions(tokens: torch.Tensor, mask: torch.Tensor, d: torch.Tensor,
                    stops: list[int]) -> torch.Tensor:
    """(M,) long: the first position a local repair tries, max(e − 1, d), where e is the
    position of each row's stop token (its length if it has none); try k starts at this − k
    while that is ≥ d. tokens/mask (M, T); d (M,): departures."""
    L = mask.sum(-1)
    last = tokens.gather(1, (L - 1).clamp(min=0)[:, None]).squeeze(-1)
    stopped = (L > 0) & torch.isin(last, torch.tensor(stops, device=tokens.device))
    return torch.maximum(torch.where(stopped, L - 1, L) - 1, d)


def _resample(model, tokenizer, task, base: Paths, *, plan, rows: RepairRows, spec: SamplingSpec,
              dec: Decoding):
    """Up to spec.repair_tries re-samples of each planned repair, from its departure d, or
    (repair "local") from the positions of `local_positions` walking back to d; the first
    correct one is kept. Returns (parts, kept {row i: (part, row in part, position)}, tokens
    sampled by failed tries)."""
    from .rollout import _decode

    local = spec.repair == "local"
    parts, kept, discarded = [base], {}, 0
    todo = [(i, d) for i, _, d in plan]  # (row, departure) still to repair
    top = {}  # local: row -> the first position tried
    dev = rows.prompt_ids.device
    if local and todo:
        bad = torch.tensor([i for i, _ in todo], device=dev)  # (M,) rows to repair
        departure = torch.tensor([d for _, d in todo], device=dev)  # (M,)
        top = dict(zip(bad.tolist(), local_positions(base.tokens[bad], base.mask[bad], departure,
                                                     list(dec.stops)).tolist()))
    for attempt in range(spec.repair_tries):
        todo = [(i, d) for i, d in todo if not local or top[i] - attempt >= d]  # positions left
        if not todo:
            break
        idx = torch.tensor([i for i, _ in todo], device=dev)  # (M,) rows repaired this try
        at = torch.tensor([top[i] - attempt if local else d for i, d in todo], device=dev)  # (M,)
        child = branch(model, base, idx, at, mix_keys(rows.keys[idx], 1 + attempt),
                       prompt_last=rows.prompt_ids[idx, -1],
                       prompt_len=rows.prompt_mask[idx].sum(-1), alternative=spec.alternative,
                       dec=dec)
        texts = _decode(tokenizer, child.tokens, child.mask, dec.stops)
        parts.append(child)
        left = []
        for r, ((i, d), text) in enumerate(zip(todo, texts)):
            if task.is_correct(rows.problems[i], text):
                kept[i] = (len(parts) - 1, r, int(at[r]))
            else:
                discarded += int(child.lengths[r] - at[r])
                left.append((i, d))
        todo = left
    return parts, kept, discarded


def _splice(model, base: Paths, plan, rows: RepairRows, dec: Decoding):
    """Each planned repair as row i before d and the reference from d on; old log-probs by
    teacher forcing. Returns (parts, kept, 0)."""
    if not plan:
        return [base], {}, 0
    dev, T = rows.prompt_ids.device, dec.max_new_tokens
    i, ref, d = (torch.tensor(c, device=dev) for c in zip(*plan))
    pos = torch.arange(T, device=dev)
    head = pos < d[:, None]  # (M, T) positions kept from row i
    tokens = torch.where(head, base.tokens[i], base.tokens[ref])
    mask = torch.where(head, base.mask[i], base.mask[ref])
    logps = token_logps(model, rows.prompt_ids[i], rows.prompt_mask[i], tokens, mask,
                        dec.temperature)
    zero = torch.zeros_like(logps)
    part = Paths(tokens, logps, zero, mask, d, None, head[:, :0], head[:, :0].long())
    return [base, part], {int(r): (1, k, int(d[k])) for k, r in enumerate(i.tolist())}, 0


def _repair_rollout(tokenizer, rows: RepairRows, parts: list[Paths], *, kept: dict, tried: int,
                    discarded: int, dec: Decoding, task) -> Rollout:
    """Group-major rows: each group's sampled rows, then its repairs (module docstring)."""
    from .rollout import score

    group = rows.group
    dev = group.device
    G = int((group == 0).sum())
    pick, src, repair_of, branch_at = [], [], [], []
    for g in range(int(group.max()) + 1 if group.numel() else 0):
        first = len(pick)
        for r in range(g * G, (g + 1) * G):
            pick.append((0, r)), src.append(r), repair_of.append(-1), branch_at.append(-1)
        for i in sorted(k for k in kept if int(group[k]) == g):
            pick.append(kept[i][:2]), src.append(i), repair_of.append(first + i - g * G)
            branch_at.append(kept[i][2])
    src_t = torch.tensor(src, device=dev)
    rep = torch.tensor(repair_of, device=dev)
    at = torch.tensor(branch_at, device=dev)
    ro = assemble(tokenizer, dec, rows.prompt_ids[src_t], rows.prompt_mask[src_t],
                  problems=[rows.problems[i] for i in src], group=group[src_t], parts=parts,
                  pick=pick, repair_of=rep,
                  parent=rep, branch_at=at, repairs_tried=tried, discarded_tokens=discarded)
    spliced = rep >= 0
    if len(parts) > 1 and parts[1].cache is None:  # splice: nothing was sampled
        ro.generated = torch.where(spliced, 0, ro.lengths)
    else:
        ro.generated = torch.where(spliced, ro.lengths - at, ro.lengths)
    score(task, ro)
    return ro
