"""Per-token log-probs of a causal LM over response positions: the one function that
training, the learning tax, drift and the probe set all call.

Layout: prompts left-padded (N, P), responses right-padded (N, T); position ids come from the
attention mask, so a left-padded row sees the positions of the unpadded sequence.

Exact by construction: the logits are always the model's own. The decoder (the module the
model's forward calls for its final hidden states, found with `get_decoder()`) runs once; the
logits of any set of hidden states come from the model's own forward with that decoder's output
replaced by those hidden states (`output_logits`), so every final-logit transform the
architecture applies after its LM head (Cohere's logit_scale, Granite's logits_scaling,
Gemma 2's final_logit_softcapping, a float cast, ...) is applied by the model's code itself.

Memory: logits never exceed LOGIT_BUDGET float32 entries (64 MiB) per chunk. When
N × T × V fits the budget the output runs on the (N, T, V) grid (the numerics of a plain
forward, bit for bit). Otherwise the model's output and a selective log-softmax run over
the response tokens only (mask True), `chunk` tokens at a time, in float32 (from bf16 logits
under autocast), in one autograd Function per chunk (`_SelectiveLogSoftmax`) that saves only
the chunk's hidden states and logsumexp and recomputes its (chunk, V) logits in backward:
peak logits memory is O(chunk × V), not O(N T V). The per-token entropy, when asked for, comes
from the same chunk and the same exp pass as the logsumexp (one extra dot product per token).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.func import functional_call

LOGIT_BUDGET = 1 << 24  # float32 logits per chunk (64 MiB): chunk = LOGIT_BUDGET // V tokens


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(N, L) position ids from a (N, L) attention mask: 0 at the first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logps(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    return_logprobs: bool = False,
    chunk: int | None = None,
    entropy_grad: bool = True,
):
    """Log-probs (nats) of the response tokens, with gradient, from one forward pass.

    prompt_ids/prompt_mask: (N, P), left-padded; response_ids/response_mask: (N, T).
    Returns logps (N, T) float32, 0 at masked positions. With return_entropy and/or
    return_logprobs returns a tuple (logps, [entropy (N, T), 0 masked], [log-softmax (N, T, V)])
    in that order, all at `temperature` (logits / temperature).
    chunk: logit rows per LM-head chunk (default LOGIT_BUDGET // V). return_logprobs=True
    materialises (N, T, V) by definition: call it on a few rows only (drift, probe set).
    entropy_grad=False: the entropy is a reading only (no graph; the loop's logged entropy).
    On the chunked path the entropy costs one dot product per token over the chunk's logits
    already in memory; its gradient, when kept, is added in the chunk's own backward.
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (N, P + T)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    body, head = _body_and_head(model)
    if return_logprobs or head is None:
        return _full(model, ids, mask, response_ids, response_mask, temperature=temperature,
                     return_entropy=return_entropy, return_logprobs=return_logprobs,
                     entropy_grad=entropy_grad)
    h = _hidden(model, body, ids, mask)[:, prompt_ids.shape[1] - 1 :]  # (N, T + 1, H)
    N, T = response_ids.shape
    out_fn = _Output(model, body, head)
    c = chunk or max(1, LOGIT_BUDGET // out_fn.vocab)
    if N * T <= c:  # fits one chunk: the plain computation on the (N, T, V) grid, same numerics
        return _from_logits(out_fn(h), response_ids, response_mask, temperature=temperature,
                            return_entropy=return_entropy, return_logprobs=False,
                            entropy_grad=entropy_grad)
    sel = response_mask.nonzero(as_tuple=True)  # only real response tokens reach the head
    hs, tok = h[:, :-1][sel], response_ids[sel]  # (M, H), (M,): position t predicts token t
    parts = [_selective(out_fn, hs[s : s + c], tok[s : s + c], temperature, return_entropy,
                        entropy_grad) for s in range(0, tok.numel(), c)]
    out = []
    for k in range(2 if return_entropy else 1):  # scatter back to (N, T), 0 where masked
        vals = torch.cat([p[k] for p in parts]) if parts else h.new_zeros(0, dtype=torch.float32)
        out.append(h.new_zeros(response_ids.shape, dtype=torch.float32).index_put(sel, vals))
    return tuple(out) if return_entropy else out[0]


def context_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     response_ids: torch.Tensor, response_mask: torch.Tensor, *, row: torch.Tensor,
                     pos: torch.Tensor, temperature: float = 1.0,
                     chunk: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Next-token log-softmax (nats, float32, at `temperature`) at n chosen contexts only.

    Context i is (row[i], pos[i]): the distribution of response token pos[i] of row row[i]
    (row, pos: (n,) long into the (N, T) response grid). One body forward over the N rows,
    then the LM head on the n contexts' hidden states only, `chunk` contexts at a time
    (default LOGIT_BUDGET // V): yields (start, (c, V) log-softmax of contexts start..start+c).
    Peak logits memory is O(chunk × V), never (N, T, V). Models without a separate LM head
    (FSDP-sharded, not Hugging Face) take the plain (N, T, V) forward and yield one chunk.
    """
    body, head = _body_and_head(model)
    if head is None:
        _, lp = token_logps(model, prompt_ids, prompt_mask, response_ids, response_mask,
                            temperature, return_logprobs=True)
        yield 0, lp[row, pos]
        return
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    h = _hidden(model, body, ids, mask)[:, prompt_ids.shape[1] - 1 :]  # h[:, t] predicts token t
    hs = h[row, pos]  # (n, H)
    del h
    out_fn = _Output(model, body, head)
    c = chunk or max(1, LOGIT_BUDGET // out_fn.vocab)
    for s in range(0, hs.shape[0], c):
        yield s, F.log_softmax(out_fn(hs[s : s + c]).float() / temperature, dim=-1)


@dataclasses.dataclass(frozen=True)
class _HeadOptions:
    """The non-tensor settings of one `_SelectiveLogSoftmax` chunk: logits are divided by
    `temperature`; `entropy` also returns the (c,) entropies; `entropy_grad` lets gradient flow
    through them."""

    temperature: float
    entropy: bool
    entropy_grad: bool = True


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Log-probs of `tok` and the entropy from one (c, V) logits chunk, one exp pass for both.

    Forward: z = out(hs) / temperature in float32 (`out` = the model's own output computation,
    `_Output`); m = max z, e = exp(z − m), s = Σ e, lse = m + log s, lp = z[tok] − lse,
    H = lse − (e · z) / s (= −Σ p log p). The entropy reuses e: one dot product per row, no
    softmax, no second V-wide exp. Saved for backward: hs (c, H), tok, lse, H — never the
    logits. Backward recomputes the chunk's logits with autograd (under the forward's autocast
    state), p = exp(z − lse), dz = g_lp (onehot(tok) − p) − g_H p (z − E_p z), and pulls dz
    back through the model's output computation to hs and the output's parameters.
    """

    @staticmethod
    def forward(ctx, hs, tok, out, opts: _HeadOptions, *params):
        temperature, entropy, entropy_grad = opts.temperature, opts.entropy, opts.entropy_grad
        dev = hs.device.type
        ctx.amp = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        z = _chunk_logits(out, hs, temperature)  # (c, V) float32
        m = z.amax(-1, keepdim=True)
        e = (z - m).exp_()
        s_ = e.sum(-1)
        lse = m.squeeze(-1) + s_.log()
        lp = z.gather(-1, tok[:, None]).squeeze(-1) - lse
        ent = (lse - torch.bmm(e[:, None, :], z[:, :, None]).view(-1) / s_) if entropy \
            else lse.new_zeros(0)
        del z, e
        ctx.out, ctx.temperature, ctx.ent_grad = out, temperature, entropy and entropy_grad
        ctx.save_for_backward(hs, tok, lse, ent)
        if not ctx.ent_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hs, tok, lse, ent = ctx.saved_tensors
        dev, on, dtype = ctx.amp
        params = [p for p in ctx.out.params]
        want = [hs.detach().requires_grad_(ctx.needs_input_grad[0])] + params
        with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=on):
            # (1, c, V), the forward's dtype, with its graph; kept 3-D so autograd does not
            # zero-fill a (1, c, V) buffer to take the row select's gradient
            raw = ctx.out(want[0][None])
        with torch.no_grad():
            z = raw[0].detach().float()
            if ctx.temperature != 1.0:
                z = z / ctx.temperature
            p = (z - lse[:, None]).exp_()  # softmax
            if ctx.ent_grad:  # dH/dz = −p (z − E_p z), E_p z = lse − H
                gz = p * (z.sub_((lse - ent)[:, None]).mul_(-g_ent[:, None]).sub_(g_lp[:, None]))
            else:
                gz = p.mul_(-g_lp[:, None])
            del z
            gz[torch.arange(tok.numel(), device=tok.device), tok] += g_lp
            if ctx.temperature != 1.0:
                gz.div_(ctx.temperature)
        need = [ctx.needs_input_grad[0]] + [p.requires_grad for p in params]
        inputs = [t for t, n in zip(want, need) if n]
        grads = iter(torch.autograd.grad(raw, inputs, gz.to(raw.dtype)[None], allow_unused=True)
                     if inputs else [])
        g = [next(grads) if n else None for n in need]
        g = [None if x is None else x.to(t.dtype) for x, t in zip(g, want)]
        return (g[0], None, None, None, *g[1:])


def _chunk_logits(out, hs: torch.Tensor, temperature: float) -> torch.Tensor:
    """(c, V) float32 logits / temperature of (c, H) hidden states (no copy at T = 1 in fp32)."""
    z = out(hs).float()
    return z / temperature if temperature != 1.0 else z


def _selective(out, hs: torch.Tensor, tok: torch.Tensor, temperature: float, entropy: bool,
               entropy_grad: bool = True):
    """(c,) log-probs of `tok` [and (c,) entropies] from (c, H) hidden states: the (c, V)
    logits live only inside `_SelectiveLogSoftmax` (forward, and recomputed in backward)."""
    opts = _HeadOptions(temperature, entropy, entropy_grad)
    lp, ent = _SelectiveLogSoftmax.apply(hs, tok, out, opts, *out.params)
    return (lp, ent) if entropy else (lp,)


def _grad_if(keep: bool):
    """No-op context when `keep`, else no_grad (never turns grad on inside a no_grad region)."""
    return contextlib.nullcontext() if keep else torch.no_grad()


def decoder(model) -> torch.nn.Module | None:
    """The module whose output holds the final hidden states that `model`'s forward feeds to
    its LM head (`get_decoder()`: OPT's `model.decoder`, GPT-2's `transformer`, Mamba's
    `backbone`, ...); None when the model has no separate one."""
    inner = getattr(model, "module", model)  # DDP keeps the model in .module
    get = getattr(inner, "get_decoder", None)
    try:
        body = get() if callable(get) else None
    except (AttributeError, NotImplementedError, ValueError):
        body = None
    if not isinstance(body, torch.nn.Module) or not any(True for _ in body.children()):
        # a leaf named "decoder" is an output projection (ModernBERT-decoder's), not the body
        body = getattr(inner, "base_model", None)
    return body if isinstance(body, torch.nn.Module) and body is not inner else None


def _body_and_head(model):
    """(decoder, LM head) of a Hugging Face causal LM (plain or DDP-wrapped), else (None, None).

    FSDP-sharded models take the plain path: their head parameters are only gathered inside
    the wrapped forward.
    """
    inner = getattr(model, "module", model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    body = decoder(inner)
    try:
        from torch.distributed.fsdp import FSDPModule
        if isinstance(inner, FSDPModule) or isinstance(head, FSDPModule):
            return None, None
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    if body is None or not isinstance(head, torch.nn.Module) or \
            getattr(head, "weight", None) is None:
        return None, None
    return body, head


class _Hidden(dict):
    """What the decoder returns inside `_Output`: the given hidden states as
    `last_hidden_state` (attribute, key and index 0); any other field (cache, attentions,
    router logits, ...) is None."""

    def __init__(self, h: torch.Tensor):
        super().__init__(last_hidden_state=h)

    def __getitem__(self, key):
        return dict.get(self, "last_hidden_state") if key == 0 else dict.get(self, key)

    def __getattr__(self, name):
        return dict.get(self, name)


class _Output:
    """The model's own output computation as a function of final hidden states:
    out(h) = model.forward with its decoder returning h ((…, H) → (…, V) logits, autograd
    intact). `params`: the parameters it may use (the LM head's and any parameter of the model
    outside the decoder, e.g. a learned logit scale)."""

    def __init__(self, model, body: torch.nn.Module, head: torch.nn.Module):
        self.model, self.body = getattr(model, "module", model), body
        self.vocab = int(head.weight.shape[0])
        inside = {id(p) for p in body.parameters()}
        seen, params = set(), []
        for p in list(head.parameters()) + [p for p in self.model.parameters()
                                            if id(p) not in inside]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        self.params = params

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.dim() == 2
        h3 = h[None] if flat else h  # (B, L, H)
        own = self.body.__dict__.get("forward")  # an instance-level forward (accelerate hooks)
        self.body.forward = lambda *a, **k: _Hidden(h3)  # instance attribute: shadows the class
        try:
            out = self.model(input_ids=torch.zeros(h3.shape[:2], dtype=torch.long,
                                                   device=h3.device),
                             use_cache=False, logits_to_keep=0)
        finally:
            if own is None:
                del self.body.forward
            else:
                self.body.forward = own
        return out.logits[0] if flat else out.logits


def _hidden(model, body, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, L, H) final hidden states (after the body's last norm).

    The call goes through `model` itself (so DDP's forward bookkeeping runs) with
    logits_to_keep=1: its own LM head then builds (N, 1, V) logits only; a forward hook on the
    body hands over the hidden states.
    """
    got = []

    def grab(_module, _args, out):
        got.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    handle = body.register_forward_hook(grab)
    try:
        model(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
              use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return got[0]


def _full(model, ids, mask, response_ids, response_mask, *, temperature, return_entropy,
          return_logprobs, entropy_grad: bool = True):
    """The plain path: the model's own (N, T + 1, V) logits and a full log-softmax."""
    T = response_ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
                use_cache=False, logits_to_keep=T + 1)
    return _from_logits(out.logits, response_ids, response_mask, temperature=temperature,
                        return_entropy=return_entropy, return_logprobs=return_logprobs,
                        entropy_grad=entropy_grad)


def _from_logits(logits, response_ids, response_mask, *, temperature, return_entropy,
                 return_logprobs, entropy_grad: bool = True):
    """logps (N, T) [, entropy (N, T)] [, log-softmax (N, T, V)] from (N, T + 1, V) logits."""
    logits = logits[:, :-1].float() / temperature  # (N, T, V): position t predicts token t
    logprobs = F.log_softmax(logits, dim=-1)
    logps = logprobs.gather(-1, response_ids[..., None]).squeeze(-1)
    logps = logps.masked_fill(~response_mask, 0.0)
    if not (return_entropy or return_logprobs):
        return logps
    result = [logps]
    if return_entropy:
        with _grad_if(entropy_grad):
            ent = -(logprobs.exp() * logprobs).sum(-1)
        result.append(ent.masked_fill(~response_mask, 0.0))
    if return_logprobs:
        result.append(logprobs)
    return tuple(result)


def context_logprobs_fn(model: torch.nn.Module, prompt_ids: torch.Tensor,
                        prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                        response_mask: torch.Tensor, *, row: torch.Tensor, pos: torch.Tensor,
                        temperature: float = 1.0
                        ) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """f(params) → (K, V) log π(·|h_k) at the K contexts (row[k], pos[k]) of a rollout layout,
    params a dict of the model's parameters (`torch.func.functional_call`): the f that
    `gradlab.probes.fisher.kl_and_fisher` differentiates.

    prompt_ids/prompt_mask (N, P) left-padded, response_ids/response_mask (N, T') right-padded
    (the layout of `token_logps`); the context of (r, t) is the prompt of row r and its response
    tokens before t, i.e. the distribution of response token t. The logits stay in the model's
    dtype (use a float64 copy of the model for a precise KL: `gradlab.probes.fisher.float64_meter`).
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    T = response_ids.shape[1]
    kw = dict(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
              use_cache=False, logits_to_keep=T + 1)

    def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = functional_call(model, params, (), kw).logits[:, :-1]  # (N, T', V)
        return F.log_softmax(logits[row, pos] / temperature, dim=-1)

    return f
