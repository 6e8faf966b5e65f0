"""verl integration: gradlab_measure / gradlab_dfpo on verl's *real* policy losses, the audit.

verl 0.9 pins transformers<5.11, this environment runs 5.24 (TRL), so verl is not installed here:
.ci/run puts it (without dependencies) into .verl-site/, and `test_verl_cases_in_verl_env` runs
this file again in a child python with that folder on PYTHONPATH, where the cases below run.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close_f32
from verl_child import run_in_verl_env

try:
    from verl.trainer.ppo import core_algos

    HAVE_VERL = True
except ImportError:
    HAVE_VERL = False

needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl not importable here; these cases run "
                                "in the child of test_verl_cases_in_verl_env")


def test_verl_cases_in_verl_env():
    """Runs this file's verl cases in a python that sees .verl-site (CI installs it)."""
    run_in_verl_env(__file__, HAVE_VERL)


# ----------------------------------------------------------------------------- helpers


def _setup():
    from gradlab.integrations.audit.verl_setup import actor_config
    from gradlab.integrations.verl import losses as gv

    return gv, actor_config


def _call(name, batch, rows=None, agg="token-mean", last=True, cfg=None, adv=None):
    """One verl loss call through the registry on a leaf copy of the log-probs; returns
    (loss, metrics, log_prob leaf) after the backward."""
    gv, actor_config = _setup()
    rows = torch.arange(batch.B) if rows is None else rows
    cfg = cfg if cfg is not None else actor_config(name)
    mb = batch.rows(rows)
    lp = mb.logps.detach().clone().requires_grad_(True)
    A = mb.advantages.unsqueeze(-1).expand_as(lp) if adv is None else adv
    with gv.micro_batch(mb.tokens, mb.group, last=last):
        loss, m = core_algos.get_policy_loss_fn(name)(
            old_log_prob=mb.old_logps, log_prob=lp, advantages=A,
            response_mask=mb.mask, loss_agg_mode=agg, config=cfg, rollout_is_weights=None)
    loss.backward()
    return loss, m, lp


def _base_grad(base, batch, agg, cfg, hook=None):
    """verl's own loss (not gradlab's) on a leaf copy: (loss, grad at log_prob, hook)."""
    lp = batch.logps.detach().clone().requires_grad_(True)
    x = hook.watch(lp) if hook is not None else lp
    A = batch.advantages.unsqueeze(-1).expand_as(lp)
    loss, _ = core_algos.get_policy_loss_fn(base)(batch.old_logps, x, A, batch.mask, agg, cfg, None)
    loss.backward()
    return loss, lp.grad, hook


# ----------------------------------------------------------------------------- cases


@needs_verl
def test_import_registers_every_base_loss():
    gv, _ = _setup()
    bases = gv.base_losses()
    assert {"vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean"} <= set(bases)
    reg = core_algos.POLICY_LOSS_REGISTRY
    for b in bases:
        assert f"gradlab_measure:{b}" in reg and f"gradlab_dfpo:{b}" in reg
        assert {f"gradlab_dfpo:{b}:{t}" for t in ("min", "orth", "scale")} <= set(reg)
    assert reg["gradlab_dfpo"] is reg["gradlab_dfpo:vanilla:orth"]
    with pytest.raises(ValueError, match="not a verl policy loss"):
        gv.register("no_such_loss")


