"""Probes on a real tiny Qwen3: measured W, learning tax, DFPO as a hook, drift, hook hygiene."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_close_f32
from torch.distributions import Categorical
from transformers import Qwen3Config, Qwen3ForCausalLM

from gradlab import objectives
from gradlab.core.batch import TokenBatch, advantages
from gradlab.core.cancellation import cancellation, node_coefficients
from gradlab.core.nodes import shared_nodes
from gradlab.probes import (
    DFPOGradientTransform,
    ModulationProbe,
    Schedule,
    entropy,
    equal_solution_logodds,
    kl_rows,
    layer_groups,
    learning_tax,
    node_drift,
)
from gradlab.testing import measure_modulation

V, P, T, N_GROUPS, G, PREFIX = 16, 3, 8, 3, 4, 3
B = N_GROUPS * G


def _rmsnorm_forward(self, h):
    """Qwen3RMSNorm in the input's precision: HF's upcast to float32 would round float64."""
    x = h.to(torch.promote_types(h.dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(h.dtype)


def _model(dtype, seed=0):
    """Tiny Qwen3. For exactness in float64: sdpa attention (eager's softmax runs in float32)
    and the RMSNorms patched to keep float64."""
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=32, tie_word_embeddings=False, initializer_range=0.3,
                      attention_dropout=0.0, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    for m in model.modules():
        if type(m).__name__ == "Qwen3RMSNorm":
            m.forward = types.MethodType(_rmsnorm_forward, m)
    return model


def _data(seed=0):
    """[prompt | response] ids: equal-length prompts (no left padding), right-padded responses
    sharing a PREFIX per group, then branching over a 2-token alphabet (a trie); rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(N_GROUPS).repeat_interleave(G)
    prompts = torch.randint(2, V, (N_GROUPS, P), generator=g)[group]
    tokens = torch.randint(2, 4, (B, T), generator=g)
    tokens[:, :PREFIX] = torch.randint(2, V, (N_GROUPS, PREFIX), generator=g)[group]
    lengths = torch.randint(PREFIX + 1, T + 1, (B,), generator=g)
    lengths[::G], lengths[1::G] = T, PREFIX + 1  # unequal lengths in every group
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    rewards = (torch.rand(B, generator=g) < 0.5).double()
    rewards[::G], rewards[1::G] = 1.0, 0.0
    perm = torch.randperm(B, generator=g)
    return {"prompts": prompts[perm], "tokens": torch.where(mask, tokens, 0)[perm],
            "mask": mask[perm], "group": group[perm], "rewards": rewards[perm]}


def _logprobs(model, d):
    """(B, T, V) log-softmax over the response positions (position t predicts token t)."""
    ids = torch.cat([d["prompts"], d["tokens"]], 1)
    am = torch.cat([torch.ones_like(d["prompts"]), d["mask"].long()], 1)
    logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    return F.log_softmax(logits[:, P - 1:-1], -1)


def _token_logps(logprobs, d):
    return logprobs.gather(-1, d["tokens"].unsqueeze(-1)).squeeze(-1).masked_fill(~d["mask"], 0)


def _batch(d, lp, old):
    adv = advantages(d["rewards"].to(lp.dtype), d["group"])
    return TokenBatch(d["tokens"], d["mask"], lp, old, adv, d["group"],
                      rewards=d["rewards"].to(lp.dtype))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The model is tiny: one intra-op thread is faster, and immune to a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _make_setup(dtype):
    """(model, data, old_logps): old policy = the model with perturbed weights (off-policy)."""
    model, d = _model(dtype), _data()
    old = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in old.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
        old_lp = _token_logps(_logprobs(old, d), d)
    return model, d, old_lp


@pytest.fixture(scope="module")
def f64():
    return _make_setup(torch.float64)


@pytest.fixture(scope="module", params=["f64", "f32"])
def setup(request, f64):
    return f64 if request.param == "f64" else _make_setup(torch.float32)


def _step(setup, on_policy=False):
    """A fresh forward: (params, logps (B, T) with graph, batch on those logps)."""
    model, d, old = setup
    model.zero_grad(set_to_none=True)
    lp = _token_logps(_logprobs(model, d), d)
    return dict(model.named_parameters()), lp, _batch(d, lp, lp.detach() if on_policy else old)


OBJS = [(n, {}) for n in objectives.names()] + [("grpo", {"norm": "seq"}),
                                                ("grpo", {"norm": "const"}),
                                                ("gspo", {"eps": (0.2, 0.2)}),
                                                ("ibpo", {"form": "togo", "base": "gspo"}),
                                                ("ibpo", {"form": "la", "reweight": "sqrt"})]


def test_measured_W_equals_closed_form(setup):
    _, lp, batch = _step(setup)
    tol = 1e-10 if lp.dtype == torch.float64 else 1e-6
    assert objectives.get("grpo").stats(batch)["clip_frac"] > 0  # off-policy enough to clip
    for name, params in OBJS:
        obj = objectives.get(name, **params)
        with ModulationProbe() as probe:
            obj.loss(batch.replace(logps=probe.watch(lp))).backward(retain_graph=True)
        scale = probe.W.abs().max()
        assert probe.W.shape == (B, T) and not probe.W.requires_grad and scale > 0
        dev = probe.deviation(obj, batch)
        assert dev.dim() == 0 and dev <= tol * scale, (name, params, float(dev), float(scale))


def test_shared_positions_have_equal_logps(setup):
    _, lp, batch = _step(setup)
    sn = shared_nodes(batch, "trie")
    rows, cols = (sn.node >= 0).nonzero(as_tuple=True)
    ref = lp[sn.rep[sn.node[rows, cols]], cols]
    if lp.dtype == torch.float64:
        assert (lp[rows, cols] - ref).abs().max() < 1e-12
    else:  # one prefix in other rows of the batch: other kernel blocks, round-off only
        assert_close_f32(lp[rows, cols], ref, msg="shared positions' log-probs")
    assert sn.n > shared_nodes(batch, "prefix").n > 0  # trie nodes beyond the prefix


def _user_loss(norm):
    """A hand-written PPO-clip loss: per-sequence 1/|o_i| ("seq") or constant 1/(B T) norm."""
    def loss(lp, old, adv, mask, eps=0.2):
        r = torch.exp(lp - old)
        a = adv.unsqueeze(-1)
        per_tok = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a) * mask
        if norm == "seq":
            return (per_tok.sum(-1) / mask.sum(-1)).mean()
        return per_tok.sum() / (mask.shape[0] * mask.shape[1])
    return loss


