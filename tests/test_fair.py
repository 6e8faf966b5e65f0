"""The gradient identity of DFPO at full-group nodes (docs/concepts/dfpo.md#one-gradient-for-every-transform-at-full-group-nodes), on a real off-policy step.

The members of a full-group (prefix) node share one history and one token, hence one ∇l, so
the node adds (Σ_i A_i w̃_i)·∇l to the update, and every DFPO transform makes that sum 0. So
Min-Replace and Orth-Proj (under either clip reading) give the same parameter gradient, namely
the base objective's gradient minus its shared-prefix residual; at trie nodes they differ.
Also: DFPO's `clip` option ("base" | "free").
"""

import copy

import pytest
import torch

from gradlab import objectives
from gradlab.core.batch import TokenBatch, advantages
from gradlab.core.nodes import shared_nodes
from gradlab.loop.numerics.logprobs import positions
from gradlab.loop.rollouts.rollout import generate
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask
from gradlab.testing import measure_modulation, optimizer_step_on, random_batch

# HF's eager attention and RMSNorm compute in float32 even in a float64 model, so each row's
# gradient carries ~1e-7 relative round-off: the identity is checked to 1e-6 of ‖g‖, on a batch
# whose prefix residual is ≥ 100× that (seed 1, one GSPO step at lr 3e-3 before it).
REL = 1e-6


@pytest.fixture(scope="module")
def off_policy():
    """(model one GSPO step past the sampler, rollout, advantages, rows of the 2nd minibatch)."""
    task = ArithmeticTask()
    model, tok = load_policy(task=task)
    ro = generate(model, tok, task.problems(8, seed=1), 8, task.max_new_tokens, 1.0,
                  generator=torch.Generator().manual_seed(1), task=task)
    adv = advantages(ro.rewards, ro.group)
    first, second = (ro.group < 4).nonzero()[:, 0], (ro.group >= 4).nonzero()[:, 0]
    stepped = copy.deepcopy(model)
    optimizer_step_on(stepped, ro, first, adv, objectives.get("gspo").loss, lr=3e-3)
    return stepped.double(), ro, adv, second


def _logps64(model, ro, rows) -> torch.Tensor:
    """(R, T) float64 response log-probs (token_logps computes in float32; this test wants the
    identity to round-off, so the same forward in float64)."""
    s = ro.rows(rows)
    ids = torch.cat([s.prompt_ids, s.response_ids], 1)
    mask = torch.cat([s.prompt_mask, s.response_mask], 1)
    T = s.response_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
                   use_cache=False).logits[:, -T - 1:-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, s.response_ids[:, :, None]).squeeze(-1)
    return lp.masked_fill(~s.response_mask, 0.0)


def _grad(model, ro, rows, adv, loss_fn) -> tuple[torch.Tensor, TokenBatch]:
    """Flat parameter gradient of loss_fn on `rows`, and the (detached) TokenBatch."""
    lp = _logps64(model, ro, rows)
    b = ro.token_batch(lp, adv.double(), rows, old_logps=ro.old_logps[rows].double())
    model.zero_grad(set_to_none=True)
    loss_fn(b).backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return g, b.replace(logps=lp.detach())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _prefix_residual_loss(base: objectives.Objective):
    """−Σ over full-group node tokens of sg(W_base)·l: its gradient is the base's prefix residual
    Σ_n d_n ∇l_n (every member of a node has the same ∇l), built without any DFPO code."""
    def loss(b: TokenBatch) -> torch.Tensor:
        W = base.modulation(b.replace(logps=b.logps.detach()))
        at = shared_nodes(b, "prefix").node >= 0
        return -(W * b.logps * at).sum()
    return loss


@pytest.mark.parametrize("clip,base", [("base", "gspo"), ("free", "gspo[eps=1e9]")])
def test_every_dfpo_transform_gives_the_base_minus_its_prefix_residual(off_policy, clip, base):
    model, ro, adv, rows = off_policy
    g_base, b = _grad(model, ro, rows, adv, objectives.get(base).loss)
    g_res, _ = _grad(model, ro, rows, adv, _prefix_residual_loss(objectives.get(base)))
    assert float(g_res.norm() / g_base.norm()) > 100 * REL  # a residual far above round-off
    g = {t: _grad(model, ro, rows, adv, objectives.get(f"dfpo-{t}[clip={clip}]").loss)[0]
         for t in ("min", "orth")}
    for t, gt in g.items():  # DFPO = the base minus its prefix residual
        assert _rel(gt, g_base - g_res) < REL, t
    assert _rel(g["min"], g["orth"]) < REL
    # ... while the W strips differ at the full-group nodes (Min-Replace ≠ Orth-Proj there)
    at = shared_nodes(b, "prefix").node >= 0
    W = {t: objectives.get(f"dfpo-{t}[clip={clip}]").modulation(b) for t in g}
    assert at.any() and float((W["min"] - W["orth"])[at].abs().max()) > 1e-3 * float(W["orth"].abs().max())


def test_transforms_differ_at_trie_nodes(off_policy):
    model, ro, adv, rows = off_policy
    g_min, b = _grad(model, ro, rows, adv, objectives.get("dfpo-min[nodes=trie]").loss)
    g_orth, _ = _grad(model, ro, rows, adv, objectives.get("dfpo-orth[nodes=trie]").loss)
    sn = shared_nodes(b, "trie")
    full = shared_nodes(b, "prefix").node >= 0
    assert bool(((sn.node >= 0) & ~full).any())  # subset nodes exist: Σ A over them is not 0
    assert _rel(g_min, g_orth) > 1e-3


def test_clip_free_has_no_clip_indicator_anywhere(off_policy):
    model, ro, adv, rows = off_policy
    _, b = _grad(model, ro, rows, adv, objectives.get("gspo").loss)
    gspo = objectives.get("gspo")
    assert float(gspo.stats(b)["clip_frac"]) > 0  # the sequence clip fires on this batch
    untouched = (shared_nodes(b, "prefix").node < 0) & b.mask
    A = b.advantages.unsqueeze(-1).float()
    free, base = objectives.get("dfpo-orth[clip=free]"), objectives.get("dfpo-orth")
    W_free, W_base = free.modulation(b), base.modulation(b)
    assert torch.allclose(W_free[untouched], (A * gspo.weight(b, off=("clip",)))[untouched])
    assert torch.allclose(W_base[untouched], gspo.modulation(b)[untouched])
    assert not torch.allclose(W_free, W_base)
    assert float(free.stats(b)["clip_frac"]) == 0.0
    with pytest.raises(ValueError, match=r"unknown clip='none'; valid: \('base', 'free'\)"):
        objectives.get("dfpo[clip=none]")


@pytest.mark.parametrize("transform", ["min", "orth", "scale"])
@pytest.mark.parametrize("stop_grad", [True, False])
@pytest.mark.parametrize("nodes", ["prefix", "trie"])
def test_clip_free_modulation_equals_autograd(transform, stop_grad, nodes):
    b = random_batch(n_groups=3, G=4, T=10, seed=2, off_policy=0.4)
    obj = objectives.get("dfpo", transform=transform, stop_grad=stop_grad, nodes=nodes,
                         clip="free", eps=(0.05, 0.05))
    W_auto = measure_modulation(obj.loss, b)
    assert torch.allclose(obj.modulation(b), W_auto, rtol=0, atol=1e-10 * float(W_auto.abs().max()))