@needs_verl
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm"])
def test_measure_leaves_verl_loss_unchanged_and_W_is_its_gradient(agg):
    """Same value and gradient as verl's loss; W = what a hook on log_prob receives."""
    from gradlab.probes import ModulationProbe
    from gradlab.testing import random_batch

    gv, actor_config = _setup()
    b = random_batch(n_groups=3, G=4, T=12, seed=1, off_policy=0.5)
    for base in gv.base_losses():
        torch.manual_seed(0)  # clip_cov / kl_cov pick tokens at random
        loss, m, lp = _call(f"gradlab_measure:{base}", b, agg=agg)
        torch.manual_seed(0)
        ref_loss, ref_grad, probe = _base_grad(base, b, agg, actor_config(base), ModulationProbe())
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-12, abs=1e-15), base
        torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-12, atol=1e-15)
        W, W_base = gv.last_modulation()
        assert W_base is None
        torch.testing.assert_close(W, probe.W.double(), rtol=1e-12, atol=1e-15)
        assert {"gradlab/rho_prefix", "gradlab/rho_trie", "gradlab/residual_prefix",
                "gradlab/split_groups_micro", "gradlab/micro_batches"} <= set(m), base
        if base == "vanilla":  # verl's own metrics pass through
            assert "actor/pg_clipfrac" in m


MAPPED = (("vanilla", "token-mean"), ("vanilla", "seq-mean-token-mean"),
          ("vanilla", "seq-mean-token-sum-norm"), ("gspo", "seq-mean-token-mean"))


@needs_verl
@pytest.mark.parametrize("norm", ["engine", "local"])
def test_w_dev_is_the_exactness_of_W_against_gradlab_closed_form(norm):
    """vanilla ↔ gradlab grpo (token / seq / const norm), gspo ↔ gradlab gspo, and DFPO on each:
    the `modulation` instrument's absolute w_dev = max |W − closed form| over the mini-batch
    (three micro-batches, whole groups) is round-off, against w_max = max |W| of order 1e-2;
    under DFPO, W is W̃ (what the backward uses). No closed form: no w_dev."""
    from gradlab.integrations.audit.verl import run_mini_batch
    from gradlab.integrations.audit.verl_setup import micro_rows
    from gradlab.testing import random_batch

    gv, _ = _setup()
    b = random_batch(n_groups=6, G=4, T=12, seed=2, off_policy=0.1)
    parts = micro_rows(b.group, split=False, seed=0)
    assert len(parts) == 3
    for base, agg in MAPPED:
        for name in (f"gradlab_measure:{base}", f"gradlab_dfpo:{base}:min"):
            m = run_mini_batch(b, name, agg, parts, norm)
            assert m["gradlab/w_max"] > 1e-3, (name, agg)
            assert m["gradlab/w_dev"] < 1e-12, (name, agg)
    gv.reset()
    _, m, _ = _call("gradlab_measure:vanilla", b, agg="seq-mean-token-sum")
    assert "gradlab/w_dev" not in m and "gradlab/rho_prefix" in m  # no closed form for it


@needs_verl
@pytest.mark.parametrize("base", ["vanilla", "gspo", "cispo", "geo_mean"])
def test_dfpo_on_verl_loss_cancels_and_equals_the_trl_dropin_hook(base):
    """Whole groups: ρ(W̃) ≈ 0 at full-group nodes; the gradient at log_prob equals that of
    gradlab's DFPOGradientTransform hook on verl's own loss (the TRL drop-in's mechanism)."""
    from gradlab.core.cancellation import cancellation
    from gradlab.probes import DFPOGradientTransform
    from gradlab.testing import random_batch

    _, actor_config = _setup()
    b = random_batch(n_groups=3, G=4, T=12, seed=3, off_policy=0.4)
    agg = "seq-mean-token-mean"  # the base does not cancel here
    loss, m, lp = _call(f"gradlab_dfpo:{base}", b, agg=agg)
    assert m["gradlab/rho_prefix"] < 1e-9  # ρ of W̃, the W the backward uses
    assert cancellation(_setup()[0].last_modulation()[1], b, "prefix").ratio > 0.05  # verl's W
    ref_loss, ref_grad, t = _base_grad(base, b, agg, actor_config(base),
                                       DFPOGradientTransform(b, "orth"))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-12)  # verl's value
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(_setup()[0].last_modulation()[0], t.W_tilde.double())


