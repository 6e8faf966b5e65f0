"""--micro-batch: gradient accumulation over whole groups equals the one-pass step.

Real tiny Qwen3 (the shipped default policy, fp32), a real rollout of 4 prompts × G = 4 with
off-policy old log-probs (so ratios ≠ 1 and clips fire), every registered objective and the
normaliser variants: parameter gradients against an independent one-pass backward, the
hook-measured W, entropy and loss; the whole optimizer step's readings (residuals, tax, drift,
stats) and updated weights; a 2-step tandem's metrics; bad micro-batch sizes.
"""

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch
from tolerance import assert_close_f32, f32_atol

import gradlab
from gradlab.core import objectives
from gradlab.core.batch import advantages
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.rollouts.rollout import generate
from gradlab.loop.scale.dist import Dist
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask
from gradlab.loop.train import Learner, train
from gradlab.loop.update.batches import micro_batches
from gradlab.loop.update.metrics import StepMetrics
from gradlab.loop.update.step import StepWork, _accumulate, optimizer_step
from gradlab.loop.update.view import loop_instruments

G = 4
VARIANTS = [(n, {}) for n in objectives.names()] + [
    ("grpo", {"norm": "seq"}), ("grpo", {"norm": "const"}), ("dfpo", {"stop_grad": False}),
    ("dfpo", {"nodes": "trie"}), ("dfpo", {"scope": "all", "transform": "orth"}),
    ("dfpo", {"base": "grpo"}), ("ibpo", {"form": "togo", "base": "gspo"}),
    ("ibpo", {"form": "la", "reweight": "sqrt"})]
IDS = [n + "".join(f"-{k}={v}" for k, v in p.items()) for n, p in VARIANTS]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, tok = load_policy()
    task = ArithmeticTask()
    ro = generate(model, tok, task.problems(4, seed=3), G=G, max_new_tokens=12, task=task,
                  row_keys=torch.arange(4 * G))
    ro.group = torch.arange(4).repeat_interleave(G)
    # off-policy: old log-probs moved by a fixed noise, so clips and ratios ≠ 1 are exercised
    g = torch.Generator().manual_seed(1)
    ro.old_logps = (ro.old_logps + 0.3 * torch.randn(ro.old_logps.shape, generator=g)) * ro.response_mask
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0])
    ro.rewards = rewards  # IBPO builds its token advantages from them
    adv = advantages(rewards, ro.group)
    rows = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7])  # not sorted
    return model.train(), ro, adv, rows


def _one_pass(model, obj, ro, adv, rows):
    """Independent reference: one forward/backward over all rows, the batch's own normalisers."""
    model.zero_grad(set_to_none=True)
    s = ro.rows(rows)
    lp, ent = token_logps(model, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask,
                          return_entropy=True)
    lp.retain_grad()
    b = ro.token_batch(lp, adv, rows)
    loss = obj.loss(b)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, -lp.grad, ent.detach(), loss.detach()


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_micro_batched_gradient_and_w_equal_one_pass(setup, name, params):
    model, ro, adv, rows = setup
    obj = objectives.get(name, **params)
    ref_g, ref_W, ref_ent, ref_loss = _one_pass(model, obj, ro, adv, rows)
    assert ref_W.abs().max() > 0
    tot = (rows.numel(), int(ro.response_mask[rows].sum()), ro.response_ids.shape[1])
    for mb in (4, 8):
        model.zero_grad(set_to_none=True)
        cfg = RunConfig(G=G, micro_batch=mb, progress=False)
        L = Learner(name, obj, model, None, None)
        batch, W, ent, loss = _accumulate(L, cfg, ro, adv, rows=rows, norms=tot)
        for n, p in model.named_parameters():
            assert_close_f32(p.grad, ref_g[n], msg=f"micro-batch {mb}: {n}")
        assert_close_f32(W, ref_W, msg=f"micro-batch {mb}: W")
        assert_close_f32(ent, ref_ent, msg=f"micro-batch {mb}: entropy")
        assert_close_f32(loss, ref_loss, msg=f"micro-batch {mb}: loss")
        assert torch.equal(batch.tokens, ro.response_ids[rows])
    model.zero_grad(set_to_none=True)


def _step(model, name, params, ro, adv, rows, mb, others=()):
    obj = objectives.get(name, **params)
    m = copy.deepcopy(model)
    # SGD: the update is linear in the gradient (Adam's first step is ~lr·sign(g), which
    # float noise in near-zero gradient entries would flip)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    L = Learner(name, obj, m, opt, torch.Generator())
    cfg = RunConfig(G=G, micro_batch=mb, progress=False, tax_every=1)
    acc = StepMetrics()
    optimizer_step(L, cfg, StepWork(ro, adv, rows, 0), acc, loop_instruments(cfg, list(others)),
                   Dist())
    rec = acc.finish()
    return {k: v for k, v in rec.items()}, dict(m.named_parameters())


