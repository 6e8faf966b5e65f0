"""generate(): determinism, shapes, masks; token_logps(): agreement with old_logps."""

import pytest
import torch
from tolerance import assert_close_f32

from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.rollouts.rollout import Rollout, generate, score
from gradlab.loop.setup.policy import build_tokenizer, load_policy, new_model
from gradlab.loop.setup.task import ArithmeticTask

G = 4


@pytest.fixture(scope="module")
def setup():
    model, tok = load_policy()
    task = ArithmeticTask()
    # Mixed prompt lengths (1-, 2- and 3-digit operands) exercise left padding.
    problems = task.problems(2, 0) + ArithmeticTask(1).problems(1, 0) + [task.make_problem(100, 7)]
    return model, tok, task, problems


def _rollout(setup, seed=0, **kw):
    model, tok, task, problems = setup
    g = torch.Generator().manual_seed(seed)
    return generate(
        model, tok, problems, G=G, max_new_tokens=task.max_new_tokens, generator=g, task=task, **kw
    )


def test_generate_deterministic(setup):
    a, b, c = _rollout(setup, 0), _rollout(setup, 0), _rollout(setup, 1)
    assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
    assert torch.equal(a.old_logps, b.old_logps)
    assert not torch.equal(a.response_ids, c.response_ids) or a.texts != c.texts


def test_generate_shapes_and_masks(setup):
    _model, tok, task, problems = setup
    ro = _rollout(setup)
    N, _T = ro.response_ids.shape
    assert N == len(problems) * G and ro.G == G
    assert ro.prompt_ids.shape == ro.prompt_mask.shape and ro.prompt_ids.shape[0] == N
    assert ro.group.tolist() == [i // G for i in range(N)]
    assert [p.prompt for p in ro.problems] == [p.prompt for p in problems for _ in range(G)]
    assert ro.prompt_mask.dtype == torch.bool and ro.response_mask.dtype == torch.bool
    assert ro.old_logps.dtype == torch.float32 and ro.response_ids.dtype == torch.long
    # Left padding: a row's mask is False...False True...True.
    pm = ro.prompt_mask.long()
    assert torch.all(pm[:, 1:] >= pm[:, :-1]) and torch.all(pm[:, -1] == 1)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    finished = 0
    for i in range(N):
        ids, m = ro.response_ids[i], ro.response_mask[i]
        L = int(m.sum())
        assert m[:L].all() and not m[L:].any()  # contiguous from the start
        assert (ids[L:] == pad).all() and (ro.old_logps[i, L:] == 0).all()
        assert (ro.old_logps[i, :L] <= 0).all()
        if eos in ids[:L].tolist():
            finished += 1
            assert ids[L - 1] == eos and eos not in ids[: L - 1].tolist()  # EOS included, last
        assert ro.texts[i] == tok.decode(ids[:L][ids[:L] != eos].tolist())
        assert "<eos>" not in ro.texts[i] and "<pad>" not in ro.texts[i]
    assert finished >= N // 2  # the warm-started policy stops by itself
    assert ro.response_mask.any(0).all()  # T is trimmed to the longest response
    assert torch.equal(ro.rewards, score(task, ro)) and ro.rewards.shape == (N,)
    # The template prefix: almost every response starts with "so ".
    assert sum(t.startswith("so ") for t in ro.texts) >= 0.9 * N


def test_token_logps_match_old_logps(setup):
    model, *_ = setup
    for temp in (1.0, 0.7):
        ro = _rollout(setup, seed=2, temperature=temp)
        lp = token_logps(
            model,
            ro.prompt_ids,
            ro.prompt_mask,
            ro.response_ids,
            ro.response_mask,
            temperature=temp,
        )
        assert lp.shape == ro.old_logps.shape and lp.requires_grad
        assert_close_f32(lp.detach(), ro.old_logps, msg="sampler vs forward log-probs")


def test_token_logps_extras_and_padding_invariance(setup):
    model, tok, *_ = setup
    ro = _rollout(setup, seed=3)
    lp, ent, full = token_logps(
        model,
        ro.prompt_ids,
        ro.prompt_mask,
        ro.response_ids,
        ro.response_mask,
        return_entropy=True,
        return_logprobs=True,
    )
    N, T = ro.response_ids.shape
    assert ent.shape == (N, T) and full.shape == (N, T, len(tok))
    assert (ent >= -1e-6).all() and (ent[~ro.response_mask] == 0).all()
    assert_close_f32(full.exp().sum(-1), torch.ones(N, T))
    _lp_only, ent_only = token_logps(
        model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, return_entropy=True
    )
    assert_close_f32(ent_only, ent)
    # One row alone, without any padding, gives the same log-probs as inside the batch.
    i = 2 * G  # the 1-digit problem: the most left padding
    pm, rm = ro.prompt_mask[i], ro.response_mask[i]
    single = token_logps(
        model,
        ro.prompt_ids[i : i + 1, pm],
        pm[pm][None],
        ro.response_ids[i : i + 1, rm],
        rm[rm][None],
    )
    assert_close_f32(single[0], lp[i, rm], msg="one row alone vs in the batch")
    # Gradient flows to the parameters.
    lp.sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_greedy_and_global_rng(setup):
    ro = _rollout(setup, temperature=0.0)
    for g in range(ro.response_ids.shape[0] // G):
        rows = ro.response_ids[g * G : (g + 1) * G]
        assert (rows == rows[0]).all()  # greedy: all G samples agree
    model, tok, _task, problems = setup
    ro2 = generate(model, tok, problems[:1], G=2, max_new_tokens=4)  # generator=None works
    assert ro2.response_ids.shape[1] <= 4


def test_rollout_to_and_untrained_model(setup):
    _, _, _task, problems = setup
    tok = build_tokenizer()
    model = new_model(tok, seed=0)
    model.train()
    ro = generate(
        model, tok, problems, G=2, max_new_tokens=5, generator=torch.Generator().manual_seed(0)
    )
    assert model.training  # mode restored
    assert ro.response_ids.shape[0] == len(problems) * 2 and ro.response_ids.shape[1] <= 5
    moved = ro.to("cpu")
    assert isinstance(moved, Rollout) and torch.equal(moved.old_logps, ro.old_logps)


def test_row_keyed_sampling_is_independent_of_batch_layout():
    """Rows sampled alone or in a bigger batch, in any order, get the same tokens (DDP shards)."""
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask

    model, tok = load_policy()
    probs = ArithmeticTask().problems(3, seed=5)
    keys = torch.arange(12) + 1000
    full = generate(model, tok, probs, G=4, max_new_tokens=12, row_keys=keys)
    part = generate(model, tok, probs[1:2], G=4, max_new_tokens=12, row_keys=keys[4:8])
    assert full.texts[4:8] == part.texts
    other = generate(model, tok, probs, G=4, max_new_tokens=12, row_keys=keys + 1)
    assert other.texts != full.texts


def test_hashed_uniform_and_inverse_cdf_against_independent_computation():
    """One float64 uniform per (key, t); the token is the first id whose CDF exceeds u * total."""
    import numpy as np

    from gradlab.loop.rollouts.rollout import _sample, hashed_uniform

    keys = torch.arange(20_000) + 7
    u = hashed_uniform(keys, 3)
    assert u.dtype == torch.float64 and u.shape == (20_000,)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u, hashed_uniform(keys, 4))  # a fresh uniform per t
    torch.testing.assert_close(hashed_uniform(keys[5:9], 3), u[5:9], rtol=0, atol=0)
    # Exact token: independent numpy inverse CDF of the same tempered distribution.
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(0)) * 2
    tok, lp = _sample(logits, 0.7, None, keys[:200], t=3)
    p = np.exp(torch.log_softmax(logits.double() / 0.7, -1).numpy())
    cdf = p.cumsum(-1)
    want = [(c > ui * c[-1]).argmax() for c, ui in zip(cdf, u[:200].numpy())]
    assert tok.tolist() == want
    torch.testing.assert_close(lp.double(), torch.log(torch.tensor(p[range(200), want])),
                               atol=1e-5, rtol=0)
    # Frequencies follow the distribution: one row, 20k keys.
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    tok, _ = _sample(row.expand(20_000, 5), 1.0, None, keys, t=0)
    freq = torch.bincount(tok, minlength=5).double() / 20_000
    torch.testing.assert_close(freq, torch.softmax(row[0].double(), -1), atol=0.012, rtol=0)