@pytest.mark.parametrize("on_policy", [False, True])
def test_user_written_loss(setup, on_policy):
    rho = {}
    for norm in ("seq", "const"):
        loss_fn = _user_loss(norm)
        _, lp, batch = _step(setup, on_policy)
        with ModulationProbe() as probe:
            loss_fn(probe.watch(lp), batch.old_logps, batch.advantages, batch.mask).backward()
        ref = measure_modulation(
            lambda b, f=loss_fn: f(b.logps, b.old_logps, b.advantages, b.mask),
            batch.replace(logps=lp.detach()))
        tol = 1e-12 if lp.dtype == torch.float64 else 1e-7
        assert (probe.W - ref).abs().max() <= tol * ref.abs().max()
        rho[norm] = cancellation(probe.W, batch, "prefix").ratio
    assert rho["seq"] > 1e-2  # unequal lengths: 1/|o_i| breaks cancellation
    if on_policy and lp.dtype == torch.float64:
        assert rho["const"] < 1e-12
    elif on_policy:
        assert rho["const"] < 1e-5


@pytest.mark.parametrize("nodes", ["prefix", "trie"])
def test_learning_tax_equals_brute_force(f64, nodes):
    params, lp, batch = _step(f64)
    obj = objectives.get("gspo", eps=(0.2, 0.2))
    with ModulationProbe() as probe:
        obj.loss(batch.replace(logps=probe.watch(lp))).backward(retain_graph=True)
        tax = learning_tax(lp, probe.W, batch, params, nodes=nodes, retain_graph=True)
    assert probe.deviation(obj, batch) < 1e-12 * probe.W.abs().max()  # tax pass not recorded
    sn = shared_nodes(batch, nodes)
    d = node_coefficients(probe.W, batch, sn).d
    brute = {n: torch.zeros_like(p) for n, p in params.items()}
    for k in range(sn.n):  # one autograd call per node: −d_n ∇θ l_{rep(n), t_n}
        gs = torch.autograd.grad(lp[sn.rep[k], sn.position[k]], list(params.values()),
                                 retain_graph=True, allow_unused=True)
        for (n, _), g in zip(params.items(), gs):
            if g is not None:
                brute[n] -= d[k] * g
    scale = max(float(g.abs().max()) for g in brute.values())
    assert scale > 0 and tax["n_nodes"] == sn.n
    for n in params:
        assert torch.allclose(tax["g_tax"][n], brute[n], rtol=0, atol=1e-10 * scale), n
    flat = torch.cat([g.flatten() for g in brute.values()])
    total = torch.cat([p.grad.flatten() for p in params.values()])
    assert torch.isclose(tax["tax_norm"], flat.norm(), rtol=1e-10)
    assert torch.isclose(tax["tax_share"], flat.norm() / total.norm(), rtol=1e-10)
    assert torch.isclose(tax["tax_cos"], F.cosine_similarity(flat, total, dim=0), rtol=1e-8)
    assert set(tax["groups"]) == {"embed", "attn", "mlp", "head", "norm"}
    parts = sum(v["tax_norm"] ** 2 for v in tax["groups"].values())
    assert torch.isclose(parts, tax["tax_norm"] ** 2, rtol=1e-10)


