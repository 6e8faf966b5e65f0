"""Shared-node structure against a brute-force trie, and property-based invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradlab
from gradlab import objectives
from gradlab.core.cancellation import cancellation
from gradlab.testing import random_batch


def brute_nodes(b, kind):
    """{(group, t, frozenset(rows))} by direct comparison of prefixes, one pair at a time."""
    out = set()
    B, T = b.tokens.shape
    rows_of = {}
    for i in range(B):
        rows_of.setdefault(int(b.group[i]), []).append(i)
    for g, rows in rows_of.items():
        for t in range(T):
            for i in rows:
                if not b.mask[i, t]:
                    continue
                S = frozenset(
                    j for j in rows
                    if b.mask[j, :t + 1].tolist() == b.mask[i, :t + 1].tolist()
                    and all(b.tokens[j, u] == b.tokens[i, u] for u in range(t + 1) if b.mask[i, u])
                )
                if len(S) >= 2 and (kind == "trie" or len(S) == len(rows)):
                    out.add((g, t, S))
    return out


def found_nodes(b, kind):
    sn = gradlab.shared_nodes(b, kind)
    return {(int(sn.group[n]), int(sn.position[n]), frozenset(sn.members(n).tolist()))
            for n in range(sn.n)}


def test_nodes_match_brute_force():
    for seed in range(6):
        b = random_batch(n_groups=3, G=5, T=9, seed=seed, vocab=2, prefix=2)
        for kind in ("prefix", "trie"):
            assert found_nodes(b, kind) == brute_nodes(b, kind)


def test_node_fields_are_consistent():
    b = random_batch(n_groups=4, G=4, T=10, seed=7, vocab=2)
    sn = gradlab.shared_nodes(b, "trie")
    for n in range(sn.n):
        m = sn.members(n)
        assert len(m) == int(sn.size[n]) and int(sn.rep[n]) == int(m.min())
        assert (b.tokens[m, sn.position[n]] == sn.token[n]).all()
        assert bool(sn.full[n]) == (len(m) == int((b.group == sn.group[n]).sum()))


def test_groups_of_different_sizes_and_labels():
    b = random_batch(n_groups=2, G=3, T=6, seed=0, prefix=2)
    # relabel groups with arbitrary values and add a group of one
    extra = b.tokens[:1] + 100
    tb = gradlab.TokenBatch(
        torch.cat([b.tokens, extra]), torch.cat([b.mask, b.mask[:1]]),
        torch.cat([b.logps, b.logps[:1]]), torch.cat([b.old_logps, b.old_logps[:1]]),
        torch.cat([b.advantages, torch.zeros(1, dtype=torch.float64)]),
        torch.cat([b.group * 7 + 3, torch.tensor([-5])]))
    for kind in ("prefix", "trie"):
        assert found_nodes(tb, kind) == brute_nodes(tb, kind)
    assert (gradlab.shared_nodes(tb, "trie").node[-1] == -1).all()  # a group of one shares nothing


@st.composite
def batches(draw):
    return random_batch(
        n_groups=draw(st.integers(1, 4)), G=draw(st.integers(2, 6)), T=draw(st.integers(1, 10)),
        prefix=draw(st.integers(0, 3)), vocab=draw(st.integers(1, 3)), seed=draw(st.integers(0, 10**6)),
        off_policy=draw(st.sampled_from([0.0, 0.2, 1.0])), min_len=draw(st.integers(0, 2)),
    )


@settings(max_examples=60, deadline=None)
@given(batches())
def test_property_nodes_and_cancellation(b):
    for kind in ("prefix", "trie"):
        assert found_nodes(b, kind) == brute_nodes(b, kind)
    for name, kw in [("grpo", {"norm": "const"}), ("gspo", {}), ("dfpo-min", {}),
                     ("dfpo-orth", {}), ("grpo-fix", {})]:
        obj = objectives.get(name, **kw)
        W = obj.modulation(b)
        assert torch.isfinite(W).all()
        for kind in ("prefix", "trie"):
            rep = cancellation(W, b, kind)
            # in [0, 1], or NaN exactly when undefined: no node or W ≡ 0 at its nodes
            assert 0.0 <= rep.ratio <= 1.0 if rep.mass > 0 else math.isnan(rep.ratio)
        if name != "gspo" and not (name == "grpo" and float((b.logps - b.old_logps).abs().max()) > 0):
            assert not cancellation(W, b, "prefix").ratio > 1e-12, name  # 0, or NaN: no mass


def test_full_group_of_trie_equals_prefix():
    for seed in range(4):
        b = random_batch(n_groups=3, G=4, T=8, seed=seed, vocab=2)
        a, t = gradlab.shared_nodes(b, "prefix"), gradlab.shared_nodes(b, "trie").full_group()
        for f in ("node", "group", "position", "size", "token", "rep", "full"):
            assert torch.equal(getattr(a, f), getattr(t, f)), f


def test_trie_ratio_stays_in_unit_interval_when_residual_opposes_subset_credit():
    """A subset node whose net coefficient has the opposite sign of its credit: |d| > Σ|W|."""
    tokens = torch.tensor([[1, 2, 5], [1, 2, 6], [1, 3, 7]])
    mask = torch.ones(3, 3, dtype=torch.bool)
    z = torch.zeros(3, 3, dtype=torch.float64)
    A = torch.tensor([1.0, 0.5, -1.5], dtype=torch.float64)  # subset {0, 1} has credit +1.5
    b = gradlab.TokenBatch(tokens, mask, z, z, A, torch.zeros(3, dtype=torch.long))
    W = torch.tensor([[0.0, -1.0, 0], [0.0, -1.0, 0], [0.0, 0.0, 0]], dtype=torch.float64)
    rep = cancellation(W, b, "trie")
    k = rep.coef
    sub = (~k.sn.full).nonzero().squeeze(-1)
    assert float(k.d[sub].abs().sum()) > float(k.mass[sub].sum())  # ρ's normaliser in docs/concepts/shared-nodes.md > 1
    assert rep.ratio == pytest.approx(4.0 / 4.0)  # |d| = |−2 − 2| over Σ|W| + |c*| = 2 + 2


def test_no_shared_token_anywhere():
    """Responses that differ from their first token: no nodes, ρ = 0, and the loop's
    trie → prefix path works."""
    b = gradlab.TokenBatch(torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2, dtype=torch.bool),
                           torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([1.0, -1.0]),
                           torch.tensor([0, 0]))
    trie = gradlab.shared_nodes(b, "trie")
    assert trie.n == 0 and trie.full_group().n == 0 and trie.full_group().kind == "prefix"
    assert (trie.full_group().node == -1).all()
    assert math.isnan(cancellation(torch.ones(2, 2), b, sn=trie.full_group()).ratio)  # no node
