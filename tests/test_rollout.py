"""generate(): determinism, shapes, masks; token_logps(): agreement with old_logps."""

import pytest
import torch

from gradlab.loop.logprobs import token_logps
from gradlab.loop.policy import build_tokenizer, load_policy, new_model
from gradlab.loop.rollout import Rollout, generate, score
from gradlab.loop.task import ArithmeticTask

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
        torch.testing.assert_close(lp.detach(), ro.old_logps, atol=5e-5, rtol=0)


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
    torch.testing.assert_close(full.exp().sum(-1), torch.ones(N, T))
    _lp_only, ent_only = token_logps(
        model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, return_entropy=True
    )
    torch.testing.assert_close(ent_only, ent)
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
    torch.testing.assert_close(single[0], lp[i, rm], atol=1e-5, rtol=0)
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
    from gradlab.loop.policy import load_policy
    from gradlab.loop.task import ArithmeticTask

    model, tok = load_policy()
    probs = ArithmeticTask().problems(3, seed=5)
    keys = torch.arange(12) + 1000
    full = generate(model, tok, probs, G=4, max_new_tokens=12, row_keys=keys)
    part = generate(model, tok, probs[1:2], G=4, max_new_tokens=12, row_keys=keys[4:8])
    assert full.texts[4:8] == part.texts
    other = generate(model, tok, probs, G=4, max_new_tokens=12, row_keys=keys + 1)
    assert other.texts != full.texts