@needs_verl
def test_split_group_with_micro_batch_local_normaliser_breaks_cancellation():
    """verl issue #5625: token-mean, on-policy, groups cut across micro-batches. verl's engine
    normalisers (mini-batch totals) cancel; micro-batch-local ones do not. The mini-batch ρ
    reported equals ρ of the W's of the calls, concatenated (an independent computation)."""
    from gradlab.core.cancellation import cancellation
    from gradlab.integrations.audit.verl import run_mini_batch
    from gradlab.integrations.audit.verl_setup import micro_rows
    from gradlab.testing import random_batch

    gv, _ = _setup()
    b = random_batch(n_groups=4, G=4, T=12, seed=4, off_policy=0.0)
    parts = micro_rows(b.group, split=True, seed=0)
    out = {}
    for norm in ("engine", "local"):
        Ws = []
        orig = gv._gather

        def spy(batch, W, form, last, orig=orig, Ws=Ws):
            Ws.append(W.clone())
            return orig(batch, W, form, last)

        gv._gather = spy
        try:
            m = run_mini_batch(b, "gradlab_measure:vanilla", "token-mean", parts, norm)
        finally:
            gv._gather = orig
        order = torch.cat(parts)
        W = torch.zeros(b.tokens.shape, dtype=torch.float64)
        W[order] = torch.cat(Ws)
        assert m["gradlab/rho_prefix"] == pytest.approx(cancellation(W, b, "prefix").ratio,
                                                        abs=1e-12)
        assert m["gradlab/split_groups_micro"] == 1.0 and m["gradlab/micro_batches"] == 3.0
        out[norm] = m["gradlab/rho_prefix"]
    assert out["engine"] < 1e-9
    assert out["local"] > 0.05


@needs_verl
def test_on_the_tiny_model_W_and_dfpo_through_a_real_backward():
    """Real Qwen3 tiny policy: W of gradlab_measure:gspo = the hook on the model's log-probs in
    the real backward; gradlab_dfpo:vanilla's parameter gradient = that of −Σ sg(W̃)·l."""
    from gradlab.core.batch import advantages
    from gradlab.core.cancellation import cancellation
    from gradlab.loop.numerics.logprobs import token_logps
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask
    from gradlab.probes import ModulationProbe

    gv, actor_config = _setup()
    model, tok = load_policy()
    task = ArithmeticTask()
    ro = generate(model, tok, task.problems(2, seed=5), G=4, max_new_tokens=10,
                  generator=torch.Generator().manual_seed(5), task=task)
    adv = advantages(ro.rewards + 0.01 * (torch.arange(8) % 2), ro.group)
    A = adv.unsqueeze(-1).expand(ro.response_ids.shape)

    def logps():
        return token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)

    def verl_call(name, lp):
        with gv.micro_batch(ro.response_ids, ro.group, last=True):
            return core_algos.get_policy_loss_fn(name)(ro.old_logps, lp, A, ro.response_mask,
                                                       loss_agg_mode="seq-mean-token-mean",
                                                       config=actor_config(name))

    model.train()
    with ModulationProbe() as probe:
        lp = probe.watch(logps())
        loss, m = verl_call("gradlab_measure:gspo", lp)
        loss.backward()
    assert_close_f32(gv.last_modulation()[0], probe.W.double(), msg="verl's W vs the hook")
    model.zero_grad()
    loss, m = verl_call("gradlab_dfpo:vanilla", logps())
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    W_t = gv.last_modulation()[0]
    z = torch.zeros_like(ro.old_logps)
    batch = ro.token_batch(z, adv, old_logps=z)
    assert cancellation(W_t, batch, sn=None).ratio < 1e-6 and m["gradlab/rho_prefix"] < 1e-6
    model.zero_grad()
    (-(W_t.float() * logps()).sum()).backward()
    for g, p in zip(got, model.parameters()):
        assert_close_f32(g, p.grad)


