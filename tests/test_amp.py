"""Mixed precision (`--amp`, gradlab/loop/numerics/precision.py) on the CPU: bf16 autocast over float32
master weights.

Tolerances (the constants in gradlab/loop/numerics/precision.py, stated in docs/performance.md):
- the hook-measured W equals the closed form at the autocast log-probs to W_EXACT_RTOL (1e-6
  of max|W|): the loss is float32 arithmetic whatever precision the forward ran in;
- against float32 on the same tokens and weights, bf16 moves log-probs by ≤ AMP_LOGP_ATOL
  (0.75 nats, any token) and ≤ AMP_LOGP_MEAN (0.05 nats, mean), W by ≤ AMP_W_L1 (10 % in L1)
  and turns the policy gradient by at most cos ≥ AMP_GRAD_COS (0.95). Measured on the tiny
  policy, seeds 0–5: ≤ 0.43 / 0.022 nats, ≤ 3.8 % and cos ≥ 0.995 for one process; FSDP2's
  module-level bf16 (2 ranks, gloo) sits further: cos ≥ 0.97.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import run_tree
from safetensors.torch import load_file
from test_fsdp import ENV, TORCHRUN

import gradlab
from gradlab import objectives
from gradlab.cli.doctor import OBJECTIVES, read_step, tiny_case
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.numerics.precision import (
    AMP_LOGP_ATOL,
    W_EXACT_RTOL,
    amp_failures,
    amp_gap,
    autocast,
)

ALL = [(n, {}) for n in objectives.names()] + [("grpo", {"norm": "seq"}),
                                               ("gspo", {"eps": (0.2, 0.2)})]


@pytest.fixture(scope="module")
def case():
    return tiny_case("cpu", prompts=4, G=4, seed=1)


def test_autocast_runs_bf16_matmuls_and_returns_float32_logps(case):
    """Under --amp the LM head's logits are bf16 (autocast is on, on the CPU too), yet the
    log-probs the loss sees are float32 and the weights stay float32."""
    ro, m = case.ro, case.model
    seen = []
    h = m.lm_head.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    try:
        with autocast("cpu", True):
            lp = token_logps(m, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    finally:
        h.remove()
    assert seen and set(seen) == {torch.bfloat16} and lp.dtype == torch.float32
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    with autocast("cpu", False):
        assert token_logps(m, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                           ro.response_mask).dtype == torch.float32


@pytest.mark.parametrize("name,params", ALL, ids=[f"{n}{p or ''}" for n, p in ALL])
def test_hook_W_equals_closed_form_under_autocast(case, name, params):
    """Off-policy batch (ratios ≠ 1, clipping fires): the hook's W under bf16 autocast is the
    closed form at the autocast log-probs, to float32 rounding."""
    r = read_step(case.model, case.ro, case.adv, objectives.get(name, **params), amp=True)
    assert r.W.abs().max() > 0
    assert r.closed_gap <= W_EXACT_RTOL, (name, params, r.closed_gap)


def test_autocast_within_bf16_bounds_of_float32(case):
    """Same tokens and weights, float32 against bf16 autocast: log-probs, W and the policy
    gradient within the documented bounds (and not equal: bf16 really ran)."""
    mask = case.ro.response_mask
    for n in OBJECTIVES:
        ref = read_step(case.model, case.ro, case.adv, objectives.get(n), amp=False)
        got = read_step(case.model, case.ro, case.adv, objectives.get(n), amp=True)
        gap = amp_gap(ref.logps, got.logps, ref_W=ref.W, W=got.W, ref_grad=ref.grad, grad=got.grad,
                      mask=mask)
        assert not amp_failures(gap), (n, gap)
        assert gap["logp_max"] > 1e-4, gap  # bf16 rounding is visible: autocast was on


def test_chunked_log_softmax_under_autocast_matches_the_plain_path(case):
    """The selective log-softmax (logits chunk by chunk, float32 from bf16) under autocast
    gives the plain (N, T, V) path's log-probs and gradients to bf16 rounding."""
    ro, m = case.ro, case.model
    args = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    out = []
    for chunk in (None, 5):
        with autocast("cpu", True):
            lp = token_logps(m, *args, chunk=chunk)
        lp.sum().backward()
        out.append((lp.detach(), torch.cat([p.grad.flatten() for p in m.parameters()])))
        m.zero_grad(set_to_none=True)
    (a, ga), (b, gb) = out
    assert float((a - b).abs().max()) <= AMP_LOGP_ATOL
    assert torch.nn.functional.cosine_similarity(ga, gb, dim=0) > 0.99


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


ARGS = ["--objectives", "gspo,dfpo-min", "--prompts", "4", "--G", "4", "--minibatches", "2",
        "--ckpt-every", "1", "--tax-every", "1", "--probe-contexts", "4", "--eval-every", "2",
        "--eval-size", "4", "--no-progress", "--steps", "2", "--amp"]


