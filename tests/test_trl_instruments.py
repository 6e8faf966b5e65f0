"""gradlab's instruments inside TRL (`GradlabConfig.instruments`, gradlab/integrations/trl/host.py).

Real (tiny, CPU, offline) GRPOTrainer runs. The `tax` instrument's ‖g_tax‖/‖g‖ on an optimizer
step is held to gradlab's own computation on the same batch and weights: the loop's log-probs
(`token_logps`), gradlab's closed-form GSPO loss and W, and `learning_tax` over the full graph.
The `full` preset logs every name the loop's instruments log; a TRL loss without a closed form
is refused by the instruments that need one and measured by the others.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl import Capturing  # keeps (model state, inputs) of every training loss call
from tolerance import assert_close_f32

import gradlab
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
TAX = ("tax_share", "tax_cos", "tax_norm", "total_norm")


def run(tmp_path, loss_type="grpo", level="sequence", spg=1, steps=1, instruments="cheap,tax",
        cls=GradlabGRPOTrainer, workload="lengths", reward=None, **extra):
    with quiet():
        args = grpo_args(loss_type, level, spg, steps, str(tmp_path / "out"), **extra)
        gl = GradlabConfig(store=str(tmp_path / "store"), keep_windows=True,
                           instruments=instruments)
        tr = trl_audit.make_trainer(args, WORKLOADS[workload], gl, cls=cls)
        if reward is not None:  # a reward of the test's own (e.g. constant: every group tied)
            tr.reward_funcs = [reward]
        tr.train()
    if tr.gradlab_store is not None:
        tr.gradlab_store.close()  # release the run folder's lock
    return tr


def own_loop_tax(tr, state: dict, calls: list[dict], scale: float = 1.0) -> dict:
    """gradlab's own tax on TRL's loss calls of one optimizer step, at the same weights: loop
    log-probs, closed-form GSPO loss and W (× `scale`, the gradient-accumulation factor), one
    backward per call; then `learning_tax` once over the step's rows (the calls' rows side by
    side, a group being its rows in the step; prefix nodes), against the summed gradient."""
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
        parts.append((lp, scale * gspo.modulation(batch), batch, inputs[GROUP_KEY]))
    T = max(p[0].shape[1] for p in parts)

    def cat(ts):  # rows side by side, right-padded to the longest completion
        return torch.cat([torch.nn.functional.pad(t, (0, T - t.shape[1])) for t in ts])

    lp, W = cat([p[0] for p in parts]), cat([p[1] for p in parts])
    b = TokenBatch(tokens=cat([p[2].tokens for p in parts]), mask=cat([p[2].mask for p in parts]),
                   logps=lp.detach(), old_logps=lp.detach(),
                   advantages=torch.cat([p[2].advantages for p in parts]),
                   group=torch.unique(torch.cat([p[3] for p in parts]), return_inverse=True)[1])
    out = learning_tax(lp, W, b, params, nodes="prefix", groups=layer_groups(model))
    rep = tax_report(out["g_tax"], params, None, layer_groups(model))
    c = cancellation(W, b)
    rep["n_nodes"], rep["rho"] = out["n_nodes"], c.residual / c.mass  # Σ|d| / Σ|W| at nodes
    return rep


def check_step(got: dict, ref: dict) -> None:
    """One optimizer step's tax figures (a window of one optimizer step: `got` = its metrics)
    against gradlab's own (`ref`)."""
    assert ref["n_nodes"] > 0
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
    assert len(tr.captured) == len(tr.gradlab_windows) == 2  # one optimizer step per window
    for (state, inputs), w in zip(tr.captured, tr.gradlab_windows):
        check_step(w.metrics, own_loop_tax(tr, state, [inputs]))
    # TRL's logs and the run store carry the loop's names
    assert any("gradlab/tax_share" in h for h in tr.state.log_history)
    df = gradlab.load_run(tmp_path / "store")
    got = df[df.metric == "tax_share"].sort_values("step").value.tolist()
    assert got == pytest.approx([w.metrics["tax_share"] for w in tr.gradlab_windows], rel=1e-12)


def test_gradient_accumulation_adds_the_calls_tax(tmp_path):
    # two loss calls (16 shuffled rows each) per optimizer step: the tax of the step's rows is
    # compared with the accumulated gradient (TRL's loss of each call is halved)
    tr = run(tmp_path, spg=2, steps=1, cls=Capturing, per_device_train_batch_size=2 * G,
             gradient_accumulation_steps=2, lr=3e-3)
    assert len(tr.captured) == 2 and len(tr.gradlab_windows) == 1
    state = tr.captured[0][0]
    check_step(tr.gradlab_window.metrics, own_loop_tax(tr, state, [c[1] for c in tr.captured], 0.5))


