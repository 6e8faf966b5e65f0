"""IBPO (docs/concepts/ibpo.md): token advantages in every objective, the trie and repair estimators and
their seven properties, LCS alignment, and the `ibpo` objective (closed form = autograd)."""

import itertools
import math

import pytest
import torch

import gradlab
from gradlab import objectives
from gradlab.core.batch import TokenBatch, advantages
from gradlab.core.cancellation import cancellation
from gradlab.core.credit import branch_tokens, trie_values
from gradlab.core.nodes import shared_nodes
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.testing import measure_modulation, random_batch

TRIE_FORMS = ("ga", "la", "ga+la")


def _trie_batch(seed=0, n_groups=3, G=6, T=9, vocab=2, prefix=2, off=0.3, distinct=True):
    """Groups sharing `prefix` tokens then a small-alphabet trie; rows shuffled, right padded,
    each ending in an end-of-sequence token. distinct: identical rows get equal rewards (a
    deterministic verifier)."""
    b = random_batch(n_groups=n_groups, G=G, T=T, prefix=prefix, vocab=vocab, seed=seed,
                     off_policy=off, min_len=prefix + 2)
    tokens = b.tokens.clone()
    tokens[torch.arange(b.B), b.lengths - 1] = 999  # EOS
    b = b.replace(tokens=tokens)
    if distinct:
        R = b.rewards.clone()
        key = [tuple(b.tokens[i][b.mask[i]].tolist()) for i in range(b.B)]
        for i, j in itertools.combinations(range(b.B), 2):
            if key[i] == key[j]:
                R[j] = R[i]
        b = b.replace(rewards=R, advantages=advantages(R, b.group))
    return b


def _pa(b, form, reweight="none"):
    return gradlab.process_advantages(b.tokens, b.mask, b.group, b.rewards, form, reweight)


# ------------------------------------------------------------ token advantages, every objective
ALL = [(n, {}) for n in objectives.names() if n != "ibpo"] + [
    ("grpo", {"norm": "seq"}), ("grpo", {"norm": "const"}), ("grpo", {"beta": 0.1}),
    ("dfpo", {"base": "grpo"}), ("dfpo", {"base": "gspo-token", "nodes": "trie"}),
    ("dfpo-orth", {"nodes": "trie", "clip": "free"}), ("gspo", {"eps": (0.2, 0.2)})]


