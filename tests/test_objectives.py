"""Closed-form W against the autograd gradient of each loss, and the exchangeability invariants."""

import math

import pytest
import torch

import gradlab
from gradlab import objectives
from gradlab.core.cancellation import cancellation
from gradlab.core.dfpo import node_map, transform_weights
from gradlab.testing import measure_modulation, random_batch

COMBOS = [
    ("grpo", {}),
    ("grpo", {"norm": "seq"}),
    ("grpo", {"norm": "const"}),
    ("grpo", {"norm": "const", "max_len": 20}),
    ("grpo", {"eps": (0.05, 0.08), "norm": "seq"}),
    ("grpo-fix", {}),
    ("grpo-fix", {"nodes": "prefix", "eps": (0.05, 0.05)}),
    ("gspo", {}),
    ("gspo", {"eps": (0.1, 0.1)}),
    ("gspo-token", {"eps": (0.1, 0.1)}),
    ("gspo-token", {}),
    ("grpo", {"beta": 0.05}),
    ("gspo", {"beta": 0.1, "eps": (0.2, 0.2)}),
    ("dfpo", {"beta": 0.1, "eps": (0.2, 0.2)}),
]
for transform in ("min", "orth", "scale"):
    for scope in ("shared", "all"):
        for nodes in ("prefix", "trie"):
            for stop_grad in (True, False):
                COMBOS.append(("dfpo", {"transform": transform, "scope": scope, "nodes": nodes,
                                        "stop_grad": stop_grad, "eps": (0.1, 0.1)}))
COMBOS += [("dfpo-min", {}), ("dfpo-orth", {}), ("dfpo", {"base": "grpo", "transform": "orth"}),
           ("dfpo", {"base": "gspo-token", "transform": "min", "nodes": "trie"}),
           ("dfpo", {"transform": "scale", "factor": 0.25})]


def _with_ref(b):
    return b.replace(ref_logps=b.old_logps - 0.2 * torch.sin(b.old_logps))


@pytest.mark.parametrize("name,params", COMBOS, ids=[f"{n}-{p}" for n, p in COMBOS])
@pytest.mark.parametrize("seed", [0, 1])
def test_modulation_equals_autograd(name, params, seed):
    b = _with_ref(random_batch(n_groups=3, G=4, T=10, seed=seed, off_policy=0.4))
    obj = objectives.get(name, **params)
    W_closed = obj.modulation(b)
    W_auto = measure_modulation(obj.loss, b)
    assert W_closed.dtype == torch.float64
    scale = W_auto.abs().max()
    assert scale > 0
    assert torch.allclose(W_closed, W_auto, rtol=0, atol=1e-10 * float(scale)), (
        float((W_closed - W_auto).abs().max()), float(scale))
    assert (W_closed[~b.mask] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "gspo", "dfpo-min", "dfpo-orth", "grpo-fix"])
def test_clipping_is_active_in_the_combo_batches(name):
    """The equality tests above must see clipped tokens, else they prove less than they claim."""
    b = random_batch(n_groups=3, G=4, T=10, seed=0, off_policy=0.4)
    eps = (0.05, 0.05)
    obj = objectives.get(name, eps=eps)
    assert float(obj.stats(b)["clip_frac"]) > 0


def test_gspo_token_equals_gspo():
    b = random_batch(seed=3, off_policy=0.3)
    a, c = objectives.get("gspo", eps=(0.1, 0.1)), objectives.get("gspo-token", eps=(0.1, 0.1))
    assert torch.allclose(a.loss(b), c.loss(b), atol=1e-12)
    assert torch.allclose(a.modulation(b), c.modulation(b), atol=1e-14)


def test_dfpo_stop_grad_loss_value_is_base_value():
    b = random_batch(seed=4)
    assert torch.allclose(objectives.get("dfpo-orth").loss(b), objectives.get("gspo").loss(b))


# --- exchangeability (docs/concepts/shared-nodes.md) ---------------------------------------------------------

def _rho(obj, b, nodes="prefix"):
    return cancellation(obj.modulation(b), b, nodes).ratio


@pytest.mark.parametrize("seed", range(4))
def test_exchangeable_objectives_cancel(seed):
    on = random_batch(seed=seed, off_policy=0.0, n_groups=4, G=5, T=12)
    off = random_batch(seed=seed, off_policy=0.6, n_groups=4, G=5, T=12)
    assert cancellation(on.mask.double(), on).n_nodes > 0
    # "not ρ > tol": ρ is 0 up to round-off, or NaN where W ≡ 0 at the nodes (nothing to cancel)
    for norm in ("token", "const"):
        assert not _rho(objectives.get("grpo", norm=norm), on) > 1e-12
    for b in (on, off):
        assert not _rho(objectives.get("grpo-fix", eps=(0.05, 0.05)), b) > 1e-12
        assert not _rho(objectives.get("grpo-fix", eps=(0.05, 0.05)), b, "trie") > 1e-12
        for t in ("min", "orth"):
            for base in ("gspo", "grpo"):
                obj = objectives.get("dfpo", transform=t, base=base, eps=(0.05, 0.05))
                assert not _rho(obj, b) > 1e-12
            assert not _rho(objectives.get("dfpo", transform=t, nodes="trie"), b) > 1e-12