def test_no_tax_when_exchangeable(setup):
    params, lp, batch = _step(setup, on_policy=True)
    obj = objectives.get("grpo", norm="const")
    obj.loss(batch).backward(retain_graph=True)
    tax = learning_tax(lp, obj.modulation(batch), batch, params)
    assert tax["total_norm"] > 0 and tax["tax_share"] < 1e-5


def test_layer_groups():
    groups = layer_groups(_model(torch.float64))
    assert groups["model.embed_tokens.weight"] == "embed" and groups["lm_head.weight"] == "head"
    assert groups["model.layers.0.self_attn.q_proj.weight"] == "attn"
    assert groups["model.layers.1.self_attn.k_norm.weight"] == "norm"
    assert groups["model.layers.0.mlp.down_proj.weight"] == "mlp"
    assert groups["model.norm.weight"] == "norm" and "other" not in groups.values()


CASES = [(tr, wm, nodes) for tr in ("min", "orth") for wm in ("given", "derived")
         for nodes in ("prefix", "trie")]


@pytest.mark.parametrize("transform,weight_mode,nodes", CASES)
def test_dfpo_transform_equals_objective(f64, transform, weight_mode, nodes):
    params, lp, batch = _step(f64)
    eps = (0.1, 0.1)
    dfpo = objectives.get("dfpo", transform=transform, base="gspo", nodes=nodes, eps=eps)
    ref = torch.autograd.grad(dfpo.loss(batch), list(params.values()), retain_graph=True)
    gspo = objectives.get("gspo", eps=eps)
    weight = gspo.weight(batch) if weight_mode == "given" else None
    with DFPOGradientTransform(batch, transform, nodes=nodes, weight=weight) as t, \
            ModulationProbe() as probe:  # the probe, watching after t, sees W̃
        lp2 = probe.watch(t.watch(lp))
        got = torch.autograd.grad(gspo.loss(batch.replace(logps=lp2)), list(params.values()))
    scale = max(float(g.abs().max()) for g in ref)
    for (n, _), a, b in zip(params.items(), ref, got):
        assert torch.allclose(a, b, rtol=0, atol=1e-10 * scale), n
    W_dfpo = dfpo.modulation(batch)
    assert (probe.W - W_dfpo).abs().max() < 1e-12 * W_dfpo.abs().max()
    assert (t.W - gspo.modulation(batch)).abs().max() < 1e-12 * W_dfpo.abs().max()
    assert not torch.allclose(t.W, t.W_tilde)  # the transform did something


