"""Every causal-LM architecture of transformers' auto mapping, tiny, through gradlab's loop:
load, load-time self-check, sampler = forward log-probs, a GRPO step with a non-zero gradient,
W hook = closed form — or a one-line refusal before any step. Plus the pieces that make it so:
final-logit transforms, the decoder accessor, attention per architecture, dropout, tax roles."""

import tempfile

import pytest
import torch
from tolerance import assert_close_f32

from gradlab.loop.numerics.logprobs import positions, token_logps
from gradlab.loop.setup.archsweep import causal_lm_types, sweep_one, tiny_model
from gradlab.loop.setup.policy import build_tokenizer, load_policy, save_policy
from gradlab.loop.setup.selfcheck import TOLERANCE, ModelRefused, reference_logps, self_check
from gradlab.loop.setup.task import ArithmeticTask

TYPES = causal_lm_types()  # generated from transformers' mapping, not typed
_RESULTS: dict[str, dict] = {}


def _result(model_type: str) -> dict:
    if model_type not in _RESULTS:
        with tempfile.TemporaryDirectory() as d:
            _RESULTS[model_type] = sweep_one(model_type, d)
    return _RESULTS[model_type]


@pytest.mark.parametrize("model_type", TYPES)
def test_architecture_runs_exactly_or_is_refused_in_one_line(model_type):
    r = _result(model_type)
    if r["status"] == "no-tiny":
        pytest.skip(f"{model_type}: {r['reason']}")
    assert r["status"] in ("pass", "refused"), f"{model_type}: {r['reason']}"
    if r["status"] == "refused":
        assert "\n" not in r["reason"] and ("nats" in r["reason"] or "fails" in r["reason"])
        return
    assert all(g <= TOLERANCE for g in r["gaps"].values()), r["gaps"]
    assert r["grad_norm"] > 0 and r["w_gap"] < 1e-6


def test_at_least_25_architectures_pass():
    passed = [t for t in TYPES if _result(t)["status"] == "pass"]
    assert len(passed) >= 25, passed


def _tiny_folder(tmp_path, model_type, head_scale: float = 1.0, **config):
    tok = build_tokenizer()
    model = tiny_model(model_type, len(tok))
    for k, v in config.items():
        setattr(model.config, k, v)
    with torch.no_grad():  # larger logits than a fresh init's: every transform shows
        model.get_output_embeddings().weight.mul_(head_scale)
    return save_policy(model, tok, tmp_path / model_type)


def _rollout_batch(model, tok):
    from gradlab.loop.rollouts.rollout import generate

    ro = generate(model, tok, ArithmeticTask().problems(3, seed=4), G=3, max_new_tokens=6,
                  row_keys=torch.arange(9))
    return ro, (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)


@pytest.mark.parametrize("model_type,field", [("cohere", "logit_scale"),
                                              ("granite", "logits_scaling"),
                                              ("gemma2", "final_logit_softcapping")])
def test_final_logit_transforms_are_the_models_own(tmp_path, model_type, field):
    """The LM head alone is far from the model's logits (the transform is live), yet the grid
    and chunked training log-probs equal the model's own forward, and the chunked gradient
    (through the transform) equals the plain full-logits gradient."""
    model, tok = load_policy(_tiny_folder(tmp_path, model_type, head_scale=40.0))
    assert getattr(model.config, field) not in (None, 1, 1.0)
    ro, batch = _rollout_batch(model, tok)
    ref = reference_logps(model, ro)
    with torch.no_grad():  # what a path that stops at the LM head would compute
        ids, mask = torch.cat(batch[:3:2], 1), torch.cat(batch[1::2], 1)
        h = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
                  output_hidden_states=True).hidden_states[-1]
        head_only = torch.log_softmax(model.lm_head(h)[:, batch[0].shape[1] - 1 : -1], -1)
        head_only = head_only.gather(-1, batch[2][..., None]).squeeze(-1)
    m = batch[3]
    assert (head_only - ref).abs()[m].max() > 1e-2
    grads = []
    for chunk in (None, 3):
        model.zero_grad(set_to_none=True)
        lp = token_logps(model, *batch, chunk=chunk) if chunk else \
            token_logps(model, *batch, return_logprobs=True)[0]
        assert_close_f32(lp.detach()[m], ref[m], msg=f"log-probs, chunk {chunk}")
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for n in grads[0]:
        assert_close_f32(grads[1][n], grads[0][n], msg=n)  # chunked vs full: two orders


def test_self_check_refuses_a_path_without_the_transform(tmp_path, monkeypatch):
    """A training path that skipped Granite's logits_scaling is refused, naming the path and
    the gap; the real path passes."""
    from gradlab.loop.numerics import logprobs

    model, tok = load_policy(_tiny_folder(tmp_path, "granite"))
    assert max(self_check(model, tok, ArithmeticTask()).values()) <= TOLERANCE
    monkeypatch.setattr(logprobs._Output, "__call__",
                        lambda self, h: self.model.lm_head(h))
    with pytest.raises(ModelRefused, match=r"granite \(GraniteForCausalLM\) refused before "
                                           r"any step: its training log-probs differ .* nats"):
        self_check(model, tok, ArithmeticTask())


def test_opt_decoder_found_through_get_decoder(tmp_path):
    """OPT's decoder sits at model.model.decoder: chunked log-probs = the model's own."""
    from gradlab.loop.numerics.logprobs import decoder

    model, tok = load_policy(_tiny_folder(tmp_path, "opt"))
    assert decoder(model) is model.model.decoder
    ro, batch = _rollout_batch(model, tok)
    with torch.no_grad():
        lp = token_logps(model, *batch, chunk=2)
    assert_close_f32(lp[batch[3]], reference_logps(model, ro)[batch[3]])


