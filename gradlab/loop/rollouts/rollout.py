"""Real rollouts (G samples per prompt) and per-token log-probs of a causal LM.

Layout, used everywhere in gradlab:
  prompts are left-padded   (N, P), responses are right-padded (N, T),
  rows are group-major: row i belongs to prompt i // G.
Position ids are computed from the attention mask (cumsum - 1), so a left-padded row sees the
same positions as the unpadded sequence; `gradlab.loop.numerics.logprobs.token_logps` therefore
reproduces the behaviour log-probs `old_logps` recorded by `generate` (tested to ~1e-5 in
float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ...core.batch import (
    TokenBatch,
    renumber_rows,
    select_rows,
)
from ..config import ConfigError
from ..numerics.logprobs import positions as _positions
from ..numerics.precision import autocast
from .spec import Decoding, stop_ids


@dataclass
class Rollout:
    """G sampled responses for each of N/G prompts. N = number of rows, P/T = prompt/response len."""

    prompt_ids: torch.Tensor  # (N, P) long, left-padded with pad id
    prompt_mask: torch.Tensor  # (N, P) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (N, T) long, right-padded with pad id
    response_mask: torch.Tensor  # (N, T) bool, True on generated tokens incl. the EOS, False after
    old_logps: (
        torch.Tensor
    )  # (N, T) float32, behaviour log-probs (nats) at the sampling temp; 0 masked
    group: torch.Tensor  # (N,) long, prompt index: row i -> i // G
    texts: list[str]  # decoded responses without EOS / pad
    problems: list  # the Problem of each row
    temperature: float = 1.0
    rewards: torch.Tensor | None = None  # (N,) float32, set when `generate(task=...)` or `score`
    # Layouts other than independent sampling (loop/rollouts/tree.py, loop/rollouts/repair.py); None = independent.
    # Row indices below index the rows of this Rollout (under DDP: this rank's rollout).
    parent: torch.Tensor | None = None  # (N,) long, tree: the row this one branched from, −1 root
    branch_at: torch.Tensor | None = None  # (N,) long, response position where it left parent/−1
    generated: torch.Tensor | None = None  # (N,) long, tokens the sampler newly produced per row
    repair_of: torch.Tensor | None = None  # (N,) long, repair: the row it corrects, −1 otherwise
    repairs_tried: int = 0  # incorrect rows in groups with a correct one (repair candidates)
    discarded_tokens: int = 0  # tokens sampled for repair tries that were not kept

    @property
    def G(self) -> int:
        """Sampled (non-repair) responses per group."""
        n = len(self.texts) - (0 if self.repair_of is None else int((self.repair_of >= 0).sum()))
        return n // (int(self.group.max()) + 1)

    @property
    def new_tokens(self) -> torch.Tensor:
        """(N,) long, tokens the sampler produced for each row (the whole response when
        independent; a branch or a re-sampled repair counts only what follows its prefix)."""
        return self.lengths if self.generated is None else self.generated

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) long, response tokens including EOS."""
        return self.response_mask.sum(-1)

    def token_batch(self, logps: torch.Tensor, advantages: torch.Tensor,
                    rows: torch.Tensor | None = None, *, t: int | None = None,
                    norms: tuple[int, int, int] | None = None,
                    old_logps: torch.Tensor | None = None, validate: bool = True) -> TokenBatch:
        """The `TokenBatch` of rollout rows `rows` (B,) long (None: all N rows, B = N), cut to
        the first `t` response positions (None: all T).

        logps (B, t): the current policy's log-probs of those rows (nats; may require grad).
        advantages (N,) or (N, T'): one per rollout row, indexed by `rows` here.
        old_logps (B, t): the behaviour log-probs to use; None: the rollout's own
        `old_logps[rows, :t]`. rewards (B,) and `repair_of` come along when the rollout has them;
        `repair_of` is renumbered into the batch's rows (`batch_repair_of`).
        norms: the loss normalisers' totals (n_seqs, n_tokens, width) of a larger batch this one
        is part of; None: the batch's own. validate: TokenBatch's checks (False skips the
        finiteness check's device sync)."""
        pick = slice(None) if rows is None else rows
        width = self.response_ids.shape[1] if t is None else t
        n_seqs, n_tokens, n_width = (None, None, None) if norms is None else norms
        return TokenBatch(
            self.response_ids[pick, :width], self.response_mask[pick, :width], logps,
            self.old_logps[pick, :width] if old_logps is None else old_logps,
            advantages[pick], self.group[pick],
            rewards=None if self.rewards is None else self.rewards[pick],
            repair_of=self.repair_of if rows is None else batch_repair_of(self.repair_of, rows),
            n_seqs=n_seqs, n_tokens=n_tokens, width=n_width, validate=validate)

    def rows(self, idx: torch.Tensor | Sequence[int], *, t: int | None = None,
             relabel: bool = False) -> Rollout:
        """The rollout of rows `idx`: a (k,) long tensor (or int sequence) of row indices in
        [0, N), in the order wanted, or an (N,) bool mask (its True rows, in order).

        Every per-row field is selected: prompt_ids, prompt_mask (N, P) → (k, P);
        response_ids, response_mask, old_logps (N, T) → (k, t) (the first `t` response
        positions; None: all T); group, rewards, branch_at, generated (N,) → (k,); texts,
        problems (lists) → the k entries; parent and repair_of (N,) → (k,) renumbered into the
        selection (the position in `idx` of the row referred to; −1 when it is not selected).
        temperature, repairs_tried and discarded_tokens (whole-rollout counts) are copied.
        Groups keep their labels (`G` then assumes whole groups 0..max label); `relabel=True`
        maps them to 0..n_groups−1 in increasing label order. ValueError for an index out of
        range, a mask of the wrong shape, or a repeated index when parent/repair_of have to be
        renumbered."""
        kw = select_rows(self, ROLLOUT_FIELDS, idx, self.response_ids.shape[0], "Rollout", t=t,
                         relabel=relabel)
        return Rollout(**kw)

    def to(self, device: torch.device | str) -> Rollout:
        """A copy with every tensor moved to `device`."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, torch.Tensor) else v
        return Rollout(**kw)


ROLLOUT_FIELDS = {  # how `Rollout.rows` treats each field
    "prompt_ids": "row", "prompt_mask": "row", "response_ids": "row-token",
    "response_mask": "row-token", "old_logps": "row-token", "group": "row", "texts": "list",
    "problems": "list", "temperature": "batch", "rewards": "row", "parent": "row-ref",
    "branch_at": "row", "generated": "row", "repair_of": "row-ref", "repairs_tried": "batch",
    "discarded_tokens": "batch",
}


def batch_repair_of(repair_of: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """`Rollout.repair_of` (N,) re-indexed for a batch of rollout rows `rows` (B,): position in
    `rows` of the row each repair corrects; −1 for non-repairs and for a repair whose original
    is not among `rows` (groups stay whole in a step and a micro-batch, so it always is)."""
    return None if repair_of is None else renumber_rows(repair_of, rows, "Rollout.repair_of")


def encode_pairs(tokenizer, prompts: list[str], responses: list[str], device="cpu"):
    """Tokenize (prompt, response) pairs into the rollout layout; EOS is appended to responses.

    Returns prompt_ids, prompt_mask (N, P) left-padded and response_ids, response_mask (N, T)
    right-padded with the pad id (mask True on response tokens incl. EOS).
    """
    enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    resp = [
        tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for r in responses
    ]
    T = max(len(r) for r in resp)
    response_ids = torch.full((len(resp), T), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(resp), T), dtype=torch.bool)
    for i, r in enumerate(resp):
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = True
    return (
        enc["input_ids"].to(device),
        enc["attention_mask"].bool().to(device),
        response_ids.to(device),
        response_mask.to(device),
    )


def score(task, rollout: Rollout) -> torch.Tensor:
    """(N,) float32 rewards of the rollout's responses under `task` (also stored on the rollout)."""
    r = [task.reward(p, t) for p, t in zip(rollout.problems, rollout.texts)]
    rollout.rewards = torch.tensor(r, dtype=torch.float32, device=rollout.response_ids.device)
    return rollout.rewards


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_MIX1, _MIX2, _GOLD = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hashed_uniform(row_keys: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """(N,) float64 uniforms in (0, 1) from a counter-based hash (splitmix64) of (row key, t);
    t an int or an (N,) long tensor of per-row counters.

    O(1) per row and token (inverse-CDF sampling needs one uniform, not one per vocab entry).
    A row's noise depends on its key only, not on which other rows share the batch: the same
    global row samples the same tokens in one process or sharded over data-parallel ranks.
    """
    k = row_keys.long()
    x = k * _GOLD + (torch.as_tensor(t, device=k.device) + 1) * _MIX2  # int64 products wrap mod 2^64
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    x = x ^ _srl(x, 31)
    return (_srl(x, 11).double() + 0.5) / float(1 << 53)  # 53 random bits, never 0 or 1


SAMPLE_ROWS = 64  # rows per sampling chunk: bounds the (rows, V) float64 CDF temporaries


def _inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(N,) token ids: the first id whose cumulative probability exceeds u * total.

    logp: (N, V) log-probs (the ids allowed to be sampled); u: (N,) float64 in (0, 1).
    The CDF is summed in float64 so 151k-entry vocabularies keep ~1e-12 absolute accuracy;
    ids of zero probability are never returned (their CDF step is flat).
    """
    out = torch.empty(logp.shape[0], dtype=torch.long, device=logp.device)
    for s in range(0, logp.shape[0], SAMPLE_ROWS):
        cdf = logp[s : s + SAMPLE_ROWS].double().exp_().cumsum_(-1)  # (n, V) float64
        x = (u[s : s + SAMPLE_ROWS] * cdf[:, -1])[:, None]
        out[s : s + SAMPLE_ROWS] = torch.searchsorted(cdf, x, right=True)[:, 0]
    return out.clamp_(max=logp.shape[-1] - 1)  # u * total rounding up to total: last id


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
            row_keys: torch.Tensor | None = None, t: int = 0, n_vocab: int | None = None):
    """Sample one token per row; returns (token (N,), log-prob (N,) at temperature).

    logits: (N, V). Only ids < n_vocab (the tokenizer's length; real checkpoints pad the
    embedding beyond it) can be sampled; the returned log-prob is the model's full-vocabulary
    log-prob of the token, so `token_logps` reproduces it exactly (the padded ids carry ~no mass).
    With `row_keys` (N,): inverse-CDF sampling with one hashed uniform per (key, t) (batch-layout
    independent, O(1) noise per token, see `hashed_uniform`). Without: Gumbel-max with uniforms
    from `generator` (on the generator's device; the global RNG if None), as gradlab always did,
    so seeded evaluations and the `gradlab check` baseline keep their exact samples.
    temperature == 0 means greedy (logp of the untempered distribution is returned then).
    """
    logits = logits.float()
    n_vocab = logits.shape[-1] if n_vocab is None else min(n_vocab, logits.shape[-1])
    logp = F.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)  # (N, V)
    allowed = logp[:, :n_vocab]
    if temperature <= 0:
        tok = allowed.argmax(-1)
    elif row_keys is not None:
        tok = _inverse_cdf(allowed, hashed_uniform(row_keys, t).to(logp.device))
    else:
        gen_device = generator.device if generator is not None else logits.device
        u = torch.rand(allowed.shape, generator=generator, device=gen_device).to(logp.device)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        tok = (allowed + gumbel).argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def check_prompt_lengths(lengths: list[int], max_prompt_len: int | None = None,
                         max_positions: int | None = None, max_new_tokens: int = 0,
                         prompts: list[str] | None = None) -> None:
    """ConfigError (a ValueError) naming the first prompt (its index in `lengths`, and its
    start when `prompts` is given) longer than the limit.

    Limits: `max_prompt_len` (tokens), and the model's `max_positions` minus `max_new_tokens`
    (a prompt must leave room for its response). Called before any model allocation.
    """
    if max_positions is not None and max_new_tokens >= max_positions:  # no room for any prompt
        raise ConfigError(f"--max-new-tokens: {max_new_tokens} is invalid; must be < "
                          f"{max_positions}, the model's context (max_position_embeddings), "
                          "which also holds the prompt")
    limits = []
    if max_prompt_len is not None:
        limits.append((max_prompt_len, "--max-prompt-len"))
    if max_positions is not None:
        limits.append((max_positions - max_new_tokens,
                       f"max_position_embeddings {max_positions} - --max-new-tokens "
                       f"{max_new_tokens}: the model's context holds prompt and response"))
    for limit, what in limits:
        for i, n in enumerate(lengths):
            if n > limit:
                text = f" {prompts[i][:60]!r}" if prompts is not None else ""
                raise ConfigError(f"prompt {i}{text} has {n} tokens > limit {limit} ({what})")


def _encode_prompts(tokenizer, prompts: list[str], device: torch.device):
    enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    if tokenizer.padding_side != "left":  # we rely on left padding for the sampling loop
        raise ValueError("tokenizer.padding_side must be 'left'")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()


@torch.no_grad()
def generate(
    model,
    tokenizer,
    problems: list,
    G: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    *,
    generator: torch.Generator | None = None,
    amp: bool = False,
    task=None,
    row_keys: torch.Tensor | None = None,
    max_prompt_len: int | None = None,
) -> Rollout:
    """Sample G responses per problem with a KV cache; stop each row at its first stop id.

    Deterministic given `generator` (a torch.Generator; None uses the global RNG). The model is
    put in eval mode and restored afterwards. If `task` is given, rewards are scored too.
    Sampling is at `temperature` over the full tokenizer vocabulary: the model's own
    generation_config top-k / top-p / temperature are not used (old_logps stay the model's exact
    log-probs, which the importance ratios need). Ids >= len(tokenizer) are never sampled.
    Stop ids: the tokenizer's EOS and every generation_config.eos_token_id (`stop_ids`).
    row_keys: optional (len(problems) * G,) int64 keys; when given the sampling noise of each row
    is hashed from its key (the loop passes step seed + global row index, so data-parallel ranks
    sample exactly what a single process would) and `generator` is not used.
    max_prompt_len: ValueError (naming the problem index) for a longer prompt; prompts must also
    leave max_new_tokens positions below the model's max_position_embeddings.
    """
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    stops = stop_ids(model, tokenizer)
    rows = [p for p in problems for _ in range(G)]  # group-major
    prompt_ids, prompt_mask = _encode_prompts(tokenizer, [p.prompt for p in rows], device)  # (N, P)
    N = len(rows)
    dec = Decoding(max_new_tokens, temperature, tuple(stops), len(tokenizer))
    check_prompt_lengths(prompt_mask.sum(-1)[::G].tolist(), max_prompt_len,
                         getattr(model.config, "max_position_embeddings", None), max_new_tokens)

    was_training = model.training
    model.eval()
    try:
        with autocast(device, amp):
            toks, logps = _sample_loop(model, prompt_ids, prompt_mask, dec, pad_id=pad_id,
                                       generator=generator, row_keys=row_keys)
    finally:
        model.train(was_training)

    response_ids = torch.stack(toks, dim=1)  # (N, T)
    old_logps = torch.stack(logps, dim=1).float()  # (N, T)
    # Mask: True up to and including the first stop id (all True if the row was truncated).
    is_eos = torch.isin(response_ids, torch.tensor(stops, device=device)).long()
    response_mask = (is_eos.cumsum(-1) - is_eos) == 0
    response_ids = response_ids.masked_fill(~response_mask, pad_id)
    old_logps = old_logps.masked_fill(~response_mask, 0.0)
    texts = _decode(tokenizer, response_ids, response_mask, stops)
    ro = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        old_logps=old_logps,
        group=torch.arange(N, device=device) // G,
        texts=texts,
        problems=rows,
        temperature=temperature,
    )
    if task is not None:
        score(task, ro)
    return ro


def _sample_loop(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, dec: Decoding, *,
                 pad_id: int, generator: torch.Generator | None,
                 row_keys: torch.Tensor | None = None) -> tuple[list, list]:
    """KV-cached sampling of the prompts (N, P) for up to dec.max_new_tokens tokens at
    dec.temperature; returns lists (one entry per step) of tokens (N,) and log-probs (N,).

    After a row's stop id (dec.stops) its tokens are pad and its log-probs 0; stops early when
    all rows are done. logits_to_keep=1: the prompt forward builds (N, 1, V) logits, never
    (N, P, V). row_keys (N,) or None: hashed noise per row, else `generator`'s (`_sample`).
    """
    N, device = prompt_ids.shape[0], prompt_ids.device
    mask = prompt_mask.long()  # (N, P + t) attention mask over everything so far
    pos = _positions(prompt_mask)  # (N, P) position ids of the tokens being fed
    ids, cache = prompt_ids, None
    stop = torch.tensor(dec.stops, device=device)
    toks, logps = [], []
    done = torch.zeros(N, dtype=torch.bool, device=device)
    for t in range(dec.max_new_tokens):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.cache
        tok, lp = _sample(out.logits[:, -1], dec.temperature, generator, row_keys, t, dec.n_vocab)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        toks.append(tok)
        logps.append(torch.where(done, torch.zeros_like(lp), lp))
        done = done | torch.isin(tok, stop)
        if bool(done.all()):
            break
        # Feed the new token; finished rows keep attending (harmless, their outputs are unused).
        ids, pos = tok[:, None], pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    return toks, logps


def _decode(tokenizer, response_ids, response_mask, stops) -> list[str]:
    keep = response_mask & ~torch.isin(response_ids, torch.tensor(stops, device=response_ids.device))
    return [
        tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
        for r, m in zip(response_ids.cpu(), keep.cpu())
    ]