def test_drift_against_two_forwards(f64):
    model, d, old = f64
    model = copy.deepcopy(model)
    with torch.no_grad():
        before = _logprobs(model, d)
    _, _, batch = _step((model, d, old))
    objectives.get("gspo", eps=(0.2, 0.2)).loss(batch).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 20.0 * p.grad  # one SGD step
        after = _logprobs(model, d)
    sn = shared_nodes(batch, "trie")
    out = node_drift(before, after, batch, sn)
    # independent: a Python loop with torch.distributions
    kl, dl = [], []
    for k in range(sn.n):
        i, t, a = int(sn.rep[k]), int(sn.position[k]), int(sn.token[k])
        kl.append(torch.distributions.kl_divergence(Categorical(logits=before[i, t]),
                                                    Categorical(logits=after[i, t])))
        dl.append(after[i, t, a] - before[i, t, a])
    kl, dl = torch.stack(kl), torch.stack(dl)
    assert kl.min() > 0 and int(out["node_count"]) == sn.n
    assert torch.isclose(out["node_kl_sum"], kl.sum(), rtol=1e-10)
    assert torch.isclose(out["node_kl_mean"], kl.mean(), rtol=1e-10)
    assert torch.isclose(out["node_dlogp_mean"], dl.mean(), rtol=1e-10)
    for sign, key in ((1, "div_pos"), (-1, "div_neg")):
        keep = [(i, t) for i in range(B) for t in range(T) if batch.mask[i, t]
                and sn.node[i, t] < 0 and torch.sign(batch.advantages[i]) == sign]
        kls = [torch.distributions.kl_divergence(Categorical(logits=before[i, t]),
                                                 Categorical(logits=after[i, t])) for i, t in keep]
        assert len(keep) > 0 and int(out[f"{key}_count"]) == len(keep)
        assert torch.isclose(out[f"{key}_kl_mean"], torch.stack(kls).mean(), rtol=1e-10)
    rows = before[sn.rep, sn.position]  # a fixed probe set of shared contexts, (K, V)
    assert torch.allclose(kl_rows(rows, after[sn.rep, sn.position]), kl, rtol=1e-10)
    assert torch.allclose(entropy(rows), Categorical(logits=rows).entropy(), rtol=1e-12)


def test_equal_solution_logodds():
    la = torch.tensor([-3.0, -1.0, -800.0, 0.0], dtype=torch.float64)
    lb = torch.tensor([-3.0, -2.0, -1.0, -900.0], dtype=torch.float64)
    x, h = equal_solution_logodds(la, lb)
    assert torch.equal(x, la - lb) and torch.isfinite(h).all()
    p = torch.sigmoid(x[:2])
    assert torch.allclose(h[:2], -(p * p.log() + (1 - p) * (1 - p).log()), rtol=1e-12)
    assert torch.isclose(h[0], torch.tensor(2.0, dtype=torch.float64).log())
    assert h[2] < 1e-300 and h[3] < 1e-300


def test_hooks_removed_on_exit_and_exception(setup):
    _, lp, batch = _step(setup)
    loss = objectives.get("grpo").loss(batch)
    with pytest.raises(RuntimeError, match="boom"), ModulationProbe() as probe, \
            DFPOGradientTransform(batch, "orth") as t:
        t.watch(probe.watch(lp))
        raise RuntimeError("boom")
    assert not lp._backward_hooks  # both hooks are gone
    g = torch.autograd.grad(loss, lp, retain_graph=True)[0]
    assert probe.W is None and t.W_tilde is None
    assert_close_f32(-g, objectives.get("grpo").modulation(batch), msg="autograd vs closed-form W")
    with ModulationProbe() as probe:
        probe.watch(lp)
    loss.backward(retain_graph=True)
    assert probe.W is None and not lp._backward_hooks
    with DFPOGradientTransform(batch, "orth") as t:  # transforms the first backward only
        t.watch(lp)
        g1 = torch.autograd.grad(loss, lp, retain_graph=True)[0]
        g2 = torch.autograd.grad(loss, lp)[0]
    assert torch.equal(-g1, t.W_tilde) and torch.equal(-g2, t.W) and not torch.equal(g1, g2)


