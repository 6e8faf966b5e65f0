"""Branching (tree) rollouts: sample a few roots per group, then re-sample continuations from
chosen prefixes of earlier paths until the group holds G complete responses.

Shape of a group (fixed, independent of what is sampled): paths 0..roots−1 are roots; then,
breadth first, every path in creation order gets `branches` children, until G paths exist.
Path j of global group g is keyed like row j of the independent layout (seed, step, g, j), so
the noise is a function of (seed, step, global group, path) and a tree is sampled identically in
one process, on any number of data-parallel ranks, and after a resume.

Where a child branches: among its parent's own tokens (positions from the parent's branch
point to its end), drawn without replacement (Gumbel top-k on hashed noise keyed by the parent)
with weights ∝ the policy's token entropy there (`branch_at="entropy"`) or equal weights
(`"uniform"`); the k-th child of a parent takes the k-th draw.

The branch token (`branch_token`): "sample" draws it from π_old(· | prefix) like any token;
"alternative" draws it from π_old with the parent's own token at that position excluded
(renormalised), so every branch is a different decision. old_logps always records the policy's
full-vocabulary log π_old(y_t | prefix), which is what `token_logps` recomputes, so the ratio
π_θ/π_old and its clip read exactly as on any other token. At an alternative branch token the
sampling distribution was q = π_old/(1 − π_old(y_parent)) instead: the ratio is not the
importance weight to q, and a loss that treats the group as i.i.d. samples of π_old is biased at
that one position per branch (the excluded token is carried by the parent row itself). The
row's `branch_at` marks the position; log q there is old_logps − log(1 − π_old(y_parent)).

KV reuse: a child never recomputes its prefix. Its cache is the parent's cache rows
(`index_select` over the batch dimension) with the columns after the prefix masked out; the
last prefix token is fed once more to produce the next-token logits. Per child this is one
token forward instead of P + t (prompt plus shared response prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..numerics.logprobs import positions as _positions
from .rollout import _GOLD, _MIX1, _MIX2, Rollout, _inverse_cdf, _srl, hashed_uniform
from .spec import Decoding, SamplingSpec

POSITION_SALT = 7  # `mix_keys` salt of the noise that picks branch positions


def mix_keys(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """(N,) int64 keys of a derived noise stream: a splitmix64 finaliser of (key, salt)."""
    x = keys.long() * _GOLD + torch.full_like(keys.long(), salt + 1) * _MIX1  # wraps mod 2^64
    x = (x ^ _srl(x, 31)) * _MIX2
    return x ^ _srl(x, 29)


def tree_shape(G: int, roots: int, branches: int) -> list[tuple[int, int, int]]:
    """(path j, parent path or −1, child index k among its parent's children) for j = 0..G−1,
    breadth first: `roots` roots, then `branches` children per path in creation order."""
    out = [(j, -1, 0) for j in range(min(roots, G))]
    p = 0
    while len(out) < G:
        for k in range(branches):
            if len(out) == G:
                break
            out.append((len(out), p, k))
        p += 1
    return out


@dataclass
class Paths:
    """Rows sampled in one decoding round, with the KV cache that produced them.

    tokens/logps/ent/mask (M, T): response tokens (pad after the stop), behaviour log-probs,
    token entropies (nats, tempered), mask (True through the stop id). start (M,): first
    response position the round sampled for each row (its branch point; 0 for roots).
    cache: the round's DynamicCache; live (M, L) bool: cache columns each row attends to;
    cpos (M, L) long: the position id of each cache column.
    """

    tokens: torch.Tensor
    logps: torch.Tensor
    ent: torch.Tensor
    mask: torch.Tensor
    start: torch.Tensor
    cache: DynamicCache
    live: torch.Tensor
    cpos: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)


def select_cache(cache: DynamicCache, idx: torch.Tensor) -> DynamicCache:
    """A new cache holding rows `idx` (M,) of `cache` (rows may repeat); `cache` is untouched."""
    return DynamicCache(ddp_cache_data=[(lay.keys.index_select(0, idx),
                                         lay.values.index_select(0, idx))
                                        for lay in cache.layers])


def draw(logits: torch.Tensor, temperature: float, keys: torch.Tensor, t: torch.Tensor,
         n_vocab: int, exclude: torch.Tensor | None = None):
    """One token per row by inverse CDF on hashed noise (key, response position t).

    logits (M, V); t (M,) long; exclude (M,) long or None: a token id per row that may not be
    drawn (−1: none); a row whose only mass is on its excluded id keeps it. Returns (token,
    log π (full vocabulary, tempered), entropy of the tempered distribution), each (M,).
    With exclude None this draws exactly what `rollout._sample` draws with the same keys.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    allowed = logp[:, :n_vocab]
    if exclude is not None and bool((exclude >= 0).any()):
        rows = (exclude >= 0).nonzero().squeeze(-1)
        cut = allowed.clone()
        cut[rows, exclude[rows]] = -float("inf")
        rest = cut[rows].exp().sum(-1) > 0  # a row with nothing left keeps its distribution
        allowed = allowed.clone()
        allowed[rows[rest]] = cut[rows[rest]]
    tok = _inverse_cdf(allowed, hashed_uniform(keys, t).to(logp.device))
    ent = -(logp.exp() * logp).nan_to_num().sum(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), ent


@torch.no_grad()
def decode(model, feed: torch.Tensor, feed_mask: torch.Tensor, feed_pos: torch.Tensor, *,
           cache: DynamicCache | None, live: torch.Tensor, cpos: torch.Tensor,
           start: torch.Tensor, keys: torch.Tensor, prefix: tuple,
           exclude: torch.Tensor | None, dec: Decoding) -> Paths:
    """Sample every row from its response position `start` (M,) until a stop id or
    T = dec.max_new_tokens, at dec.temperature, ids < dec.n_vocab.

    feed/feed_mask/feed_pos (M, k): what is fed first (the prompt for roots; the last prefix
    token for a branch), its mask and position ids; cache/live/cpos: the prefix's KV cache,
    (M, L) columns attended to and their position ids (None, (M, 0), (M, 0) for roots).
    keys (M,): each row's noise key. prefix: (tokens, logps, ent) (M, T) holding the rows'
    prefixes at positions < start. exclude (M,): a token id each row's first draw may not take
    (−1: none), see `draw`.
    """
    T, temperature, n_vocab = dec.max_new_tokens, dec.temperature, dec.n_vocab
    tokens, logps, ent = (x.clone() for x in prefix)  # (M, T) each
    length = start.clone()
    t, done = start.clone(), start >= T  # (M,) next position to sample, row finished
    stop = torch.tensor(dec.stops, device=feed.device)
    first = True
    while not bool(done.all()):
        live = torch.cat([live, feed_mask], -1)
        cpos = torch.cat([cpos, feed_pos], -1)
        out = model(input_ids=feed, attention_mask=live.long(), position_ids=feed_pos,
                    cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
        token, logp, entropy = draw(out.logits[:, -1], temperature, keys, t, n_vocab,
                                    exclude if first else None)  # (M,) each
        first = False
        active = (~done).nonzero().squeeze(-1)
        at = t[active]
        tokens[active, at], logps[active, at], ent[active, at] = (
            token[active], logp[active], entropy[active])
        length[active] = at + 1
        done = done | torch.isin(token, stop) | (t + 1 >= T)
        t = torch.where(done, t, t + 1)
        feed, feed_mask, feed_pos = token[:, None], torch.ones_like(feed_mask[:, :1]), feed_pos[:, -1:] + 1
    mask = torch.arange(T, device=feed.device) < length[:, None]
    return Paths(tokens, logps.masked_fill(~mask, 0.0), ent.masked_fill(~mask, 0.0), mask,
                 start, cache, live, cpos)


def branch_order(par: Paths, keys: torch.Tensor, branch_at: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch positions of each parent row, in draw order: (order (M, T) long, n (M,) long =
    how many positions are eligible, the parent's own tokens `start..length−1`).

    Gumbel top-k on hashed noise keyed by the parent: a draw without replacement with
    probabilities ∝ token entropy ("entropy") or equal ("uniform")."""
    M, T = par.tokens.shape
    pos = torch.arange(T, device=keys.device)
    ok = (pos >= par.start[:, None]) & par.mask
    pkeys = mix_keys(keys, POSITION_SALT)
    u = torch.stack([hashed_uniform(pkeys, t) for t in range(T)], -1)  # (M, T) float64
    w = par.ent.double().clamp(min=1e-30).log() if branch_at == "entropy" else torch.zeros_like(u)
    score = torch.where(ok, w - torch.log(-torch.log(u)), -float("inf"))
    return torch.argsort(score, dim=-1, descending=True, stable=True), ok.sum(-1)


def branch(model, par: Paths, idx: torch.Tensor, at: torch.Tensor, keys: torch.Tensor, *,
           prompt_last: torch.Tensor, prompt_len: torch.Tensor, alternative: bool,
           dec: Decoding) -> Paths:
    """New rows that copy parent rows `idx` (M,) of `par` up to response position `at` (M,)
    (exclusive) and re-sample from there, reusing the parents' KV cache; keys (M,): their
    noise keys.

    prompt_last (M,): the last prompt token of each row's prompt (fed again when at == 0);
    prompt_len (M,): real prompt tokens (position id of response position t = prompt_len + t).
    alternative: the first drawn token may not be the parent's token at `at`.
    """
    T = dec.max_new_tokens
    pos = torch.arange(T, device=at.device)
    keep = pos < at[:, None]
    prefix = (torch.where(keep, par.tokens[idx], par.tokens.new_zeros(())),
              par.logps[idx] * keep, par.ent[idx] * keep)
    last = prompt_len + at - 1  # position id of the last prefix token: fed again
    live = par.live[idx] & (par.cpos[idx] < last[:, None])
    prev = par.tokens[idx, (at - 1).clamp(min=0)]
    feed = torch.where(at == 0, prompt_last, prev)[:, None]
    exclude = par.tokens[idx, at.clamp(max=T - 1)] if alternative else None
    return decode(model, feed, torch.ones_like(feed, dtype=torch.bool), last[:, None],
                  cache=select_cache(par.cache, idx), live=live, cpos=par.cpos[idx], start=at,
                  keys=keys, prefix=prefix, exclude=exclude, dec=dec)


def sample_roots(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, keys: torch.Tensor,
                 dec: Decoding) -> Paths:
    """Independent responses to the rows' prompts (M, P), keys (M,), keyed like
    `rollout.generate`."""
    M, dev, T = prompt_ids.shape[0], prompt_ids.device, dec.max_new_tokens
    z = torch.zeros(M, dtype=torch.long, device=dev)
    empty = torch.zeros(M, 0, dtype=torch.long, device=dev)
    prefix = (torch.zeros(M, T, dtype=torch.long, device=dev), torch.zeros(M, T, device=dev),
              torch.zeros(M, T, device=dev))
    return decode(model, prompt_ids, prompt_mask, _positions(prompt_mask), cache=None,
                  live=empty.bool(), cpos=empty, start=z, keys=keys, prefix=prefix, exclude=None,
                  dec=dec)


def assemble(tokenizer, dec: Decoding, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             *, problems: list, group: torch.Tensor, parts: list[Paths],
             pick: list[tuple[int, int]], **extra) -> Rollout:
    """A Rollout of rows pick[i] = (part, row in part) of decoding rounds `parts`; prompt_ids,
    prompt_mask (N, P), problems and group (N,) are per output row. The width is trimmed to the
    longest response; tokens after a row's stop are the pad id. extra: further Rollout fields."""
    from .rollout import _decode

    def cat(name):
        return torch.stack([getattr(parts[a], name)[r] for a, r in pick])

    mask = cat("mask")
    width = max(int(mask.sum(-1).max()), 1)
    mask = mask[:, :width]
    ids = cat("tokens")[:, :width].masked_fill(~mask, tokenizer.pad_token_id)
    logps = cat("logps")[:, :width].float().masked_fill(~mask, 0.0)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids,
                   response_mask=mask, old_logps=logps, group=group,
                   texts=_decode(tokenizer, ids, mask, dec.stops), problems=problems,
                   temperature=dec.temperature, **extra)


@dataclass
class TreePlan:
    """Where every path of a group's tree is sampled (the same for every group).

    shape: `tree_shape(G, roots, branches)`; where[j] = (round, slot): path j is sampled in
    breadth-first round `round` (its depth), as the slot-th of that round's paths of a group (a
    round's rows are group-major: group g's slot s is row g·len(round) + s). keys (n, G) long:
    the noise key of path j of group g; prompt_ids/prompt_mask (n, P): each group's prompt.
    """

    shape: list[tuple[int, int, int]]
    where: dict[int, tuple[int, int]]
    keys: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor

    @classmethod
    def build(cls, spec: SamplingSpec, keys: torch.Tensor, prompt_ids: torch.Tensor,
              prompt_mask: torch.Tensor) -> TreePlan:
        shape = tree_shape(spec.G, spec.roots, spec.branches)
        depth = [0] * spec.G
        for path, parent, _ in shape:
            depth[path] = 0 if parent < 0 else depth[parent] + 1
        where = {}
        for d in range(max(depth) + 1):
            for slot, path in enumerate(p for p in range(spec.G) if depth[p] == d):
                where[path] = (d, slot)
        return cls(shape, where, keys, prompt_ids, prompt_mask)

    @property
    def rounds(self) -> int:
        return max(d for d, _ in self.where.values()) + 1

    def paths(self, round_: int) -> list[int]:
        """The paths of one group sampled in round `round_`, in slot order."""
        return [j for j in range(len(self.shape)) if self.where[j][0] == round_]

    def rows(self, paths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(group (n·len(paths),), keys (n·len(paths),)) of a round's rows, group-major."""
        n, dev = self.keys.shape[0], self.keys.device
        group = torch.arange(n, device=dev).repeat_interleave(len(paths))
        return group, self.keys[group, torch.tensor(paths, device=dev).repeat(n)]


@torch.no_grad()
def generate_tree(model, tokenizer, problems: list, spec: SamplingSpec, row_keys: torch.Tensor,
                  task=None) -> Rollout:
    """spec.G responses per problem as a tree per group (module docstring; spec.roots,
    spec.branches, spec.branch_at, spec.branch_token); a `Rollout` whose rows are group-major,
    row g·G + j = path j of group g, with `parent` (row of the parent path, −1 for roots),
    `branch_at` (response position where the row leaves its parent, −1 for roots) and
    `generated` (tokens the sampler produced for the row: length − branch_at).
    row_keys (len(problems)·G,): the keys of the independent layout's rows (`rollout.generate`).
    task: rewards are scored when given."""
    from ..numerics.precision import autocast
    from .rollout import _encode_prompts, check_prompt_lengths

    G = spec.G
    if spec.temperature <= 0 or not 1 <= spec.roots <= G or spec.branches < 1:
        raise ValueError(f"tree rollouts need temperature > 0, 1 ≤ roots ≤ G, branches ≥ 1; got "
                         f"{spec.temperature}, roots {spec.roots}, G {G}, branches {spec.branches}")
    device = next(model.parameters()).device
    dec, n = Decoding.of(spec, model, tokenizer), len(problems)
    prompt_ids, prompt_mask = _encode_prompts(tokenizer, [p.prompt for p in problems], device)  # (n, P)
    check_prompt_lengths(prompt_mask.sum(-1).tolist(), spec.max_prompt_len,
                         getattr(model.config, "max_position_embeddings", None), spec.max_new_tokens)
    plan = TreePlan.build(spec, row_keys.to(device).view(n, G), prompt_ids, prompt_mask)
    parts: list[Paths] = []  # one decoding round per tree depth
    was_training = model.training
    model.eval()
    try:
        with autocast(device, spec.amp):
            for d in range(plan.rounds):
                paths = plan.paths(d)
                group, keys = plan.rows(paths)  # (n·len(paths),) each
                if d == 0:
                    parts.append(sample_roots(model, prompt_ids[group], prompt_mask[group], keys,
                                              dec))
                    continue
                parts.append(_children(model, plan, parts[d - 1], paths, spec, dec))
                parts[d - 1].cache = None  # its children are made: free its KV cache
    finally:
        model.train(was_training)
    return _tree_rollout(tokenizer, plan, parts, problems, dec, task)


def _children(model, plan: TreePlan, parents: Paths, paths: list[int], spec: SamplingSpec,
              dec: Decoding) -> Paths:
    """One breadth-first round: `paths` of every group, branched from their parents, the rows
    of the previous round `parents`."""
    parent_round = plan.where[plan.shape[paths[0]][1]][0]  # every parent is in the last round
    parent_paths = plan.paths(parent_round)  # slot order
    n_par, n, dev = len(parent_paths), plan.keys.shape[0], plan.keys.device
    _, parent_keys = plan.rows(parent_paths)  # (n·n_par,)
    order, avail = branch_order(parents, parent_keys, spec.branch_at)  # (n·n_par, T), (n·n_par,)
    group, keys = plan.rows(paths)  # (M,) M = n·len(paths)
    slot = torch.tensor([plan.where[plan.shape[j][1]][1] for j in paths], device=dev).repeat(n)
    idx = group * n_par + slot  # (M,) parent row in `parents`
    kth = torch.tensor([plan.shape[j][2] for j in paths], device=dev).repeat(n)  # child index
    at = order[idx, kth % avail[idx]]  # (M,) branch positions
    return branch(model, parents, idx, at, keys, prompt_last=plan.prompt_ids[group, -1],
                  prompt_len=plan.prompt_mask.sum(-1)[group], alternative=spec.alternative,
                  dec=dec)


def _tree_rollout(tokenizer, plan: TreePlan, parts: list[Paths], problems: list, dec: Decoding,
                  task) -> Rollout:
    """The group-major Rollout of the rounds `parts` (row g·G + j = path j of group g)."""
    from .rollout import score

    n, G, dev = len(problems), len(plan.shape), plan.prompt_ids.device
    per_round = [sum(1 for d, _ in plan.where.values() if d == r) for r in range(len(parts))]
    pick = [(plan.where[j][0], g * per_round[plan.where[j][0]] + plan.where[j][1])
            for g in range(n) for j in range(G)]
    rows = torch.arange(n, device=dev).repeat_interleave(G)  # (N,) group of each row
    parent = torch.tensor([-1 if p < 0 else g * G + p for g in range(n) for _, p, _ in plan.shape],
                          device=dev)
    start = torch.stack([parts[a].start[r] for a, r in pick])  # (N,)
    ro = assemble(tokenizer, dec, plan.prompt_ids[rows], plan.prompt_mask[rows],
                  problems=[problems[i] for i in rows.tolist()], group=rows, parts=parts,
                  pick=pick, parent=parent,
                  branch_at=torch.where(parent < 0, -1, start))
    ro.generated = ro.lengths - start
    if task is not None:
        score(task, ro)
    return ro