def test_non_exchangeable_objectives_leave_a_residual():
    on = random_batch(seed=0, off_policy=0.0)
    off = random_batch(seed=0, off_policy=0.6)
    assert _rho(objectives.get("grpo", norm="seq"), on) > 1e-3  # unequal lengths
    assert _rho(objectives.get("gspo", eps=(10, 10)), off) > 1e-3  # sequence coupling
    assert _rho(objectives.get("gspo"), off) > 1e-3  # coupling + clipping
    assert _rho(objectives.get("dfpo", transform="scale"), off) > 1e-3  # scaling is no fix
    # a clip active at a shared token: one sign survives
    clipped = objectives.get("grpo", norm="const", eps=(0.01, 0.01))
    sn = gradlab.shared_nodes(off, "prefix")
    r = torch.exp(off.logps - off.old_logps)[sn.node >= 0]
    assert ((r > 1.01) | (r < 0.99)).any()
    assert _rho(clipped, off) > 1e-3


def test_equal_lengths_on_policy_seq_norm_cancels():
    b = random_batch(seed=2, off_policy=0.0, equal_lengths=True)
    assert _rho(objectives.get("grpo", norm="seq"), b) <= 1e-12
    assert _rho(objectives.get("gspo"), b) <= 1e-12  # on-policy GSPO = GRPO seq-norm


def test_orth_keeps_subset_credit():
    """Σ_S w̃_i A_i = mean(A_S) Σ_S w_i at every trie node (docs/concepts/dfpo.md)."""
    b = random_batch(seed=5, n_groups=3, G=6, T=10, off_policy=0.5)
    base = objectives.get("gspo", eps=(1.0, 1.0))
    w = base.weight(b)
    node, n = node_map(b, "shared", "trie")
    wt = transform_weights(w, b.advantages, node, n, "orth")
    sh = node >= 0
    idx = node[sh]
    A = b.advantages.unsqueeze(-1).expand_as(w)[sh]
    lhs = torch.zeros(n, dtype=w.dtype).index_add_(0, idx, wt[sh] * A)
    cnt = torch.bincount(idx, minlength=n).double()
    meanA = torch.zeros(n, dtype=w.dtype).index_add_(0, idx, A) / cnt
    rhs = meanA * torch.zeros(n, dtype=w.dtype).index_add_(0, idx, w[sh])
    assert (cnt < cnt.max()).any()  # subset nodes are present
    assert torch.allclose(lhs, rhs, atol=1e-14)


def test_two_trajectory_toy():
    """Paper's toy: two responses share token t*; GSPO's residual is (Aρ/2)(u₂ − u₁)."""
    T, A = 4, 0.7
    tokens = torch.tensor([[5, 1, 2, 3], [5, 2, 2, 2]])  # share position 0 only
    mask = torch.ones(2, T, dtype=torch.bool)
    old = torch.zeros(2, T, dtype=torch.float64)
    delta = torch.tensor([[0.2, 0.1, -0.3, 0.05], [0.2, -0.2, 0.4, 0.1]], dtype=torch.float64)
    b = gradlab.TokenBatch(tokens, mask, old + delta, old, torch.tensor([-A, A], dtype=torch.float64),
                           torch.tensor([0, 0]))
    rho = math.exp(0.2 / T)  # the shared token's factor of s_i = ρ u_i
    u = torch.exp(delta[:, 1:].sum(-1) / T)
    rep = cancellation(objectives.get("gspo", eps=(10, 10)).modulation(b), b)
    assert rep.n_nodes == 1
    c = float(rep.coef.c[0]) * T  # undo GSPO's 1/T length normalisation
    assert c == pytest.approx(A * rho / 2 * float(u[1] - u[0]), rel=1e-12)
    assert cancellation(objectives.get("grpo", eps=(10, 10), norm="const").modulation(b), b).ratio == 0


def test_attribution_names_the_mechanism():
    on = random_batch(seed=1, off_policy=0.0)
    att = gradlab.attribution(objectives.get("grpo", norm="seq"), on)
    assert att["length"] == pytest.approx(1.0) and att["coupling"] == 0 and att["clip"] == 0
    off = random_batch(seed=1, off_policy=0.6, equal_lengths=True)
    att = gradlab.attribution(objectives.get("gspo", eps=(10, 10)), off)
    assert att["coupling"] == pytest.approx(1.0) and att["clip"] == 0
    att = gradlab.attribution(objectives.get("grpo", norm="const", eps=(0.01, 0.01)), off)
    assert att["clip"] == pytest.approx(1.0) and att["residual"] > 0


@pytest.mark.parametrize("name,params", [c for c in COMBOS if c[1].get("stop_grad", True)][:24])
def test_shards_with_global_totals_add_up_to_the_whole_batch(name, params):
    """Data parallelism: group-whole shards with global normalisers sum to the full loss and W."""
    b = _with_ref(random_batch(n_groups=4, G=3, T=9, seed=6, off_policy=0.4))
    obj = objectives.get(name, **params)
    full_loss, full_W = obj.loss(b), obj.modulation(b)
    total_loss, W = 0.0, torch.zeros_like(full_W)
    for part in ((b.group % 2) == 0, (b.group % 2) == 1):
        rows = part.nonzero().squeeze(-1)
        shard = b.rows(part).replace(n_seqs=b.B, n_tokens=int(b.mask.sum()), width=b.T)
        total_loss = total_loss + obj.loss(shard)
        W[rows] = obj.modulation(shard)
    assert torch.allclose(total_loss, full_loss, atol=1e-12)
    assert torch.allclose(W, full_W, atol=1e-14)
