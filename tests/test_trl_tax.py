"""The learning tax inside TRL (`GradlabConfig.tax_every`, gradlab/integrations/trl/tax.py).

Real (tiny, CPU, offline) GRPOTrainer runs; the probe's ‖g_tax‖/‖g‖ is held to gradlab's own
computation on the same batch and weights: the loop's log-probs (`token_logps`), gradlab's
closed-form GSPO loss and W, and `learning_tax` over the full graph.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl import Capturing  # keeps (model state, inputs) of every training loss call
from tolerance import assert_close_f32

from gradlab import objectives
from gradlab.core.batch import TokenBatch
from gradlab.core.cancellation import cancellation
from gradlab.integrations.audit import trl as trl_audit
from gradlab.integrations.audit.trl import WORKLOADS, grpo_args, quiet
from gradlab.integrations.trl.trainer import GROUP_KEY, GradlabConfig, GradlabGRPOTrainer
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.setup.policy import load_policy
from gradlab.probes.tax import layer_groups, learning_tax, tax_report

G = 8



def run(tmp_path, loss_type="grpo", level="sequence", spg=1, steps=1, tax_every=1,
        cls=GradlabGRPOTrainer, workload="lengths", reward=None, **extra):
    with quiet():
        args = grpo_args(loss_type, level, spg, steps, str(tmp_path / "out"), **extra)
        gl = GradlabConfig(store=str(tmp_path / "store"), keep_windows=True, tax_every=tax_every)
        tr = trl_audit.make_trainer(args, WORKLOADS[workload], gl, cls=cls)
        if reward is not None:  # a reward of the test's own (e.g. constant: every group tied)
            tr.reward_funcs = [reward]
        tr.train()
    return tr


def own_loop_tax(tr, state: dict, calls: list[dict], scale: float = 1.0) -> dict:
    """gradlab's own tax on TRL's loss calls of one optimizer step, at the same weights: loop
    log-probs, closed-form GSPO loss and W (× `scale`, the gradient-accumulation factor), one
    backward per call, `learning_tax` over each call's retained full graph (prefix nodes); the
    calls' g_tax add up and are compared with the summed gradient."""
    model = load_policy()[0]  # a fresh copy: TRL's prepared model carries accelerate's wrappers
    model.load_state_dict(state)
    model.train()  # as TRL's loss forward
    params, parts = dict(model.named_parameters()), []
    gspo = objectives.get("gspo", eps=(tr.args.epsilon, tr.args.epsilon_high))
    for inputs in calls:
        lp = token_logps(model, inputs["prompt_ids"], inputs["prompt_mask"],
                         inputs["completion_ids"], inputs["completion_mask"].bool(), tr.temperature)
        group = torch.unique(inputs[GROUP_KEY], return_inverse=True)[1]
        batch = TokenBatch(tokens=inputs["completion_ids"], mask=inputs["completion_mask"].bool(),
                           logps=lp, old_logps=lp.detach(), advantages=inputs["advantages"],
                           group=group)
        (scale * gspo.loss(batch)).backward(retain_graph=True)
        parts.append((lp, scale * gspo.modulation(batch), batch))
    out = [learning_tax(lp, W, b, params, nodes="prefix", groups=layer_groups(model))
           for lp, W, b in parts]
    g_tax = {n: sum(o["g_tax"][n] for o in out) for n in params}
    rep = tax_report(g_tax, params, None, layer_groups(model))
    rep["n_nodes"] = sum(o["n_nodes"] for o in out)
    rep["rho"] = min(cancellation(W, b).residual / cancellation(W, b).mass for _, W, b in parts)  # Σ|d| / Σ|W| at nodes
    return rep


def check_step(got: dict, ref: dict) -> None:
    assert ref["n_nodes"] == got["n_nodes"] > 0
    assert float(ref["tax_norm"]) > 0 and float(ref["total_norm"]) > 0
    # g_tax is a sum of residuals d_n = c_n − c*_n, differences of node sums of W: their
    # round-off is that of the node mass Σ|W| = Σ|d| / ρ, so ‖g_tax‖'s scale is ‖g_tax‖ / ρ
    loose = 1.0 / ref["rho"]
    for k, scale in (("total_norm", None), ("tax_norm", float(ref["tax_norm"]) * loose),
                     ("tax_share", float(ref["tax_share"]) * loose), ("tax_cos", loose)):
        assert_close_f32(torch.tensor(got[k]), ref[k].detach(), scale=scale, msg=k)
    for grp, v in ref["groups"].items():
        if not math.isnan(float(v["tax_share"])):
            assert_close_f32(torch.tensor(got[f"tax_share/{grp}"]), v["tax_share"],
                             scale=float(v["tax_share"]) * loose, msg=grp)


def test_trl_tax_equals_the_own_loops_on_the_same_batch_and_weights(tmp_path):
    tr = run(tmp_path, steps=2, cls=Capturing, lr=3e-3)
    assert [r["global_step"] for r in tr._gl_tax.steps] == [0, 1]
    for (state, inputs), got in zip(tr.captured, tr._gl_tax.steps):
        check_step(got, own_loop_tax(tr, state, [inputs]))
    # the window reports its taxed step's figures, and TRL's logs carry them
    w = tr.gradlab_windows[-1]
    assert w.metrics["tax_steps"] == 1.0
    assert w.metrics["tax_share"] == tr._gl_tax.steps[-1]["tax_share"]
    assert w.metrics["time_tax"] > 0


def test_gradient_accumulation_adds_the_calls_tax(tmp_path):
    # two loss calls (16 shuffled rows each) per optimizer step: their g_tax parts add up and
    # are compared with the accumulated gradient (TRL's loss of each call is halved)
    tr = run(tmp_path, spg=2, steps=1, cls=Capturing, per_device_train_batch_size=2 * G,
             gradient_accumulation_steps=2, lr=3e-3)
    assert len(tr.captured) == 2 and len(tr._gl_tax.steps) == 1
    state = tr.captured[0][0]
    check_step(tr._gl_tax.steps[0], own_loop_tax(tr, state, [c[1] for c in tr.captured], 0.5))


def test_schedule_and_refusals(tmp_path):
    tr = run(tmp_path, steps=3, tax_every=2)
    assert [r["global_step"] for r in tr._gl_tax.steps] == [0, 2]
    assert "tax_share" not in tr.gradlab_windows[1].metrics  # not taxed: not reported, not 0
    off = run(tmp_path / "off", steps=1, tax_every=0)
    assert off._gl_tax.steps == [] and "tax_share" not in off.gradlab_window.metrics
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="tax_every"):
            GradlabConfig(tax_every=bad)


def test_every_group_tied_gives_nan_share_never_0(tmp_path):
    def constant(prompts, completions, **kw):
        return [1.0] * len(completions)

    tr = run(tmp_path, steps=1, reward=constant)
    row = tr._gl_tax.steps[0]
    assert row["n_nodes"] > 0 and row["total_norm"] == 0.0 and row["tax_norm"] == 0.0
    assert math.isnan(row["tax_share"]) and math.isnan(row["tax_cos"])
    assert math.isnan(tr.gradlab_window.metrics["tax_share"])
    # an undefined share is left out of TRL's logs (never a 0 or NaN in the mean); its norms are
    # logged, so the log itself was written (TRL clears _metrics after logging: read its history)
    assert not any("gradlab/tax_share" in h for h in tr.state.log_history)
    assert any("gradlab/tax_norm" in h for h in tr.state.log_history)
