"""Real-scale pieces: chunked log-probs (never (B, T, V)), real-vocabulary sampling, stop ids,
prompt limits. Every quantity is compared with an independent plain computation."""

import pytest
import torch
from tolerance import assert_close_f32
from transformers import Qwen3Config, Qwen3ForCausalLM

from gradlab.loop.numerics import logprobs as lpmod
from gradlab.loop.numerics.logprobs import token_logps

QWEN_VOCAB = 151_936  # Qwen3 embedding rows (the tokenizer has 151,669 ids)


def _qwen(vocab: int, seed: int = 0, tie: bool = True) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      max_position_embeddings=128, tie_word_embeddings=tie, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(cfg).eval()


def _batch(vocab: int, N: int = 5, P: int = 4, T: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    pi = torch.randint(2, vocab, (N, P), generator=g)
    pm = torch.ones(N, P, dtype=torch.bool)
    pm[1, :2] = False  # left padding
    pm[3, :1] = False
    pi[~pm] = 0
    ri = torch.randint(2, vocab, (N, T), generator=g)
    lengths = torch.tensor([T, 3, 1, 5, T])[:N]
    rm = torch.arange(T)[None] < lengths[:, None]
    ri[~rm] = 0
    return pi, pm, ri, rm


def _plain(model, *batch, temperature=1.0):
    """Reference: the full (N, T, V) log-softmax path."""
    lp, ent, _ = token_logps(model, *batch, temperature, return_entropy=True, return_logprobs=True)
    return lp, ent


@pytest.mark.parametrize("chunk", [1, 4, 7, 100])
@pytest.mark.parametrize("tie", [True, False])
def test_chunked_equals_plain_values_and_gradients(chunk, tie):
    """Chunked selective log-softmax (checkpointed per chunk) == full log-softmax: log-probs,
    entropy and the gradients of a loss using both, for chunk sizes that do not divide T."""
    model = _qwen(257, tie=tie)
    batch = _batch(257)
    w = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for mode in ("plain", "chunked"):
        model.zero_grad(set_to_none=True)
        if mode == "plain":
            lp, ent = _plain(model, *batch, temperature=0.8)
        else:
            lp, ent = token_logps(model, *batch, 0.8, return_entropy=True, chunk=chunk)
        ((w * lp).sum() + 0.3 * (w * ent).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if mode == "plain":
            ref = (lp.detach(), ent.detach())
    assert_close_f32(lp.detach(), ref[0], msg="log-probs")
    assert_close_f32(ent.detach(), ref[1], msg="entropy")
    assert (lp[~batch[3]] == 0).all() and (ent[~batch[3]] == 0).all()
    for n in grads[0]:
        assert_close_f32(grads[1][n], grads[0][n], msg=n)


def test_chunk_checkpoint_never_holds_full_logits(monkeypatch):
    """The LM head only ever sees `chunk` tokens at a time (forward and recomputation in
    backward), and only the real response tokens: the (N, T, V) tensor never exists."""
    model = _qwen(257)
    batch = _batch(257)
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    lp = token_logps(model, *batch, chunk=4)
    lp.sum().backward()
    handle.remove()
    M = int(batch[3].sum())  # 21 response tokens
    assert seen[0] == (batch[0].shape[0], 1, 257)  # the model's own call: logits_to_keep=1
    heads = [s for s in seen[1:]]  # the model's own output on one chunk: (1, chunk, V)
    assert all(len(s) == 3 and s[0] == 1 and s[1] <= 4 for s in heads)
    assert sum(s[1] for s in heads) == 2 * M  # each chunk once forward, once recomputed


def test_real_vocabulary_logps_match_small_chunk_reference():
    """V = 151,936: the default chunking equals a 3-token-chunk reference on every token, and
    agrees with the full log-softmax of a single row (the only (1, T, V) we build)."""
    model = _qwen(QWEN_VOCAB)
    batch = _batch(QWEN_VOCAB, N=4, T=6)
    with torch.no_grad():
        lp, ent = token_logps(model, *batch, return_entropy=True)
        lp3, ent3 = token_logps(model, *batch, return_entropy=True, chunk=3)
        one = [b[1:2] for b in batch]
        lp1, ent1, full = token_logps(model, *one, return_entropy=True, return_logprobs=True)
    assert lpmod.LOGIT_BUDGET // QWEN_VOCAB < 200  # the default chunk is bounded
    # log-probs ~ -12 nats, entropy ~ 11.9 nats summed over 151,936 terms in two orders
    assert_close_f32(lp, lp3, msg="log-probs")
    assert_close_f32(ent, ent3, msg="entropy")
    assert_close_f32(lp[1:2], lp1, msg="log-probs, one row")
    assert_close_f32(ent[1:2], ent1, msg="entropy, one row")
    assert full.shape == (1, 6, QWEN_VOCAB)


def test_real_vocabulary_sampling_masks_padded_ids_and_stops_on_eos_list():
    """A 151,936-row model with a 99-id tokenizer: no sampled id >= 99 (random init puts ~all
    mass on the padded rows), old_logps == token_logps (chunked), and every eos id stops."""
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.policy import build_tokenizer
    from gradlab.loop.setup.task import ArithmeticTask

    tok = build_tokenizer()
    model = _qwen(QWEN_VOCAB, seed=2)
    eq = tok.convert_tokens_to_ids("=")
    model.generation_config.eos_token_id = [tok.eos_token_id, eq]
    probs = ArithmeticTask().problems(2, seed=0)
    ro = generate(model, tok, probs, G=4, max_new_tokens=10, row_keys=torch.arange(8))
    assert int(ro.response_ids.max()) < len(tok)
    lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    assert_close_f32(lp.detach(), ro.old_logps, msg="sampler vs forward log-probs")
    for ids, m in zip(ro.response_ids, ro.response_mask):
        body = ids[m].tolist()
        assert not {eq, tok.eos_token_id} & set(body[:-1])  # nothing after the first stop id
    # the same rows, sampled alone, draw the same tokens (layout independence at full V)
    one = generate(model, tok, probs[1:], G=4, max_new_tokens=10, row_keys=torch.arange(4, 8))
    assert one.texts == ro.texts[4:]


def _jsonl(tmp_path, prompts):
    import json

    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(f)


def test_prepare_run_prompt_limit_chat_template_and_checkpointing(tmp_path):
    from gradlab.loop.config import ConfigError, RunConfig
    from gradlab.loop.setup.policy import build_tokenizer
    from gradlab.loop.setup.realmodel import PromptTask, prepare_run
    from gradlab.loop.setup.task import get_task

    tok = build_tokenizer()
    model = _qwen(len(tok))
    task = get_task(_jsonl(tmp_path, ["1+0=?", "a much longer prompt=?", "2+0=?"]))
    cfg = RunConfig(task=task.path.as_posix(), max_prompt_len=10, progress=False)
    msg = r"^prompt 1 'a much longer prompt=\?' has 22 tokens > limit 10 \(--max-prompt-len\)$"
    with pytest.raises(ConfigError, match=msg):
        prepare_run(cfg, model, tok, task)
    cfg.max_prompt_len = None
    cfg.max_new_tokens = 110  # 128 positions - 110 = 18 < 22
    with pytest.raises(ValueError, match=r"prompt 1 .* has 22 tokens > limit 18 \(max_position"):
        prepare_run(cfg, model, tok, task)
    # chat template: asked for but absent is a one-line error; present, prompts go through it
    cfg = RunConfig(task=cfg.task, chat_template=True, progress=False)
    with pytest.raises(ConfigError, match="--chat-template: the tokenizer has no chat template"):
        prepare_run(cfg, model, tok, task)
    tok.chat_template = "{% for m in messages %}U:{{ m['content'] }}{% endfor %}A:"
    wrapped = prepare_run(cfg, model, tok, task)
    assert isinstance(wrapped, PromptTask)
    assert [p.prompt for p in wrapped.problems(3, 0)] == [
        f"U:{p.prompt}A:" for p in task.problems(3, 0)]
    assert wrapped.key == task.key and wrapped.reward(task.problems(1, 0)[0], "x=1") == 1.0
    assert prepare_run(RunConfig(task=cfg.task, progress=False), model, tok, task) is task


def test_grad_checkpointing_gives_the_same_gradients():
    from gradlab.loop.config import RunConfig
    from gradlab.loop.setup.policy import build_tokenizer
    from gradlab.loop.setup.realmodel import prepare_run
    from gradlab.loop.setup.task import ArithmeticTask

    batch = _batch(257)
    grads = []
    for ckpt in (False, True):
        model = _qwen(257).train()
        prepare_run(RunConfig(grad_checkpointing=ckpt, progress=False), model,
                    build_tokenizer(), ArithmeticTask())  # the load-time check samples from it
        on = getattr(type(model), "is_activation_checkpointing", None)
        assert (on.fget(model) if on else model.is_gradient_checkpointing) == ckpt
        token_logps(model, *batch, chunk=4).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert_close_f32(a, b)


def test_math_verifier(tmp_path, monkeypatch):
    import sys

    from gradlab.loop.setup.task import get_task, set_verifier

    task = get_task(_jsonl(tmp_path, ["half=?"]))
    with pytest.raises(ValueError, match="applies to JSONL"):
        set_verifier(get_task("arithmetic"), "math")
    with pytest.raises(ValueError, match="unknown 'sympy'"):
        set_verifier(task, "sympy")
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs math-verify: pip install gradlab\[math\]"):
        set_verifier(task, "math")
    monkeypatch.undo()
    pytest.importorskip("math_verify")
    set_verifier(task, "math")
    p = task.problems(1, 0)[0]  # answer "1"
    assert task.reward(p, "so the answer is $\\frac{2}{2}$") == 1.0
    assert task.reward(p, "x=1.0") == 1.0 and task.reward(p, "x=2") == 0.0


def test_cli_over_long_prompt_exits_2_with_one_line(tmp_path, capsys):
    from gradlab.cli.main import main

    task = _jsonl(tmp_path, ["1+0=?", "2+0=?", "a much longer prompt=?"])
    rc = main(["tandem", "--task", task, "--max-prompt-len", "8", "--steps", "1",
               "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == ["gradlab tandem: error: prompt 2 'a much longer prompt=?' has 22 tokens "
                   "> limit 8 (--max-prompt-len)"]


def test_train_uses_chat_template_and_grad_checkpointing_changes_nothing(tmp_path):
    """prepare_run is wired into train(): the samples' prompts went through the chat template,
    and --grad-checkpointing (recomputed activations) gives the same run, metric for metric."""
    import json

    from gradlab.loop.config import RunConfig
    from gradlab.loop.setup.policy import load_policy, save_policy
    from gradlab.loop.train import train

    model, tok = load_policy()
    # a one-character template: the toy policy still answers (some right, some wrong)
    tok.chat_template = "{% for m in messages %}?{{ m['content'] }}{% endfor %}"
    save_policy(model, tok, tmp_path / "m")
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                         for p, a in [("12+34=?", "46"), ("25+31=?", "56")]))
    kw = dict(task=str(f), model=str(tmp_path / "m"), steps=1, prompts=2, G=4, minibatches=1,
              tax_every=1, eval_every=0, progress=False, probe_contexts=2,
              objectives=["gspo"], chat_template=True)
    runs = []
    for gc in (False, True):
        out = tmp_path / f"run{gc}"
        train(RunConfig(out=str(out), grad_checkpointing=gc, **kw))
        lines = (out / "metrics.jsonl").read_text().splitlines()
        runs.append({k: v for k, v in json.loads(lines[0]).items() if not k.startswith("time_")})
        sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
        assert sample["prompt"] in ("?12+34=?", "?25+31=?")
    assert runs[0] == runs[1]
    assert runs[0]["grad_norm"] > 0, runs[0]["reward"]