@pytest.mark.parametrize("name,params", ALL, ids=[f"{n}{p}" for n, p in ALL])
def test_token_advantages_closed_form_equals_autograd(name, params):
    b = random_batch(n_groups=3, G=4, T=10, off_policy=0.5, seed=3)
    b = b.replace(ref_logps=b.old_logps - 0.1)
    A = torch.randn(b.B, b.T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    obj = objectives.get(name, **params)
    for adv in (A, b.advantages.unsqueeze(-1).expand(b.B, b.T)):
        bt = b.replace(advantages=adv)
        W, ref = obj.modulation(bt), measure_modulation(obj.loss, bt)
        assert (W - ref).abs().max() <= 1e-12 * ref.abs().max(), name
    # (B, T) advantages equal along each row give the (B,) objective's W and loss
    bt = b.replace(advantages=b.advantages.unsqueeze(-1).expand(b.B, b.T).contiguous())
    assert torch.allclose(obj.modulation(bt), obj.modulation(b), rtol=1e-12, atol=1e-15)
    assert torch.allclose(obj.loss(bt), obj.loss(b), rtol=1e-12, atol=1e-15)


def test_no_stop_grad_dfpo_refuses_token_advantages():
    b = random_batch()
    bt = b.replace(advantages=b.advantages.unsqueeze(-1).expand(b.B, b.T))
    with pytest.raises(ValueError, match="per-sequence advantages"):
        objectives.get("dfpo", stop_grad=False).loss(bt)


def test_token_advantages_shape_checked():
    b = random_batch()
    with pytest.raises(ValueError, match="TokenBatch.advantages has shape"):
        b.replace(advantages=torch.zeros(b.B, b.T + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="TokenBatch.rewards has shape"):
        b.replace(rewards=torch.zeros(b.B + 1, dtype=torch.float64))


# ------------------------------------------------------------------------- the trie estimator
@pytest.mark.parametrize("seed", range(4))
def test_prop1_no_advantage_at_full_group_prefix(seed):
    b = _trie_batch(seed)
    sn = shared_nodes(b, "prefix")
    at = sn.node >= 0
    assert at.sum() > 0
    for form in TRIE_FORMS:
        assert (_pa(b, form)[at] == 0).all(), form
        for base in ("grpo", "gspo"):
            ib = objectives.get("ibpo", form=form, base=base)
            rep = cancellation(ib.modulation(b), ib.prepare(b), "prefix")
            # W ≡ 0 at full-group nodes: nothing to cancel (ρ undefined), no residual
            assert math.isnan(rep.ratio) and rep.residual == 0.0 and rep.mass == 0.0, (form, base)


@pytest.mark.parametrize("seed", range(4))
def test_prop2_children_cancel_at_every_branch_node(seed):
    b = _trie_batch(seed)
    LA = _pa(b, "la")
    sn = shared_nodes(b, "trie")
    checked = 0
    for n in range(sn.n):
        mem, t = sn.members(n), int(sn.position[n])
        if t + 1 < b.T and bool(b.mask[mem, t + 1].all()):
            assert abs(float(LA[mem, t + 1].sum())) < 1e-12
            checked += 1
    for g in b.group.unique():  # the root's children: the first tokens
        assert abs(float(LA[b.group == g, 0].sum())) < 1e-12
    assert checked > 0


@pytest.mark.parametrize("seed", range(4))
def test_prop3_reward_to_go_telescopes(seed):
    b = _trie_batch(seed)
    TG, LA = _pa(b, "togo"), _pa(b, "la")
    mean = advantages(b.rewards, b.group, scale="none")
    assert torch.allclose(TG[:, 0], mean, atol=1e-12)
    suffix = LA.flip(-1).cumsum(-1).flip(-1)  # Σ_{t' ≥ t} LA
    assert torch.allclose(TG[b.mask], suffix[b.mask], atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_prop4_members_of_a_trie_node_share_their_advantage(seed):
    b = _trie_batch(seed, distinct=False)
    sn = shared_nodes(b, "trie")
    for form in TRIE_FORMS + ("ga+la",):
        A = _pa(b, form, "sqrt")
        for n in range(sn.n):
            v = A[sn.members(n), int(sn.position[n])]
            assert (v == v[0]).all(), (form, n)
        for base in ("grpo", "gspo"):
            ib = objectives.get("ibpo", form=form, base=base)
            assert cancellation(ib.modulation(b), ib.prepare(b), "trie").ratio < 1e-12
    # togo carries R_i: members of a node with different rewards get different A there
    TG = _pa(b, "togo")
    assert any(TG[sn.members(n), int(sn.position[n])].unique().numel() > 1 for n in range(sn.n))


def test_prop5_no_shared_tokens_is_grpo():
    G, T = 4, 6
    tokens = torch.tensor([[k + 1] + [5] * (T - 1) for k in range(G)] * 2)  # first tokens differ
    group = torch.arange(2).repeat_interleave(G)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 4:] = False
    R = torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1], dtype=torch.float64)
    grpo = advantages(R, group, scale="none").unsqueeze(-1) * mask
    first = torch.zeros(T, dtype=torch.float64)
    first[0] = 1.0  # the only branch point is the root: LA lives on the first token
    for form, ref in (("ga", grpo), ("togo", grpo * first), ("la", grpo * first), ("ga+la", grpo * (1 + first))):
        A = gradlab.process_advantages(tokens, mask, group, R, form)
        assert torch.allclose(A, ref, atol=1e-15), form
    none = torch.full((2 * G,), -1)
    for lam, ref in ((0.0, none.clone().index_fill_(0, torch.tensor([1]), 0)), (0.7, none)):
        A = gradlab.repair_advantages(tokens, mask, group, R, ref, lam)
        assert torch.allclose(A, grpo, atol=1e-15)
    # and the objective, scaled like `advantages`, is token-level GRPO
    b = TokenBatch(tokens, mask, torch.zeros(8, T, dtype=torch.float64),
                   torch.zeros(8, T, dtype=torch.float64), advantages(R, group), group, rewards=R)
    W_ib = objectives.get("ibpo", form="ga").modulation(b)
    assert torch.allclose(W_ib, objectives.get("grpo").modulation(b), rtol=1e-10, atol=1e-15)