def test_schedule_and_disabled_probe(setup):
    s = Schedule(every=3, start=2)
    assert [k for k in range(10) if s.active(k)] == [2, 5, 8]
    assert not any(Schedule(every=0).active(k) for k in range(10))  # every = 0: never
    assert [k for k in range(20) if Schedule(every=5, first=2).active(k)] == [0, 5]
    for bad in ({"every": -1}, {"start": -1}, {"first": -2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Schedule(**bad)
    assert Schedule.parse("off") == Schedule(every=0) and Schedule.parse("3") == Schedule(every=3)
    with pytest.raises(ValueError, match="'often'"):
        Schedule.parse("often")
    _, lp, batch = _step(setup)
    with ModulationProbe(enabled=s.active(0)) as probe:
        assert probe.watch(lp) is lp and not lp._backward_hooks
        objectives.get("gspo").loss(batch).backward()
    assert probe.W is None
    with pytest.raises(ValueError, match="require grad"):
        ModulationProbe().watch(lp.detach())


def test_cheap_shared_drift_equals_node_drift_from_full_forwards():
    """The loop's drift (rep rows, truncated forwards, node distributions only) equals
    node_drift on full (B, T, V) forwards before and after: node KL and Δlog π every step,
    divergent Δlog π by sign of A on heavy steps."""
    import copy

    from test_drift_bounded import run_drift

    from gradlab.core.nodes import shared_nodes
    from gradlab.instruments.forwards import node_logprobs
    from gradlab.loop.config import RunConfig
    from gradlab.loop.numerics.logprobs import token_logps
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask
    from gradlab.loop.update.view import loop_policy

    model, tok = load_policy()
    task = ArithmeticTask()
    ro = generate(model, tok, task.problems(3, seed=1), G=4, max_new_tokens=12,
                  row_keys=torch.arange(12))
    rows = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])
    args = (ro.prompt_ids[rows], ro.prompt_mask[rows], ro.response_ids[rows],
            ro.response_mask[rows])
    with torch.no_grad():
        lp_before, before = token_logps(model, *args, return_logprobs=True)
    z = torch.zeros(ro.response_ids[rows].shape)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 0.0])
    b = TokenBatch(ro.response_ids[rows], ro.response_mask[rows], lp_before, z, adv,
                   ro.group[rows])
    sn = shared_nodes(b, "prefix")
    assert sn.n > 0
    after_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in after_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        _, after = token_logps(after_model, *args, return_logprobs=True)
    ref = node_drift(before, after, b, sn)  # independent: full distributions everywhere
    out = {}
    for heavy, mb in ((False, None), (True, None), (True, 4)):
        cfg = RunConfig(progress=False, G=4, micro_batch=mb)
        nodes_before = node_logprobs(loop_policy(model, cfg, ro, rows), sn)
        assert torch.equal(nodes_before.kept, torch.arange(sn.n))  # tiny V: every node kept
        assert_close_f32(nodes_before.dist, before[sn.rep, sn.position], msg="node log-probs")
        tok_before = before[sn.rep, sn.position].gather(-1, sn.token[:, None]).squeeze(-1)
        assert_close_f32(nodes_before.token_logp, tok_before, msg="node token log-probs")
        out[heavy, mb] = run_drift(after_model, cfg, ro, rows, b, nodes_before, sn, heavy)
        for k in ("node_kl", "node_dlogp"):
            assert out[heavy, mb][f"drift_{k}_mean"] == pytest.approx(float(ref[f"{k}_mean"]),
                                                                     rel=1e-4, abs=1e-9), k
        assert out[heavy, mb]["drift_node_count"] == int(ref["node_count"])
    assert out[False, None]["drift_node_kl_mean"] > 0
    assert not any(k.startswith("drift_div") for k in out[False, None])
    for mb in (None, 4):
        for key in ("div_pos", "div_neg"):
            assert out[True, mb][f"drift_{key}_count"] == int(ref[f"{key}_count"]) > 0
            assert out[True, mb][f"drift_{key}_dlogp_mean"] == pytest.approx(
                float(ref[f"{key}_dlogp_mean"]), rel=1e-4, abs=1e-7), key