def test_tax_schedule_counts_windows(tmp_path):
    """`tax@2`: windows 0 and 2 are taxed, window 1 reports no tax figure (not a 0); the taxed
    windows' figures are gradlab's own at their weights."""
    tr = run(tmp_path, steps=3, cls=Capturing, instruments="cheap,tax@2", lr=3e-3)
    ws = tr.gradlab_windows
    assert [w.index for w in ws] == [0, 1, 2]
    assert [all(k in w.metrics for k in TAX) for w in ws] == [True, False, True]
    assert not any(k.startswith("tax_") for k in ws[1].metrics)
    for i in (0, 2):
        state, inputs = tr.captured[i]
        check_step(ws[i].metrics, own_loop_tax(tr, state, [inputs]))
    off = run(tmp_path / "off", steps=1, instruments="cheap")
    assert not any(k.startswith("tax_") for k in off.gradlab_window.metrics)


def test_update_phase_readings_land_in_their_own_window(tmp_path):
    """`drift@2` (read before and after TRL's optimizer step) over 3 windows of one optimizer
    step each: windows 0 and 2, the last one included, report the drift of their own step,
    at every full-group node of that step's rows; window 1 reports none."""
    from gradlab.core.nodes import shared_nodes

    tr = run(tmp_path, "dr_grpo", "token", steps=3, instruments="residual,drift@2",
             workload="arithmetic", lr=3e-3)
    ws = tr.gradlab_windows
    assert [w.index for w in ws] == [0, 1, 2]
    assert ["drift_node_count" in w.metrics for w in ws] == [True, False, True]
    for i in (0, 2):
        n = shared_nodes(ws[i].batch, "prefix").n
        assert ws[i].metrics["drift_node_count"] == n > 0
    df = gradlab.load_run(tmp_path / "store")
    drift = df[df.metric == "drift_node_count"]
    assert sorted(drift[drift.value.notna()].step) == [0, 2]  # window 1: not measured


def test_every_group_tied_gives_nan_share_never_0(tmp_path):
    def constant(prompts, completions, **kw):
        return [1.0] * len(completions)

    tr = run(tmp_path, steps=1, reward=constant)
    m = tr.gradlab_window.metrics
    assert m["n_shared_prefix"] > 0 and m["total_norm"] == 0.0 and m["tax_norm"] == 0.0
    assert math.isnan(m["tax_share"]) and math.isnan(m["tax_cos"])
    # an undefined share is left out of TRL's logs (never a 0 or NaN in the mean); its norms are
    # logged, so the log itself was written (TRL clears _metrics after logging: read its history)
    assert not any("gradlab/tax_share" in h for h in tr.state.log_history)
    assert any("gradlab/tax_norm" in h for h in tr.state.log_history)


def loop_instrument_metrics(tmp_path) -> set[str]:
    """The metric names gradlab's loop logs from its instruments with the `full` preset: a
    tiny `gradlab run gspo --instruments full` less the same run's names with instruments off
    (the loop's own rollout, token and timing figures) and less the loop's own records that
    follow W (its fixed probe contexts: `gradlab.instruments.own.OWN_RECORDS`)."""
    from gradlab.instruments.own import OWN_RECORDS

    names = {}
    for spec in ("full", "off"):
        out = tmp_path / f"loop_{spec}"
        r = subprocess.run([sys.executable, "-m", "gradlab.cli.main", "run", "gspo",
                            "--instruments", spec, "--steps", "1", "--prompts", "4", "--G", "4",
                            "--max-new-tokens", "8", "--eval-every", "0", "--no-progress",
                            "--out", str(out)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        names[spec] = set(gradlab.load_run(out).metric)
    return names["full"] - names["off"] - set(OWN_RECORDS)


def test_full_preset_logs_every_name_the_loops_instruments_log(tmp_path):
    tr = run(tmp_path, "grpo", "sequence", spg=2, steps=4, instruments="full",
             workload="arithmetic", lr=3e-3)
    assert [w.index for w in tr.gradlab_windows] == [0, 1]
    trl_names = set(gradlab.load_run(tmp_path / "store").metric)
    loop = loop_instrument_metrics(tmp_path)
    assert {"rho_prefix", "tax_share", "drift_node_dlogp_mean", "w_dev", "attr_length"} <= loop
    assert any(k.startswith("flips/") for k in loop)
    assert loop <= trl_names, sorted(loop - trl_names)
    assert {"split_share", "zero_std_share"} <= trl_names


def test_a_loss_without_closed_form_is_refused_by_what_needs_one(tmp_path):
    with pytest.raises(ValueError) as e:
        run(tmp_path, "cispo", "token", instruments="cheap")
    msg = str(e.value)
    assert "\n" not in msg and "'modulation'" in msg and "loss_type='cispo'" in msg
    tr = run(tmp_path / "res", "cispo", "token", steps=2, instruments="residual")
    m = tr.gradlab_window.metrics
    assert m["n_shared_prefix"] > 0 and m["mass_prefix"] > 0 and "w_dev" not in m
    assert 0 <= m["rho_prefix"] <= 1