def test_trie_values_on_a_hand_built_group():
    # rows: a b c | a b d | a e | a b c  (rewards 1, 0, 0, 1); T = 3, row 2 is 2 tokens long
    tokens = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 0], [1, 2, 3]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    R = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    tv = trie_values(tokens, mask, torch.zeros(4, dtype=torch.long), R)
    assert tv.node.tolist() == [[0.5, 2 / 3, 1.0], [0.5, 2 / 3, 0.0], [0.5, 0.0, 0.0],
                                [0.5, 2 / 3, 1.0]]
    assert tv.parent[:, 0].tolist() == [0.5] * 4 and tv.parent[1, 2] == pytest.approx(2 / 3)
    assert tv.size.tolist() == [[4, 3, 2], [4, 3, 1], [4, 1, 0], [4, 3, 2]]
    assert branch_tokens(tokens, mask, torch.zeros(4, dtype=torch.long)).tolist() == [
        [False, True, True], [False, True, True], [False, True, False], [False, True, True]]
    sq = gradlab.process_advantages(tokens, mask, torch.zeros(4, dtype=torch.long), R, "ga", "sqrt")
    assert sq[1, 1] == pytest.approx((2 / 3 - 0.5) / 3 ** 0.5)


def test_process_advantages_bad_input():
    b = _trie_batch()
    with pytest.raises(ValueError, match="unknown form"):
        _pa(b, "gae")
    with pytest.raises(ValueError, match="reward of row 2"):
        R = b.rewards.clone()
        R[2] = float("nan")
        gradlab.process_advantages(b.tokens, b.mask, b.group, R)


# ------------------------------------------------------------------- alignment and the repair
@pytest.mark.parametrize("a,b,ea,eb", [
    ([1, 2, 3, 4], [1, 2, 5, 4], [0, 0, 1, 0], [0, 0, 1, 0]),  # replace
    ([1, 2, 3], [1, 2, 9, 3], [0, 0, 1], [0, 0, 1, 0]),  # insert: a's token there is the decision
    ([1, 2, 9, 3], [1, 2, 3], [0, 0, 1, 0], [0, 0, 1]),  # delete
    ([1, 2, 3, 4, 5], [1, 2, 7, 8], [0, 0, 1, 1, 1], [0, 0, 1, 1]),  # rewrite the tail
    ([1, 2], [1, 2, 3], [0, 1], [0, 0, 1]),  # insert at the end
    ([4, 5, 6], [4, 5, 6], [0, 0, 0], [0, 0, 0]),
])
def test_edited_tokens_constructed(a, b, ea, eb):
    al = gradlab.edited_tokens(a, b)
    assert al.edited_a.tolist() == [bool(x) for x in ea]
    assert al.edited_b.tolist() == [bool(x) for x in eb]


def _lcs_len(a, b):
    L = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, j in itertools.product(range(len(a)), range(len(b))):
        L[i + 1][j + 1] = L[i][j] + 1 if a[i] == b[j] else max(L[i][j + 1], L[i + 1][j])
    return L[-1][-1]