def test_loop_tax_from_representative_rows_equals_learning_tax():
    """The loop's cheap g_tax (rep rows, truncated forward) equals learning_tax on the full graph."""
    from gradlab.core.nodes import shared_nodes
    from gradlab.instruments.forwards import tax_step
    from gradlab.loop.config import RunConfig
    from gradlab.loop.numerics.logprobs import token_logps
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask
    from gradlab.loop.update.view import loop_policy

    model, tok = load_policy()
    model.train()
    ro = generate(model, tok, ArithmeticTask().problems(4, seed=2), G=4, max_new_tokens=12,
                  row_keys=torch.arange(16))
    rows = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, 15])
    lp = token_logps(model, ro.prompt_ids[rows], ro.prompt_mask[rows], ro.response_ids[rows],
                     ro.response_mask[rows])
    adv = advantages(torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0]), ro.group[rows])
    b = TokenBatch(ro.response_ids[rows], ro.response_mask[rows], lp, ro.old_logps[rows] - 0.01,
                   adv, ro.group[rows])
    obj = objectives.get("gspo", eps=(0.2, 0.2))
    W = obj.modulation(b)
    obj.loss(b).backward(retain_graph=True)
    sn = shared_nodes(b, "prefix")
    params = dict(model.named_parameters())
    full = learning_tax(lp, W, b, params, sn=sn)
    cheap = tax_step(loop_policy(model, RunConfig(progress=False), ro, rows), b, W, sn)
    assert float(full["tax_norm"]) > 0
    for k in ("tax_norm", "total_norm", "tax_share", "tax_cos"):
        assert float(cheap[k]) == pytest.approx(float(full[k]), rel=1e-4), k


# ----------------------------------------------------------------------------- undefined is NaN


def test_every_zero_denominator_ratio_is_nan_and_counts_stay_numbers():
    """`finalize` on sums whose denominators are all 0 (no row, group, token, node, residual,
    branch point, repair): every ratio NaN, never 0; the counts and sums it keeps stay 0."""
    import math

    from gradlab.loop.update.metrics import TOKSUM, finalize

    zero = {k: 0.0 for k in (
        "residual_prefix", "scale_prefix", "residual_trie", "scale_trie", "n_shared_prefix",
        "n_shared_trie", "n_tokens", "entropy_sum", "entropy_shared_sum", "drift_node_kl_sum",
        "drift_node_dlogp_sum", "drift_node_count", "drift_node_kl_count", "n_rows", "reward_sum",
        "correct", "length_sum", "form0", "form1", "n_groups", "split_groups", "zero_std_groups",
        "attr_residual", "attr_clip_sum", "adv_nonzero", "adv_abs_sum", "adv_abs_branch_sum",
        "distinct_responses", "duplicate_responses", "branch_points", "informative_points",
        "branch_depth_sum", "generated_tokens", "repairs_kept", "repairs_tried",
        "edited_tokens")}
    zero[f"{TOKSUM}clip_frac"] = 0.0
    r = finalize(zero)
    ratios = ("rho_prefix", "rho_trie", "entropy", "entropy_shared", "drift_node_kl_mean",
              "drift_node_dlogp_mean", "reward", "accuracy", "length", "form0_share",
              "form1_share", "split_share", "zero_std_share", "attr_clip", "adv_nonzero_frac",
              "adv_branch_share", "shared_frac_prefix", "shared_frac_trie", "clip_frac",
              "distinct_per_group", "duplicates_per_group", "branch_points_per_group",
              "informative_per_group", "informative_per_1k", "branch_depth", "repair_success",
              "edited_per_repair")
    assert [k for k in ratios if not math.isnan(r[k])] == []
    for k in ("n_tokens", "n_rows", "n_groups", "scale_prefix", "residual_prefix",
              "n_shared_prefix", "attr_residual", "repairs_tried"):
        assert r[k] == 0.0, k  # a count or sum of nothing is 0, a number
    # a measured 0 stays 0: residual 0 over a non-zero scale is "cancelled"
    assert finalize({"residual_prefix": 0.0, "scale_prefix": 2.0})["rho_prefix"] == 0.0


