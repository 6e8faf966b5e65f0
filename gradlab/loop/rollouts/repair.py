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

import torch

from ..config import REPAIR_MODES
from ..numerics.logprobs import token_logps
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


@torch.no_grad()
def generate_repair(model, tokenizer, problems: list, G: int, max_new_tokens: int,
                    temperature: float, row_keys: torch.Tensor, task, mode: str = "resample",
                    tries: int = 4, branch_token: str = "sample", amp: bool = False,
                    max_prompt_len: int | None = None):
    """G independent responses per problem (keyed like `rollout.generate`, the same rows) plus
    the repairs of the module docstring. Returns a Rollout with `repair_of`, `parent` and
    `branch_at` (= the repaired row and the position its repair re-samples or splices from: d,
    or a local repair's p_k; −1 elsewhere), `generated` (a sampled repair: its tokens from
    branch_at; a splice: 0), `repairs_tried` (candidates) and
    `discarded_tokens` (tokens sampled by failed tries)."""
    from ..numerics.precision import autocast
    from .rollout import _encode_prompts, check_prompt_lengths, score, stop_ids

    if mode not in REPAIR_MODES or tries < 1 or temperature <= 0:
        raise ValueError(f"repair {mode!r} (valid: {REPAIR_MODES}), tries {tries} (≥ 1), "
                         f"temperature {temperature} (> 0)")
    dev = next(model.parameters()).device
    stops, n_vocab, n = stop_ids(model, tokenizer), len(tokenizer), len(problems)
    rows = [p for p in problems for _ in range(G)]
    pids, pmask = _encode_prompts(tokenizer, [p.prompt for p in rows], dev)
    check_prompt_lengths(pmask.sum(-1)[::G].tolist(), max_prompt_len,
                         getattr(model.config, "max_position_embeddings", None), max_new_tokens)
    keys = row_keys.to(dev)
    group = torch.arange(n * G, device=dev) // G
    was_training = model.training
    model.eval()
    try:
        with autocast(dev, amp):
            base = sample_roots(model, pids, pmask, keys, max_new_tokens, temperature, stops,
                                n_vocab)
            first = assemble(tokenizer, stops, pids, pmask, rows, group, [base],
                             [(0, r) for r in range(n * G)], temperature)
            correct = torch.tensor([task.is_correct(p, t) for p, t in zip(rows, first.texts)],
                                   device=dev)
            plan = repair_plan(base.tokens, base.mask, correct, group)
            args = (model, tokenizer, task, base, plan, pids, pmask, rows, keys, max_new_tokens,
                    temperature, stops, n_vocab)
            alt = branch_token == "alternative"
            if mode == "splice":
                parts, kept, discarded = _splice(*args)
            else:
                parts, kept, discarded = _resample(*args, tries, alt, mode == "local")
    finally:
        model.train(was_training)
    return _repair_rollout(tokenizer, stops, pids, pmask, rows, group, parts, kept, len(plan),
                           temperature, task, score, discarded)


def local_positions(tokens: torch.Tensor, mask: torch.Tensor, d: torch.Tensor,
                    stops: list[int]) -> torch.Tensor:
    """(M,) long: the first position a local repair tries, max(e − 1, d), where e is the
    position of each row's stop token (its length if it has none); try k starts at this − k
    while that is ≥ d. tokens/mask (M, T); d (M,): departures."""
    L = mask.sum(-1)
    last = tokens.gather(1, (L - 1).clamp(min=0)[:, None]).squeeze(-1)
    stopped = (L > 0) & torch.isin(last, torch.tensor(stops, device=tokens.device))
    return torch.maximum(torch.where(stopped, L - 1, L) - 1, d)


def _resample(model, tokenizer, task, base: Paths, plan, pids, pmask, rows, keys, T,
              temperature, stops, n_vocab, tries: int, alternative: bool, local: bool = False):
    """Up to `tries` re-samples of each planned repair, from its departure d, or (`local`)
    from the positions of `local_positions` walking back to d; the first correct one is kept.
    Returns (parts, kept {row i: (part, row in part, position)}, tokens sampled by failed tries)."""
    from .rollout import _decode

    parts, kept, discarded = [base], {}, 0
    todo = [(i, d) for i, _, d in plan]
    top = {}
    if local and todo:
        i_t = torch.tensor([i for i, _ in todo], device=pids.device)
        d_t = torch.tensor([d for _, d in todo], device=pids.device)
        top = dict(zip(i_t.tolist(), local_positions(base.tokens[i_t], base.mask[i_t], d_t,
                                                     stops).tolist()))
    for k in range(tries):
        todo = [(i, d) for i, d in todo if not local or top[i] - k >= d]  # positions left
        if not todo:
            break
        idx = torch.tensor([i for i, _ in todo], device=pids.device)
        at = torch.tensor([top[i] - k if local else d for i, d in todo], device=pids.device)
        plen = pmask[idx].sum(-1)
        child = branch(model, base, idx, at, mix_keys(keys[idx], 1 + k), pids[idx, -1], plen,
                       alternative, T, temperature, stops, n_vocab)
        texts = _decode(tokenizer, child.tokens, child.mask, stops)
        parts.append(child)
        left = []
        for r, ((i, d), text) in enumerate(zip(todo, texts)):
            if task.is_correct(rows[i], text):
                kept[i] = (len(parts) - 1, r, int(at[r]))
            else:
                discarded += int(child.lengths[r] - at[r])
                left.append((i, d))
        todo = left
    return parts, kept, discarded


def _splice(model, tokenizer, task, base: Paths, plan, pids, pmask, rows, keys, T,
            temperature, stops, n_vocab):
    """Each planned repair as row i before d and the reference from d on; old log-probs by
    teacher forcing. Returns (parts, kept, 0)."""
    if not plan:
        return [base], {}, 0
    dev = pids.device
    i, ref, d = (torch.tensor(c, device=dev) for c in zip(*plan))
    pos = torch.arange(T, device=dev)
    head = pos < d[:, None]
    tokens = torch.where(head, base.tokens[i], base.tokens[ref])
    mask = torch.where(head, base.mask[i], base.mask[ref])
    logps = token_logps(model, pids[i], pmask[i], tokens, mask, temperature)
    zero = torch.zeros_like(logps)
    part = Paths(tokens, logps, zero, mask, d, None, head[:, :0], head[:, :0].long())
    return [base, part], {int(r): (1, k, int(d[k])) for k, r in enumerate(i.tolist())}, 0


def _repair_rollout(tokenizer, stops, pids, pmask, rows, group, parts, kept, tried: int,
                    temperature, task, score, discarded):
    """Group-major rows: each group's sampled rows, then its repairs (module docstring)."""
    dev = pids.device
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
    ro = assemble(tokenizer, stops, pids[src_t], pmask[src_t], [rows[i] for i in src],
                  group[src_t], parts, pick, temperature, repair_of=rep, parent=rep,
                  branch_at=at, repairs_tried=tried, discarded_tokens=discarded)
    spliced = rep >= 0
    if len(parts) > 1 and parts[1].cache is None:  # splice: nothing was sampled
        ro.generated = torch.where(spliced, 0, ro.lengths)
    else:
        ro.generated = torch.where(spliced, ro.lengths - at, ro.lengths)
    score(task, ro)
    return ro