def test_edited_tokens_is_a_longest_common_subsequence():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        a = torch.randint(0, 3, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
        b = torch.randint(0, 3, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
        al = gradlab.edited_tokens(a, b)
        p = al.pairs
        assert len(p) == _lcs_len(a.tolist(), b.tolist())
        if len(p):
            assert (a[p[:, 0]] == b[p[:, 1]]).all()
            assert (p[1:] > p[:-1]).all()
        for x, edited, col in ((a, al.edited_a, 0), (b, al.edited_b, 1)):
            unmatched = torch.ones(len(x), dtype=torch.bool)
            unmatched[p[:, col]] = False
            assert edited[unmatched].all()  # every unmatched token is edited
        if a.tolist() != b.tolist():
            assert al.edited_a.any() or len(a) == 0
            assert al.edited_b.any() or len(b) == 0


def _repair_batch():
    """Group 0: rows 0 (correct reference), 1 (wrong), 2 (row 1 repaired); group 1: no repair."""
    tokens = torch.tensor([[3, 4, 5, 6, 1], [3, 4, 7, 8, 1], [3, 4, 5, 8, 1], [3, 9, 1, 0, 0],
                           [3, 4, 1, 0, 0]])
    mask = tokens != 0
    group = torch.tensor([0, 0, 0, 1, 1])
    R = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    return tokens, mask, group, R, torch.tensor([-1, -1, 1, -1, -1])


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_prop6_repair_sums_and_kept_tokens(lam):
    tokens, mask, group, R, ref = _repair_batch()
    A = gradlab.repair_advantages(tokens, mask, group, R, ref, lam)
    Ai = advantages(R, group, scale="none")
    D, T = 1.0, 5
    assert float(A[2].sum()) == pytest.approx(T * ((1 - lam) * float(Ai[2]) + lam * D))
    assert float(A[1].sum()) == pytest.approx(T * ((1 - lam) * float(Ai[1]) - lam * D))
    al = gradlab.edited_tokens(tokens[1][mask[1]], tokens[2][mask[2]])
    assert al.edited_a.tolist() == [False, False, True, False, False]  # 7 → 5; 8 and EOS kept
    kept = ~al.edited_a
    assert torch.allclose(A[1, :5][kept], (1 - lam) * Ai[1].expand(int(kept.sum())))
    assert torch.equal(A[3:], (Ai[3:].unsqueeze(-1) * mask[3:]).to(A.dtype))  # no repair


def test_repair_of_errors_and_failed_repairs():
    tokens, mask, group, R, ref = _repair_batch()
    for bad, msg in ((torch.tensor([-1, -1, 3, -1, -1]), "different groups"),
                     (torch.tensor([-1, -1, 2, -1, -1]), "another row"),
                     (torch.tensor([1, -1, 1, -1, -1]), "repaired twice")):
        with pytest.raises(ValueError, match=msg):
            gradlab.repair_advantages(tokens, mask, group, R, bad)
    R2 = R.clone()
    R2[2] = 0.0  # the repair failed: D = 0, no edited credit
    A = gradlab.repair_advantages(tokens, mask, group, R2, ref, 1.0)
    assert torch.allclose(A, advantages(R2, group, scale="none").unsqueeze(-1) * mask)


# --------------------------------------------------------------------------------- the objective
FORMS = ("ga", "la", "ga+la", "togo", "repair")


@pytest.mark.parametrize("form,base", list(itertools.product(FORMS, ("grpo", "gspo"))))
@pytest.mark.parametrize("off", [0.0, 0.6])
def test_prop7_ibpo_closed_form_equals_autograd(form, base, off):
    b = _trie_batch(seed=5, off=off)  # padding, groups not contiguous
    if form == "repair":  # a repair pair in every group: the first two rows of each group
        ref = torch.full((b.B,), -1)
        for g in b.group.unique():
            rows = (b.group == g).nonzero().squeeze(-1)
            lo, hi = sorted(rows[:2].tolist(), key=lambda r: float(b.rewards[r]))
            if b.rewards[hi] > b.rewards[lo]:
                ref[hi] = lo
        b = b.replace(repair_of=ref)
    for params in ({"form": form, "base": base}, {"form": form, "base": base, "reweight": "sqrt",
                                                   "lam": 0.9, "scale": "none"}):
        ib = objectives.get("ibpo", **params)
        W, ref_W = ib.modulation(b), measure_modulation(ib.loss, b)
        assert ref_W.abs().max() > 0
        assert (W - ref_W).abs().max() <= 1e-12 * ref_W.abs().max(), params


def test_ibpo_registry_and_errors():
    ib = objectives.get("ibpo[form=ga+la, base=gspo, reweight=sqrt]")
    assert (ib.form, ib.reweight, type(ib.base).__name__) == ("ga+la", "sqrt", "GSPOToken")
    RunConfig(objectives=["grpo", "ibpo[form=ga+la]", "ibpo[form=togo,base=gspo]"])
    for bad in ("ibpo[form=gae]", "ibpo[base=dfpo]", "ibpo[lam=2]", "ibpo[base=gspo,norm=seq]"):
        with pytest.raises(ValueError, match="ibpo"):
            objectives.get(bad)
    with pytest.raises(ConfigError, match="needs --rollout repair"):
        RunConfig(objectives=["grpo", "ibpo[form=repair]"])
    RunConfig(objectives=["grpo", "ibpo[form=repair]"], rollout="repair")
    with pytest.raises(ConfigError, match="adv-scale batch"):
        RunConfig(objectives=["ibpo"], adv_scale="batch", micro_batch=8, G=8)
    b = random_batch()
    with pytest.raises(ValueError, match="no rewards"):
        objectives.get("ibpo").loss(b.replace(rewards=None))
    with pytest.raises(ValueError, match="--rollout repair"):
        objectives.get("ibpo", form="repair").loss(b)


def test_ibpo_scale_matches_advantages():
    b = _trie_batch()
    for scale in ("group", "batch", "none"):
        A = objectives.get("ibpo", form="ga", scale=scale).token_advantages(b)
        raw = _pa(b, "ga")
        div = advantages(b.rewards, b.group, scale) / advantages(b.rewards, b.group, "none")
        ok = advantages(b.rewards, b.group, "none") != 0
        assert torch.allclose(A[ok], (raw * div.unsqueeze(-1))[ok], rtol=1e-10)


def test_bench_nodes_quick_runs():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "analyses.benchmarks.bench_nodes", "--quick",
                          "--repeats", "1"], capture_output=True, text=True, check=True,
                         cwd=root).stdout
    assert "IBPO trie advantages" in out and "| 4 × 4 × 64 |" in out