@needs_verl
def test_clear_errors():
    from gradlab.testing import random_batch

    gv, actor_config = _setup()
    b = random_batch(n_groups=2, G=4, T=8, seed=6)
    lp = b.logps.clone().requires_grad_(True)
    A = b.advantages.unsqueeze(-1).expand_as(lp)
    fn = core_algos.get_policy_loss_fn("gradlab_measure:vanilla")
    with pytest.raises(ValueError, match="gradlab_measure:vanilla: no token/group ids.*micro_batch"):
        fn(b.old_logps, lp, A, b.mask, loss_agg_mode="token-mean",
           config=actor_config("vanilla"), rollout_is_weights=None)
    with pytest.raises(ValueError, match="responses are \\(8, 7\\), log_prob is \\(8, 8\\)"):
        with gv.micro_batch(b.tokens[:, :7], b.group):
            fn(b.old_logps, lp, A, b.mask, loss_agg_mode="token-mean",
               config=actor_config("vanilla"), rollout_is_weights=None)
    with pytest.raises(ValueError, match="uid has 3 entries, responses has 8 rows"):
        with gv.micro_batch(b.tokens, ["a", "b", "c"]):
            pass
    gv.reset()
    rows = torch.tensor([0, 1, 2, 3, 4])  # cuts a group
    with pytest.raises(ValueError, match="group uid=.* of its rollout_n=4 rows in this loss call"):
        _call("gradlab_dfpo", b, rows=rows)
    gv.reset()
    Atok = A + 0.1 * torch.arange(8.0, dtype=A.dtype)  # token-level advantages (e.g. GAE)
    with pytest.raises(ValueError, match="advantages vary along a response"):
        _call("gradlab_dfpo", b, adv=Atok)
    gv.reset()