def test_tax_share_and_cos_undefined_without_gradient():
    from gradlab.probes.tax import _norms

    z, g = {"w": torch.zeros(3)}, {"w": torch.tensor([1.0, 2.0, 2.0])}
    none = _norms(z, z, ["w"])  # g_total = 0: share and cosine undefined
    assert torch.isnan(none["tax_share"]) and torch.isnan(none["tax_cos"])
    assert none["tax_norm"] == 0 and none["total_norm"] == 0
    free = _norms(z, g, ["w"])  # g_tax = 0, g ≠ 0: share 0 (measured), cosine undefined
    assert free["tax_share"] == 0 and torch.isnan(free["tax_cos"])
    half = _norms({"w": torch.tensor([0.5, 1.0, 1.0])}, g, ["w"])
    assert half["tax_share"] == 0.5 and half["tax_cos"] == pytest.approx(1.0)


def test_step_tax_mean_skips_undefined_optimizer_steps():
    """The rollout step's tax share averages the optimizer steps where it is defined: bitwise
    the plain mean when all are, NaN when none is; a NaN of a non-finite g is kept."""
    import math

    from gradlab.instruments import Tax
    from gradlab.loop.update.metrics import StepMetrics

    def tax(share: float, total: float) -> dict:
        t, norm = torch.tensor, 0.0 if total == 0 else share * total  # g = 0: g_tax = 0
        return {"tax_norm": t(norm), "total_norm": t(total), "tax_share": t(share),
                "tax_cos": t(1.0 if norm * total else math.nan),
                "groups": {"mlp": {"tax_share": t(share), "total_norm": t(total)}}}

    shares = [0.1, 0.3, 0.7]
    acc = StepMetrics()
    for s in shares:
        acc.record(Tax.readings(tax(s, 2.0)))
    def mean(xs):  # as `finish` pools: float64 sum of the float32 values over their count
        return float(torch.tensor(xs).double().sum()) / len(xs)

    assert acc.finish()["tax_share"] == mean(shares)  # bitwise the plain mean
    acc = StepMetrics()
    for s, total in ((0.1, 2.0), (math.nan, 0.0), (0.7, 2.0)):
        acc.record(Tax.readings(tax(s, total)))
    out = acc.finish()
    assert out["tax_share"] == mean([0.1, 0.7]) and out["tax_share/mlp"] == mean([0.1, 0.7])
    assert out["total_norm"] == 4.0 / 3  # the norms average every step
    acc = StepMetrics()
    for _ in range(2):
        acc.record(Tax.readings(tax(math.nan, 0.0)))
    out = acc.finish()
    assert math.isnan(out["tax_share"]) and math.isnan(out["tax_cos"])
    acc = StepMetrics()
    acc.record(Tax.readings(tax(0.1, 2.0)))
    acc.record(Tax.readings(tax(math.nan, math.nan)))  # non-finite: stays NaN, never skipped
    assert math.isnan(acc.finish()["tax_share"])


def test_drift_mean_over_no_position_is_nan():
    from gradlab.probes.drift import _stats

    x = torch.ones(2, 3)
    out = _stats("div_pos", x, x, torch.zeros(2, 3, dtype=torch.bool))
    assert torch.isnan(out["div_pos_dlogp_mean"]) and torch.isnan(out["div_pos_kl_mean"])
    assert out["div_pos_dlogp_sum"] == 0 and out["div_pos_count"] == 0
    some = _stats("node", x * 2, x, torch.tensor([[True, False, False], [True, False, False]]))
    assert some["node_dlogp_mean"] == 2.0 and some["node_count"] == 2