@pytest.mark.parametrize("name,params", VARIANTS[:8], ids=IDS[:8])
def test_whole_step_readings_equal(setup, name, params):
    """Residuals, W deviation, stats, loss, grad norm, tax (overall and per layer group),
    drift (node KL, Δlog π, divergent Δlog π) and the updated weights: micro-batch 4 = one pass."""
    model, ro, adv, rows = setup
    others = [("gspo", objectives.get("gspo")), ("grpo", objectives.get("grpo"))]
    one, p1 = _step(model, name, params, ro, adv, rows, None, others)
    mic, p2 = _step(model, name, params, ro, adv, rows, 4, others)
    assert one.keys() == mic.keys()
    for k in ("rho_prefix", "residual_trie", "tax_share", "tax_norm", "drift_node_kl_mean",
              "drift_div_pos_dlogp_mean", "cf/gspo/rho_trie", "loss", "grad_norm"):
        assert k in one, k
    assert one["drift_node_count"] > 0 and one["total_norm"] > 0
    assert one["tax_norm"] > 0 or name.startswith("dfpo")  # DFPO: no residual at full-group nodes
    for k in one:
        assert one[k] == pytest.approx(mic[k], rel=1e-4, abs=1e-7, nan_ok=True), k
    for n, p in model.named_parameters():
        upd = float((p1[n] - p).detach().abs().max())
        # the two updates differ by the gradients' round-off (≤ 1e-4 of the update) plus the
        # rounding of p + update (ulps of the parameters' own magnitude)
        tol = f32_atol(p1[n], ulps=64) + 1e-4 * upd
        assert upd > 0 and float((p2[n] - p1[n]).detach().abs().max()) <= tol, n


def test_micro_batches_hold_whole_groups():
    group = torch.tensor([5, 5, 2, 2, 9, 9, 2, 2, 5, 5, 9, 9])
    parts = micro_batches(group, 4, 4)  # G = 4: one group per part, ordered by label
    assert [group[p].unique().tolist() for p in parts] == [[2], [5], [9]]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(12))
    assert all(bool((p[1:] > p[:-1]).all()) for p in parts)  # the step's row order is kept
    assert [p.numel() for p in micro_batches(group, 8, 4)] == [8, 4]
    assert len(micro_batches(group, None, 4)) == len(micro_batches(group, 12, 4)) == 1


def test_two_step_run_equal_with_and_without_micro_batch(tmp_path):
    kw = dict(objectives=["gspo", "dfpo-min", "grpo-fix"], steps=2, prompts=4, G=G,
              minibatches=2, tax_every=1, probe_contexts=4, progress=False, trace_every=1)
    runs = []
    for mb in (None, 4):
        out = tmp_path / f"mb{mb}"
        train(RunConfig(out=str(out), micro_batch=mb, **kw))
        runs.append(gradlab.load_run(out, wide=True))
    a, b = runs
    assert len(a) == len(b) == 6
    cols = [c for c in a.columns if a[c].dtype.kind == "f" and not c.startswith("time")]
    assert {"rho_prefix", "tax_share", "drift_node_kl_mean", "probe_kl", "grad_norm"} <= set(cols)
    # On-policy first optimizer steps have a residual of float noise (GSPO: every s_i = 1), so
    # the ratios to it (attribution shares, tax_cos) are noise there; they are held on
    # off-policy steps in test_whole_step_readings_equal. Drift KLs are O(1e-4) differences of
    # float32 log-probs: absolute tolerance.
    for c in cols:
        if c.startswith("attr_") or c == "tax_cos":
            continue
        atol = 1e-6 if c.startswith("drift_") else 1e-7
        np.testing.assert_allclose(b[c], a[c], rtol=1e-4, atol=atol, err_msg=c)
    ta = gradlab.load_traces(tmp_path / "mbNone")
    tb = gradlab.load_traces(tmp_path / "mb4")
    assert len(ta) == len(tb) > 0
    # W after optimizer steps on micro-batched gradients: round-off grows over the steps
    assert_close_f32(tb["W"].to_numpy(), ta["W"].to_numpy(), ulps=1024, msg="W traces")


def test_bad_micro_batch_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"--micro-batch: 6 is not a positive multiple of --G 4"):
        RunConfig(G=4, micro_batch=6)
    with pytest.raises(ConfigError, match="--split-groups"):
        RunConfig(G=4, micro_batch=8, split_groups=True)
    with pytest.raises(ConfigError, match="--micro-batch: 0"):
        RunConfig(G=4, micro_batch=0)
    r = subprocess.run([sys.executable, "-m", "gradlab", "tandem", "--G", "8", "--micro-batch",
                        "12", "--out", "unused"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "12" in lines[0] and "--G 8" in lines[0], r.stderr


def test_no_extra_model_copies(tmp_path):
    """train() keeps no weights beside the learners' own (the last learner takes the loaded
    model), and a checkpoint holds tied weights once without cloning any parameter."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gradlab.loop.runs.store import RunStore, _dedupe
    from gradlab.loop.train import make_learners

    model, _ = load_policy()
    cfg = RunConfig(objectives=["gspo", "grpo"], progress=False)
    ls = make_learners(cfg, model, cfg.objectives)
    assert ls[-1].model is model and ls[0].model is not model
    cfgq = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       tie_word_embeddings=True)
    tied = Qwen3ForCausalLM(cfgq)
    sd = tied.state_dict()
    out = _dedupe(sd)
    assert len(out) == len(sd) - 1  # lm_head.weight is embed_tokens.weight
    assert all(out[k].data_ptr() == sd[k].data_ptr() for k in out)  # no copies
    store = RunStore(tmp_path / "run", {})
    store.save_checkpoint("x", tied, torch.optim.SGD(tied.parameters(), lr=0.1), {"step": 1}, {})
    back = load_file(tmp_path / "run" / "checkpoints" / "x" / "model.safetensors")
    for k, v in out.items():
        assert torch.equal(back[k], v.detach()), k