@needs_verl
def test_audit_quick_writes_the_table(tmp_path):
    import pandas as pd

    from gradlab.cli.main import main

    assert main(["audit", "verl", "--quick", "--seeds", "2", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "verl_audit.csv")
    assert len(df) == 4 * 4  # (vanilla, gspo, 2 DFPO rows) × 4 loss_agg_modes
    tm = df[(df.loss_mode == "vanilla") & (df.loss_agg_mode == "token-mean")].iloc[0]
    assert tm.rho_on_split < 1e-9 and tm.rho_on_split_local > 0.05
    d = df[df.loss_mode.str.startswith("gradlab_dfpo")]
    assert (d.rho_on_whole < 1e-9).all() and (d.rho_off_whole < 1e-9).all()
    md = (tmp_path / "verl_audit.md").read_text()
    assert "refused (split group)" in md and "gradlab audit verl --quick" in md


def _micro_batch_td(model, ro, rows, adv, uid: bool, gbs: int):
    """A real verl micro-batch TensorDict (dense layout, as verl's padded path) and the model
    output verl's ppo_loss expects: packed log-probs, the response's sitting one token left."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from gradlab.loop.numerics.logprobs import token_logps

    P = ro.prompt_ids.shape[1]
    s = ro.rows(rows)
    lp = token_logps(model, s.prompt_ids, s.prompt_mask, s.response_ids,
                     s.response_mask)  # (R, T), with grad
    att = torch.cat([s.prompt_mask, s.response_mask], 1).long()
    packed = []
    for i in range(len(rows)):
        p, r = int(att[i, :P].sum()), int(att[i, P:].sum())
        z = torch.zeros(p + r, dtype=lp.dtype)
        packed.append(torch.cat([z[: p - 1], lp[i, :r], z[-1:]]))
    mask = s.response_mask
    td = TensorDict({"prompts": s.prompt_ids, "responses": s.response_ids,
                     "attention_mask": att, "response_mask": mask.long(),
                     "old_log_probs": s.old_logps,
                     "advantages": adv[rows].unsqueeze(-1).expand(mask.shape).clone()},
                    batch_size=[len(rows)])
    if uid:
        tu.assign_non_tensor_stack(td, "uid", [f"p{int(g)}" for g in s.group])
    for k, v in (("dp_size", 1), ("batch_num_tokens", None), ("global_batch_size", gbs)):
        tu.assign_non_tensor_data(td, k, v)
    return td, {"log_probs": torch.cat(packed)}, lp


@needs_verl
@pytest.mark.parametrize("uid", [True, False])
def test_gradlab_ppo_loss_on_verl_real_ppo_loss(uid):
    """verl's own ppo_loss, fed real TensorDict micro-batches of the tiny model: install() routes
    it through gradlab_ppo_loss, which rebuilds groups (uid, or equal prompts) and closes the
    mini-batch after global_batch_size rows; the loss is verl's, unchanged."""
    from verl.workers.utils import losses

    from gradlab.core.batch import advantages
    from gradlab.integrations.verl import actor as verl_actor
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask

    gv, actor_config = _setup()
    assert losses.ppo_loss is verl_actor.gradlab_ppo_loss  # installed by the import
    model, tok = load_policy()
    task = ArithmeticTask()
    ro = generate(model, tok, task.problems(2, seed=7), G=4, max_new_tokens=10,
                  generator=torch.Generator().manual_seed(7), task=task)
    adv = advantages(ro.rewards + 0.01 * (torch.arange(8) % 2), ro.group)
    cfg = actor_config("gradlab_measure:vanilla")
    gv.reset()
    parts = [torch.tensor([0, 1, 2, 4, 5]), torch.tensor([3, 6, 7])]  # both groups split
    for k, rows in enumerate(parts):
        td, out, _ = _micro_batch_td(model, ro, rows, adv, uid, gbs=8)
        ids = verl_actor._group_ids(td, len(rows))
        assert ids[0] == ("p0" if uid else tuple(ro.prompt_ids[0][ro.prompt_mask[0]].tolist()))
        assert len(set(ids)) == 2
        loss, m = losses.ppo_loss(cfg, out, td)
        ref, _ = verl_actor._ORIGINAL["ppo_loss"](actor_config("vanilla"), out, td)
        assert float(loss) == pytest.approx(float(ref), rel=1e-6)
        vals = {key: v.values[-1] if hasattr(v, "values") else v for key, v in m.items()}
        assert ("gradlab/rho_prefix" in vals) == (k == 1)  # once, when the mini-batch closes
    assert float(vals["gradlab/split_groups_micro"]) == 1.0
    assert float(vals["gradlab/micro_batches"]) == 2.0


@needs_verl
def test_undefined_rho_is_nan_and_left_out_of_verls_means():
    """A mini-batch whose groups are all tied (A = 0, so W ≡ 0): ρ is undefined. The
    instruments give NaN (never 0), and the metrics handed to verl leave it out, so verl's mean
    runs over the mini-batches that define it; the defined figures stay."""
    import math

    from gradlab.testing import random_batch

    gv, _ = _setup()
    b = random_batch(n_groups=2, G=4, T=10, seed=4)
    tied = b.replace(advantages=torch.zeros_like(b.advantages))
    seen, orig = [], gv._report
    gv._report = lambda d: (seen.append(d), orig(d))[1]
    try:
        _, m, _ = _call("gradlab_measure:vanilla", tied)
    finally:
        gv._report = orig
    assert math.isnan(seen[0]["rho_prefix"]) and math.isnan(seen[0]["rho_trie"])
    for k in ("rho_prefix", "rho_trie"):
        assert f"gradlab/{k}" not in m, k
    assert m["gradlab/w_max"] == 0.0 and m["gradlab/shared_frac_prefix"] > 0
    assert m["gradlab/micro_batches"] == 1.0
    _, m, _ = _call("gradlab_measure:vanilla", b)  # the same batch, rewards not tied
    assert math.isfinite(m["gradlab/rho_prefix"]) and math.isfinite(m["gradlab/rho_trie"])


@needs_verl
def test_rho_is_the_loops_residual_instrument_on_the_mini_batch_view():
    """Groups split over three micro-batches: the reported ρ, residual, mass and shared
    fraction equal the loop's `residual` instrument run directly on one HostView of the whole
    mini-batch (its W the concatenated W of the calls), and ρ equals gradlab.core.cancellation
    on that batch and W."""
    from gradlab.core.cancellation import cancellation
    from gradlab.instruments import Residual, reduce_readings
    from gradlab.instruments.host import HostView
    from gradlab.testing import random_batch

    gv, actor_config = _setup()
    b = random_batch(n_groups=4, G=4, T=12, seed=8, off_policy=0.3)
    parts = [torch.tensor([0, 5, 9, 14, 2]), torch.tensor([1, 4, 8, 12, 13, 15]),
             torch.tensor([3, 6, 7, 10, 11])]
    cfg = actor_config("gradlab_measure:gspo")
    Ws = []
    gv.reset()
    for k, rows in enumerate(parts):
        _, m, _ = _call("gradlab_measure:gspo", b, rows=rows, agg="seq-mean-token-mean",
                        last=k == len(parts) - 1, cfg=cfg)
        Ws.append(gv.last_modulation()[0])
    order = torch.cat(parts)
    mini = b.replace(tokens=b.tokens[order], mask=b.mask[order], logps=b.logps[order],
                     old_logps=b.old_logps[order], advantages=b.advantages[order],
                     group=b.group[order])
    W = torch.cat(Ws)
    inst = Residual()
    ref = reduce_readings([inst.measure(HostView(batch=mini, W=W))], inst.quantities(),
                          {"n_tokens": float(mini.mask.sum())})
    for key in ("rho_prefix", "rho_trie", "residual_prefix", "mass_prefix", "scale_prefix",
                "shared_frac_prefix", "n_shared_trie"):
        assert m[f"gradlab/{key}"] == pytest.approx(ref[key], rel=1e-12, abs=1e-15), key
    assert m["gradlab/rho_prefix"] == pytest.approx(cancellation(W, mini, "prefix").ratio,
                                                    rel=1e-12)
    assert m["gradlab/rho_prefix"] > 0.01 and m["gradlab/split_groups_micro"] == 1.0


@needs_verl
def test_token_advantages_are_measured_as_the_loss_used_them():
    """Advantages that vary along a response (gradlab_ibpo's): the view's batch keeps them per
    token, so w_dev against gradlab grpo on those token advantages is round-off, and ρ equals
    gradlab.core.cancellation with the token advantages (not a row mean) at both node kinds."""
    from gradlab.core.cancellation import cancellation
    from gradlab.testing import random_batch

    gv, _ = _setup()
    b = random_batch(n_groups=3, G=4, T=12, seed=10, off_policy=0.2)
    noise = torch.randn(b.tokens.shape, generator=torch.Generator().manual_seed(0),
                        dtype=b.advantages.dtype)
    Atok = (b.advantages.unsqueeze(-1) + 0.3 * noise) * b.mask
    gv.reset()
    _, m, _ = _call("gradlab_measure:vanilla", b, adv=Atok)
    W = gv.last_modulation()[0]
    assert m["gradlab/w_max"] > 1e-3 and m["gradlab/w_dev"] < 1e-12
    for kind in ("prefix", "trie"):
        ref = cancellation(W, b.replace(advantages=Atok), kind).ratio
        assert m[f"gradlab/rho_{kind}"] == pytest.approx(ref, rel=1e-12), kind
    # at partial (trie) nodes c* reads the advantages: a row mean would give another ρ
    assert abs(ref - cancellation(W, b, "trie").ratio) > 1e-3


@needs_verl
def test_default_instruments_and_the_refusals():
    """verl runs the `cheap` preset unless told; an update-phase instrument is refused at
    `use_instruments` in one line saying why verl cannot give its needs (`MISSING`)."""
    from gradlab.instruments import Instrument
    from gradlab.instruments.host import MISSING

    class AroundStep(Instrument):
        name, phase = "around_step", "update"

    gv, _ = _setup()
    assert gv.INSTRUMENTS.names == ["modulation", "residual"]
    try:
        for name in ("tax", "drift", "drift_divergent", "flips", "fisher"):
            with pytest.raises(ValueError, match=f"instrument '{name}' needs .*model.*which verl's "
                               "actor does not give: .*" + MISSING[("verl", "model")]):
                gv.use_instruments(f"residual,{name}@5")
            assert gv.INSTRUMENTS.names == ["modulation", "residual"]  # unchanged
        with pytest.raises(ValueError, match=MISSING[("verl", "grads")]):
            gv.use_instruments("tax")
        with pytest.raises(ValueError, match="instrument 'around_step' runs around the optimizer "
                           "step .*verl's policy loss runs before the backward"):
            gv.use_instruments([AroundStep()])  # its needs verl gives, its phase it cannot
        assert gv.use_instruments("off").names == []
    finally:
        gv.use_instruments(None)
    assert gv.INSTRUMENTS.names == ["modulation", "residual"]


@needs_verl
def test_attribution_on_a_mapped_loss_and_refused_on_an_unmapped_one():
    """vanilla token-mean maps onto gradlab grpo (token norm): attr_* equal the shares of
    gradlab.core.cancellation.attribution_sums on the same batch; cispo has no closed form:
    attribution is refused in one line naming verl's loss mode, before verl's loss runs."""
    from gradlab.core import objectives
    from gradlab.core.cancellation import attribution_sums
    from gradlab.testing import random_batch

    gv, _ = _setup()
    b = random_batch(n_groups=3, G=4, T=12, seed=9, off_policy=0.4)
    try:
        gv.use_instruments("cheap,attribution")
        gv.reset()
        _, m, _ = _call("gradlab_measure:gspo", b, agg="seq-mean-token-mean")
        att = attribution_sums(objectives.get("gspo", eps=(0.2, 0.2)), b)
        assert att["residual"] > 0
        for mech in ("coupling", "length", "clip"):
            assert m[f"gradlab/attr_{mech}"] == pytest.approx(att[mech] / att["residual"],
                                                              rel=1e-9, abs=1e-12), mech
        gv.reset()
        with pytest.raises(ValueError, match="instrument 'attribution' needs gradlab's closed "
                           "form of verl's loss mode 'gradlab_measure:cispo'"):
            _call("gradlab_measure:cispo", b)
    finally:
        gv.use_instruments(None)
        gv.reset()


@needs_verl
def test_own_instrument_on_every_mini_batch():
    """`use_instruments` (GRADLAB_INSTRUMENTS in the workers) runs a user's instrument on each
    mini-batch's W and batch: `gradlab/<metric>` equals its computation by hand on the W
    verl's loss hands back."""
    from pathlib import Path

    from gradlab.core.nodes import shared_nodes
    from gradlab.testing import random_batch

    gv, _ = _setup()
    own = f"{Path(__file__).parents[1] / 'examples' / 'own_instrument.py'}:SharedMass"
    try:
        gv.use_instruments(own)
        b = random_batch(n_groups=3, G=4, T=10, seed=2)
        _, m, _ = _call("gradlab_measure:vanilla", b)
        W = gv.last_modulation()[0].abs() * b.mask
        ref = float((W * (shared_nodes(b, "prefix").node >= 0)).sum() / W.sum())
        assert 0 < ref < 1 and m["gradlab/shared_mass_share"] == pytest.approx(ref, rel=1e-9)
        assert "gradlab/rho_prefix" not in m  # only the instruments chosen
    finally:
        gv.use_instruments(None)