def test_amp_tandem_runs_end_to_end_with_finite_metrics_and_float32_checkpoints(tmp_path):
    """`gradlab tandem --amp`: 2 rollout steps × 2 objectives, tax, drift, probe set and
    held-out evaluation on; every metric finite; weights and AdamW moments saved in float32."""
    out = tmp_path / "amp"
    _run([sys.executable, "-m", "gradlab", "tandem", "--out", str(out), *ARGS])
    wide = gradlab.load_run(out, wide=True)
    assert len(wide) == 4  # 2 steps × 2 objectives
    for k in ("loss", "grad_norm", "w_max", "rho_prefix", "entropy", "tax_share", "probe_kl",
              "drift_node_kl_mean", "ratio_mean", "reward"):
        assert np.isfinite(wide[k].to_numpy(dtype=float)).all(), k
    assert (wide["w_max"] > 0).all()
    _float32_checkpoints(out)


def _float32_checkpoints(out: Path) -> None:
    for obj in ("gspo", "dfpo-min"):
        model = load_file(out / "checkpoints" / obj / "model.safetensors")
        opt = load_file(out / "checkpoints" / obj / "optimizer.safetensors")
        assert model and {v.dtype for v in model.values()} == {torch.float32}, obj
        moments = {k: v for k, v in opt.items() if not k.startswith("extra.")}  # RNG bytes aside
        assert moments and {v.dtype for v in moments.values()} == {torch.float32}, obj


WORKER = r"""
import sys, torch
from gradlab import objectives
from gradlab.cli.doctor import OBJECTIVES, read_step, tiny_case
from gradlab.loop.scale.dist import setup
from gradlab.loop.numerics.precision import amp_failures, amp_gap
D = setup("cpu", fsdp=True)
c = tiny_case("cpu", prompts=4, G=4, seed=int(sys.argv[1]))
ro, adv, N = c.ro, c.adv, c.ro.response_ids.shape[0]
norms = (N, int(ro.response_mask.sum()), ro.response_ids.shape[1])  # the global normalisers
ref = {n: [read_step(c.model, ro, adv, objectives.get(n), amp=amp) for amp in (False, True)]
       for n in OBJECTIVES}
model = D.wrap(c.model, amp=True)  # FSDP2 with MixedPrecisionPolicy(bf16, fp32)
assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}  # fp32 shards
with torch.no_grad():  # outside autocast the gathered weights compute in bf16
    assert model(input_ids=ro.prompt_ids[:1]).logits.dtype == torch.bfloat16
mine = (ro.group % D.world == D.rank).nonzero().squeeze(-1)  # this rank's groups
m = ro.response_mask[mine]
for n in OBJECTIVES:
    got = read_step(model, ro, adv, objectives.get(n), amp=True, rows=mine, norms=norms,
                    grad_scale=D.world)
    assert got.closed_gap <= 1e-6, (n, got.closed_gap)
    for label, r in zip(("float32", "one process --amp"), ref[n]):
        gap = amp_gap(r.logps[mine], got.logps, ref_W=r.W[mine], W=got.W, ref_grad=r.grad,
                      grad=got.grad, mask=m)
        assert not amp_failures(gap), (n, label, gap)
        print("rank", D.rank, n, label, {k: round(v, 4) for k, v in gap.items()})
del model, c  # the sharded model goes before its process group
D.teardown()
"""


def test_fsdp_mixed_precision_matches_one_process(tmp_path):
    """2 ranks (gloo), FSDP2 with MixedPrecisionPolicy(param bf16, reduce fp32), each rank its
    own groups with the global normalisers: the gathered gradient (reduce-scattered in float32,
    × ranks as the loop's `fix_grads`), W and log-probs within the bf16 bounds of one process
    float32 and of one process --amp; hook W = closed form; shards float32."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**ENV, "PYTHONPATH": str(Path(gradlab.__file__).parents[1])}
    r = run_tree([*TORCHRUN, str(script), "1"], timeout=300, together=120, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("rank") == 2 * 2 * len(OBJECTIVES), r.stdout


def test_fsdp_amp_tandem_runs_end_to_end_with_float32_checkpoints(tmp_path):
    """`torchrun ... tandem --fsdp --amp`: sampling, optimizer steps, the learning tax (its
    ranks' sum in float32), drift, probe set and evaluation run; the gathered checkpoints are
    float32."""
    out = tmp_path / "fsdp"
    _run([*TORCHRUN, "-m", "gradlab", "tandem", "--out", str(out), *ARGS, "--fsdp"])
    wide = gradlab.load_run(out, wide=True)
    for k in ("loss", "grad_norm", "w_max", "tax_share", "drift_node_kl_mean"):
        assert np.isfinite(wide[k].to_numpy(dtype=float)).all(), k
    _float32_checkpoints(out)
