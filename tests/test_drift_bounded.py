"""The drift probe's memory does not grow with the batch: π_before is kept as (N,) shared-token
log-probs plus full distributions at K ≤ KL_BUDGET // V nodes (`kl_nodes`), and the node
passes run the LM head on the nodes' hidden states only (`context_logprobs`). Held against
brute force: full (B, T, V) forwards before and after the step."""

import copy

import pytest
import torch
from tolerance import assert_close_f32

from gradlab.core.batch import TokenBatch
from gradlab.core.nodes import shared_nodes
from gradlab.instruments.forwards import node_logprobs
from gradlab.loop.config import RunConfig
from gradlab.loop.numerics.logprobs import context_logprobs, token_logps
from gradlab.loop.rollouts.rollout import generate
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask
from gradlab.loop.update.metrics import StepMetrics
from gradlab.loop.update.view import loop_policy
from gradlab.probes.drift import KL_BUDGET, kl_nodes, kl_rows


def test_kl_nodes_all_or_an_evenly_spaced_sample():
    assert torch.equal(kl_nodes(7, 10, cap=7), torch.arange(7))
    assert torch.equal(kl_nodes(7, 10, cap=100), torch.arange(7))
    assert kl_nodes(10, 10, cap=4).tolist() == [0, 2, 5, 7]  # floor(k · 10 / 4)
    assert kl_nodes(1000, 151_936).numel() == KL_BUDGET // 151_936 == 110
    assert torch.equal(kl_nodes(50, 151_936), torch.arange(50))


def run_drift(after_model, cfg, ro, rows, b, held, sn, heavy: bool) -> dict:
    """The loop's drift instruments (node drift; + divergent on heavy steps) on a step whose
    weights moved to `after_model`, π_before at the nodes `held`: the finished metrics."""
    from gradlab.instruments import DivergentDrift, Drift
    from gradlab.loop.scale.dist import Dist
    from gradlab.loop.update.view import step_view

    view = step_view(after_model, cfg, ro, rows, Dist(), batch=b, trained_batch=b)
    view._nodes, view._before = {"prefix": sn}, held
    acc = StepMetrics()
    for inst in [Drift()] + ([DivergentDrift()] if heavy else []):
        acc.declare(inst.quantities())
        acc.record(inst.after(view))
    return acc.finish()


@pytest.fixture(scope="module")
def step():
    model, tok = load_policy()
    ro = generate(model, tok, ArithmeticTask().problems(4, seed=1), G=4, max_new_tokens=12,
                  row_keys=torch.arange(16))
    rows = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11])
    s = ro.rows(rows)
    args = (s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask)
    with torch.no_grad():
        lp, before = token_logps(model, *args, temperature=0.8, return_logprobs=True)
    b = TokenBatch(s.response_ids, s.response_mask, lp, torch.zeros_like(lp),
                   torch.randn(16, generator=torch.Generator().manual_seed(0)), s.group)
    sn = shared_nodes(b, "prefix")
    after_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in after_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        _, after = token_logps(after_model, *args, temperature=0.8, return_logprobs=True)
    return model, after_model, ro, rows, b, sn, before, after, args


def test_context_logprobs_equal_the_full_log_softmax(step):
    model, _, _, _, _, sn, before, _, args = step
    ref = before[sn.rep, sn.position]  # (N, V) from the model's own (B, T, V) logits
    for chunk in (1, 3, None):
        with torch.no_grad():
            parts = list(context_logprobs(model, *args, row=sn.rep, pos=sn.position,
                                         temperature=0.8, chunk=chunk))
        assert [s for s, _ in parts] == list(range(0, sn.n, chunk or sn.n))
        got = torch.cat([p for _, p in parts])  # float32 matmuls of other shapes: rounding only
        assert_close_f32(got, ref, msg=f"chunk {chunk}")


@pytest.mark.parametrize("cap", [None, 3, 1])
def test_capped_drift_equals_brute_force_at_its_nodes(step, cap):
    """Δ log π at every node; KL at the kept nodes (all with the default cap at this V), as
    the mean of kl_rows on the full distributions before and after at exactly those nodes."""
    model, after_model, ro, rows, b, sn, before, after, _ = step
    assert sn.n > 3
    full_b, full_a = before[sn.rep, sn.position], after[sn.rep, sn.position]  # (N, V)
    kept = kl_nodes(sn.n, full_b.shape[-1], cap)
    assert kept.numel() == (sn.n if cap is None else cap)
    tok = sn.token[:, None]
    ref_d = (full_a.gather(-1, tok) - full_b.gather(-1, tok)).mean()
    ref_kl = kl_rows(full_b[kept], full_a[kept]).mean()
    for mb in (None, 4):
        cfg = RunConfig(progress=False, G=4, micro_batch=mb, temperature=0.8)
        held = node_logprobs(loop_policy(model, cfg, ro, rows), sn, cap=cap)
        assert torch.equal(held.kept, kept) and held.dist.shape == (kept.numel(), full_b.shape[-1])
        out = run_drift(after_model, cfg, ro, rows, b, held, sn, heavy=False)
        assert out["drift_node_count"] == sn.n and out["drift_node_kl_count"] == kept.numel()
        assert out["drift_node_kl_mean"] == pytest.approx(float(ref_kl), rel=1e-5, abs=1e-9)
        assert out["drift_node_dlogp_mean"] == pytest.approx(float(ref_d), rel=1e-5, abs=1e-9)
        assert out["drift_node_kl_mean"] > 0