def _brute_force(tokens, mask, group, R, form):
    """Per-token advantages from a Python dict of prefixes: an independent computation."""
    rows = range(tokens.shape[0])
    seq = [tuple(tokens[i][mask[i]].tolist()) for i in rows]
    vals: dict = {}
    for i in rows:
        for t in range(-1, len(seq[i])):
            vals.setdefault((int(group[i]), seq[i][: t + 1]), []).append(float(R[i]))
    V = {k: sum(v) / len(v) for k, v in vals.items()}
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for i in rows:
        g, root = int(group[i]), V[(int(group[i]), ())]
        for t in range(len(seq[i])):
            c, p = V[(g, seq[i][: t + 1])], V[(g, seq[i][:t])]
            out[i, t] = {"ga": c - root, "la": c - p, "ga+la": 2 * c - root - p,
                         "togo": float(R[i]) - p}[form]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_trie_advantages_against_brute_force_with_unequal_groups(seed):
    b = _trie_batch(seed, G=6)
    keep = torch.ones(b.B, dtype=torch.bool)
    keep[torch.randperm(b.B, generator=torch.Generator().manual_seed(seed))[:5]] = False
    s = b.rows(keep)
    tokens, mask, group, R = s.tokens, s.mask, s.group, s.rewards
    assert len(set(torch.bincount(group).tolist())) > 1  # groups of different sizes
    for form in ("ga", "la", "ga+la", "togo"):
        A = gradlab.process_advantages(tokens, mask, group, R, form)
        assert torch.allclose(A, _brute_force(tokens, mask, group, R, form), atol=1e-12), form


def test_prepare_caches_the_token_advantages_and_follows_every_input():
    b = _trie_batch(seed=4)
    ib = objectives.get("ibpo[form=togo]")
    A1 = ib.prepare(b).advantages
    assert ib.prepare(b.replace(logps=b.logps * 1.1)).advantages is A1  # logps: cached
    r2 = b.rewards.flip(0)
    A2 = ib.prepare(b.replace(rewards=r2)).advantages
    assert torch.equal(A2, objectives.get("ibpo[form=togo]").token_advantages(b.replace(rewards=r2)))
    b.rewards.mul_(2.0)  # in place: the version counter moves, the cache follows
    assert torch.equal(ib.prepare(b).advantages, objectives.get("ibpo[form=togo]").token_advantages(b))
    ib.form = "la"
    assert torch.equal(ib.prepare(b).advantages, objectives.get("ibpo[form=la]").token_advantages(b))


@pytest.mark.parametrize("lam", [0.0, 0.5, 2.0])
def test_la_weight_is_grpo_plus_a_dose_of_la(lam):
    """ibpo[la_weight=λ] = ga + λ·la per token (against the two forms computed separately);
    λ = 0 is form ga exactly (GRPO's update); W hook = closed form at every λ."""
    b = _trie_batch(seed=7, off=0.3)
    A = gradlab.process_advantages(b.tokens, b.mask, b.group, b.rewards, "ga+la", la_weight=lam)
    assert torch.allclose(A, _pa(b, "ga") + lam * _pa(b, "la"), atol=1e-12, rtol=0)
    ib = objectives.get(f"ibpo[la_weight={lam}]")
    W, ref_W = ib.modulation(b), measure_modulation(ib.loss, b)
    assert (W - ref_W).abs().max() <= 1e-12 * ref_W.abs().max()
    if lam == 0.0:
        assert torch.equal(W, objectives.get("ibpo[form=ga]").modulation(b))
    with pytest.raises(ValueError, match="la_weight"):
        objectives.get("ibpo[form=togo, la_weight=0.5]")
    with pytest.raises(ValueError, match="la_weight"):
        objectives.get("ibpo[la_weight=-1]")
