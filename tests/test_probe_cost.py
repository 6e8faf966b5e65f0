"""The per-token entropy every loop step logs comes from the logits chunk already in memory:
inside the chunked selective log-softmax it reuses the logsumexp's exp pass (one dot product
per token, no softmax, no second V-wide pass), and as a reading (entropy_grad=False) it adds
nothing to the backward. Values and gradients are unchanged, bit for bit."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3Config, Qwen3ForCausalLM

from gradlab.loop.numerics.logprobs import token_logps


class _Count(TorchDispatchMode):
    """Counts aten ops by name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _setup(vocab: int = 257):
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      max_position_embeddings=64, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    N, P, T = 4, 3, 9
    rm = torch.arange(T)[None] < torch.tensor([9, 4, 7, 2])[:, None]
    batch = (torch.randint(2, vocab, (N, P), generator=g), torch.ones(N, P, dtype=torch.bool),
             torch.randint(2, vocab, (N, T), generator=g) * rm, rm)
    return model, batch


def _run(model, batch, chunk, entropy, entropy_grad=False):
    """(logps, entropy or None, grads, forward ops, backward ops) of a loss on the log-probs."""
    model.zero_grad(set_to_none=True)
    with _Count() as fwd:
        out = token_logps(model, *batch, 0.9, return_entropy=entropy, chunk=chunk,
                          entropy_grad=entropy_grad)
    lp, ent = out if entropy else (out, None)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    loss = (w * lp).sum()
    with _Count() as bwd:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return lp.detach(), ent, grads, fwd.ops, bwd.ops


def test_entropy_from_the_same_chunk_no_second_pass():
    """Chunked path: asking for the entropy adds a bmm (the dot product e · z per token) and
    no exp, softmax or log-softmax; as a reading its backward is the log-probs' own."""
    model, batch = _setup()
    lp_n, _, g_n, fwd_n, bwd_n = _run(model, batch, 4, False)
    lp_e, ent, g_e, fwd_e, bwd_e = _run(model, batch, 4, True)
    assert not ent.requires_grad
    assert fwd_n.get("exp_", 0) > 0  # the chunks' one exp pass (attention has its own softmax)
    for op in ("exp", "exp_", "_softmax", "_log_softmax", "logsumexp"):
        assert fwd_e.get(op, 0) == fwd_n.get(op, 0), op
    assert fwd_e.get("bmm", 0) > fwd_n.get("bmm", 0)
    assert bwd_e == bwd_n
    assert torch.equal(lp_e, lp_n) and all(torch.equal(g_e[n], g_n[n]) for n in g_n)


def test_entropy_reading_same_values_as_with_graph():
    model, batch = _setup()
    for chunk in (4, None):  # chunked path and the one-chunk plain grid
        lp1, ent1, g1, _, _ = _run(model, batch, chunk, True, True)
        lp0, ent0, g0, _, _ = _run(model, batch, chunk, True, False)
        assert ent1.requires_grad and not ent0.requires_grad
        assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1.detach())
        assert all(torch.equal(g0[n], g1[n]) for n in g1)


def test_shared_drift_in_row_chunks_is_the_one_pass_figure():
    """shared_drift takes the KL a few nodes at a time (bounded temporaries): the sums equal the
    one-pass kl_rows(...).sum() and dlogp sum bit for bit, for chunk sizes that do not divide N."""
    from gradlab.probes.drift import kl_rows, shared_drift

    g = torch.Generator().manual_seed(0)
    before = torch.randn(37, 1001, generator=g).log_softmax(-1)
    after = (before + 0.1 * torch.randn(37, 1001, generator=g)).log_softmax(-1)
    tok = torch.randint(0, 1001, (37,), generator=g)
    ref_kl = kl_rows(before, after).sum()
    ref_d = (after.gather(-1, tok[:, None]) - before.gather(-1, tok[:, None])).sum()
    for rows in (1, 5, 36, 37, 100, None):
        out = shared_drift(before, after, tok, rows=rows)
        assert torch.equal(out["node_kl_sum"], ref_kl), rows
        assert torch.equal(out["node_dlogp_sum"], ref_d)
        assert int(out["node_count"]) == 37