def test_vocab_mask_and_stop_list():
    """Ids >= len(tokenizer) are never sampled; any generation_config eos id ends a row."""
    from gradlab.loop.rollouts.rollout import _sample, stop_ids

    logits = torch.zeros(4000, 10)
    logits[:, 7:] = 5.0  # most mass on the padded ids 7..9
    tok, lp = _sample(logits, 1.0, None, torch.arange(4000), t=0, n_vocab=7)
    assert int(tok.max()) < 7 and len(set(tok.tolist())) == 7
    # the returned log-prob is the model's full-vocabulary one (what token_logps recomputes)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[0, 0].expand(4000))
    g = torch.Generator().manual_seed(0)
    tok, _ = _sample(logits, 1.0, g, None, n_vocab=7)
    assert int(tok.max()) < 7
    model, tok_ = load_policy()
    model.generation_config.eos_token_id = [tok_.eos_token_id, tok_.convert_tokens_to_ids("=")]
    try:
        assert stop_ids(model, tok_) == sorted({tok_.eos_token_id, tok_.convert_tokens_to_ids("=")})
        probs = ArithmeticTask().problems(3, seed=5)
        ro = generate(model, tok_, probs, G=4, max_new_tokens=12, row_keys=torch.arange(12))
    finally:
        model.generation_config.eos_token_id = tok_.eos_token_id
    eq = tok_.convert_tokens_to_ids("=")
    for ids, m, text in zip(ro.response_ids, ro.response_mask, ro.texts):
        body = ids[m].tolist()
        assert eq not in body[:-1] and "=" not in text  # stopped at the first "=", not after
        assert body[-1] == eq or len(body) == 12 or body[-1] == tok_.eos_token_id
    assert sum(ids[m].tolist()[-1] == eq for ids, m in zip(ro.response_ids, ro.response_mask)) >= 6


def test_over_long_prompt_is_named_before_sampling(setup):
    model, tok, task, problems = setup
    short_first = [problems[2], problems[3]]  # 5 and 7 tokens (one char each)
    with pytest.raises(ValueError, match=r"^prompt 1 has 7 tokens > limit 6 \(--max-prompt-len\)$"):
        generate(model, tok, short_first, G=2, max_new_tokens=4, max_prompt_len=6)
    assert generate(model, tok, short_first, G=2, max_new_tokens=2, max_prompt_len=7).G == 2
    n_pos = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 0 has 7 tokens > limit 2 \(max_position_embeddings {n_pos}"):
        generate(model, tok, problems, G=2, max_new_tokens=n_pos - 2)
