"""The CUDA path: `pytest -m gpu` (every test here carries the `gpu` marker and is skipped
without a CUDA GPU, so the default CPU suite collects and skips them).

With a GPU they check, on the tiny shipped policy unless said otherwise:
- W exact in float32 on CUDA: hook W = closed form for every built-in objective, to
  W_EXACT_RTOL (1e-6 of max|W|), on an off-policy batch (clipping fires);
- the bf16 path: hook W = closed form under autocast (same bound), and log-probs, W and the
  policy gradient within the AMP_* bounds of CUDA float32 (gradlab/loop/numerics/precision.py);
- memory: one instrumented optimizer step (probes on, drift off) of a real-vocabulary model
  (V = 151,936) at a fixed micro-batch of 16: peak `torch.cuda.max_memory_allocated` at 64
  sequences ≤ 1.15 × at 16 (the chunked log-softmax never holds (B, T, V));
- CPU = CUDA: two rollout steps of a float32 tandem on each device give the same tokens and
  rewards, and metrics within rtol 1e-3 (the floors of tests/test_ddp.py), kernels differing
  only in float32 rounding.
"""

import math

import numpy as np
import pytest
import torch

import gradlab
from gradlab import objectives
from gradlab.cli.doctor import OBJECTIVES, read_step, tiny_case
from gradlab.loop.numerics.precision import W_EXACT_RTOL, amp_failures, amp_gap

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QWEN_VOCAB = 151_936


@pytest.fixture(scope="module")
def case():
    return tiny_case("cuda", prompts=4, G=4, seed=1)


@pytest.mark.parametrize("name", objectives.names())
def test_W_exact_in_float32_on_cuda(case, name):
    r = read_step(case.model, case.ro, case.adv, objectives.get(name), amp=False)
    assert r.W.is_cuda and r.W.abs().max() > 0
    assert r.closed_gap <= W_EXACT_RTOL, (name, r.closed_gap)


def test_bf16_path_within_bounds_on_cuda(case):
    for n in OBJECTIVES:
        ref = read_step(case.model, case.ro, case.adv, objectives.get(n), amp=False)
        got = read_step(case.model, case.ro, case.adv, objectives.get(n), amp=True)
        assert got.closed_gap <= W_EXACT_RTOL, (n, got.closed_gap)
        gap = amp_gap(ref.logps, got.logps, ref_W=ref.W, W=got.W, ref_grad=ref.grad, grad=got.grad,
                      mask=case.ro.response_mask)
        assert not amp_failures(gap), (n, gap)


def _real_vocab_step_peak(n: int, tokens: int = 64, micro_batch: int = 16, G: int = 4) -> int:
    """Peak CUDA bytes allocated over one optimizer step (weights, AdamW state, activations)
    of a 2-layer Qwen3 with Qwen's vocabulary on n random rows × `tokens` response tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gradlab.core.batch import advantages
    from gradlab.loop.config import RunConfig
    from gradlab.loop.rollouts.rollout import Rollout
    from gradlab.loop.scale.dist import Dist
    from gradlab.loop.train import Learner
    from gradlab.loop.update.metrics import StepMetrics
    from gradlab.loop.update.step import StepWork, optimizer_step
    from gradlab.loop.update.view import loop_instruments

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, tie_word_embeddings=True, max_position_embeddings=512)
    model = Qwen3ForCausalLM(cfg).cuda().train()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, QWEN_VOCAB, (n // G, 16), generator=g).repeat_interleave(G, 0)
    resp = torch.randint(0, QWEN_VOCAB, (n, tokens), generator=g)
    resp[:, :4] = resp[::G, :4].repeat_interleave(G, 0)  # shared prefixes: the probes have nodes
    mask = torch.arange(tokens) < torch.randint(tokens // 2, tokens + 1, (n,), generator=g)[:, None]
    old = (-math.log(QWEN_VOCAB) + 0.1 * torch.randn(n, tokens, generator=g)) * mask
    ro = Rollout(prompt, torch.ones_like(prompt, dtype=torch.bool), resp.masked_fill(~mask, 0),
                 mask, old, torch.arange(n // G).repeat_interleave(G), [""] * n, [None] * n)
    ro.rewards = torch.randint(0, 2, (n,), generator=g).float()
    ro = ro.to("cuda")
    L = Learner("gspo", objectives.get("gspo"), model,
                torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Generator())
    run = RunConfig(G=G, prompts=n // G, minibatches=1, micro_batch=micro_batch, device="cuda",
                    instruments="cheap,attribution@5,tax@5", progress=False,
                    max_new_tokens=tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    work = StepWork(ro, advantages(ro.rewards, ro.group), torch.arange(n, device="cuda"), 1)
    optimizer_step(L, run, work, StepMetrics(), loop_instruments(run), Dist())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del L, model, ro
    torch.cuda.empty_cache()
    return peak


def test_real_vocabulary_step_peak_memory_flat_in_the_batch():
    small, large = _real_vocab_step_peak(16), _real_vocab_step_peak(64)
    assert large <= 1.15 * small, (small / 2**20, large / 2**20)


METRICS = [("reward", 0), ("accuracy", 0), ("rho_prefix", 1e-6), ("probe_kl", 1e-6),
           ("drift_node_kl_mean", 1e-7), ("grad_norm", 1e-5), ("loss", 1e-6), ("entropy", 1e-6),
           ("w_max", 1e-6), ("tax_share", 1e-6), ("clip_frac", 1e-6), ("ratio_mean", 1e-6)]


def test_cpu_equals_cuda_metrics_for_two_steps(tmp_path):
    from gradlab.loop.config import RunConfig
    from gradlab.loop.train import train

    runs = {}
    for dev in ("cpu", "cuda"):
        cfg = RunConfig(objectives=["gspo", "dfpo-min"], out=str(tmp_path / dev), steps=2,
                        prompts=8, G=4, minibatches=4, micro_batch=4, tax_every=1,
                        probe_contexts=4, eval_every=0, progress=False, device=dev)
        train(cfg)
        runs[dev] = gradlab.load_run(tmp_path / dev, wide=True)
    a, b = runs["cpu"], runs["cuda"]
    assert (a["tokens"].to_numpy() == b["tokens"].to_numpy()).all()
    for m, atol in METRICS:
        np.testing.assert_allclose(a[m], b[m], rtol=1e-3, atol=atol, err_msg=m)