def test_cli_refuses_mamba_in_one_line_before_any_step(tmp_path, capsys):
    from gradlab.cli.main import main

    folder = _tiny_folder(tmp_path, "mamba")
    capsys.readouterr()  # the save's progress bar
    out = tmp_path / "run"
    rc = main(["tandem", "--model", str(folder), "--steps", "1", "--out", str(out),
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "mamba (MambaForCausalLM) refused before any step: its sampler log-probs" in err[0]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_attention_chosen_per_architecture(tmp_path):
    from gradlab.loop.config import ConfigError, RunConfig
    from gradlab.loop.numerics.arch import choose_attn

    for t, want in (("qwen3", "sdpa"), ("gemma2", "eager"), ("bloom", "eager"),
                    ("gpt_oss", "eager")):
        model, _ = load_policy(_tiny_folder(tmp_path, t))
        assert model.config._attn_implementation == want, t
    with pytest.raises(ValueError, match="--attn sdpa: bloom does not support SDPA"):
        choose_attn(tiny_model("bloom", 50).config, "sdpa")
    with pytest.raises(ConfigError, match="--attn: unknown 'flash'"):
        RunConfig(attn="flash")
    model, _ = load_policy(_tiny_folder(tmp_path, "qwen3"), attn="eager")
    assert model.config._attn_implementation == "eager"


def test_cli_attn_sdpa_on_bloom_is_one_line(tmp_path, capsys):
    from gradlab.cli.main import main

    folder = _tiny_folder(tmp_path, "bloom")
    capsys.readouterr()
    rc = main(["tandem", "--model", str(folder), "--attn", "sdpa", "--steps", "1",
               "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "gradlab tandem: error: --attn sdpa: bloom does not support SDPA attention "
        "(use --attn eager or auto)"]


def test_dropout_off_by_default_and_kept_on_request(tmp_path):
    """GPT-2 with its 0.1 dropouts: off after load (train-mode forward = eval forward, the
    self-check passes in train mode); `dropout=True` keeps it (train-mode forwards differ)."""
    from gradlab.loop.numerics.arch import set_dropout

    folder = _tiny_folder(tmp_path, "gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    ids = torch.arange(2, 12)[None]
    model, tok = load_policy(folder)
    with torch.no_grad():
        ev = model(input_ids=ids).logits
        model.train()
        assert torch.equal(model(input_ids=ids).logits, ev)
    self_check(model, tok, ArithmeticTask())
    kept, _ = load_policy(folder, dropout=True)
    kept.train()
    with torch.no_grad():
        assert not torch.equal(kept(input_ids=ids).logits, kept(input_ids=ids).logits)
    assert set_dropout(kept, keep=False) == 0 and set_dropout(kept, keep=True) > 0


def test_tax_groups_from_module_types():
    """Non-Llama names land in their roles by module type: nothing of GPT-2, GPT-NeoX,
    Falcon or GPT-J in "other"; OPT's fc1/fc2 (Linears beside its attention) are MLP."""
    from gradlab.probes.tax import layer_groups, unknown_modules

    for t in ("gpt2", "gpt_neox", "falcon", "gptj", "bloom", "qwen3"):
        g = layer_groups(tiny_model(t, 60))
        assert "other" not in g.values() and {"embed", "attn", "mlp", "norm"} <= set(g.values()), t
    g = layer_groups(tiny_model("gpt2", 60))
    assert g["transformer.h.0.attn.c_attn.weight"] == "attn"
    assert g["transformer.h.0.mlp.c_fc.weight"] == "mlp"
    assert g["transformer.h.0.ln_1.weight"] == "norm" and g["transformer.wpe.weight"] == "embed"
    opt = tiny_model("opt", 60)
    g = layer_groups(opt)
    assert g["model.decoder.layers.0.fc1.weight"] == "mlp"
    assert set(unknown_modules(opt)) <= {"Linear"}  # project_in/out: counted, not guessed


def test_self_check_passes_on_the_default_policy_and_touches_no_rng():
    """The check runs before every run: it must leave the global RNG and the model's mode as
    they were (the shipped runs stay bitwise identical)."""
    model, tok = load_policy()
    model.train()
    state = torch.random.get_rng_state()
    gaps = self_check(model, tok, ArithmeticTask())
    assert torch.equal(torch.random.get_rng_state(), state) and model.training
    assert set(gaps) == {"sampler", "training", "training-chunked"}
    assert max(gaps.values()) <= 1e-5


def test_gap_is_measured_where_the_models_own_forward_is_finite():
    """A path that is not finite where the model's forward is: refused (inf). A model whose own
    forward is not finite (a diverged checkpoint) is left to the non-finite guard (exit 3 at
    step 0, tests/test_faults.py)."""
    import torch

    from gradlab.loop.setup.selfcheck import _gap

    m = torch.tensor([[True, True, False]])
    ref = torch.tensor([[-1.0, -2.0, float("nan")]])
    assert _gap(torch.tensor([[-1.0, -2.5, 5.0]]), ref, m) == 0.5
    assert _gap(torch.tensor([[float("nan"), -2.0, 0.0]]), ref, m) == float("inf")
    nan_ref = torch.full((1, 3), float("nan"))
    assert _gap(nan_ref.clone(), nan_ref, m) == 0.0
