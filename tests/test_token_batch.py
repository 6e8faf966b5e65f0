"""`Rollout.token_batch`: the TokenBatch of some rollout rows, field by field equal to the
batch built by hand on real sampled rollouts (tiny policy), a repair layout's
`repair_of` renumbered into the batch's rows, and every field against its own indexing."""

import pytest
import torch

from gradlab.core.batch import TokenBatch, advantages
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.rollouts.repair import generate_repair
from gradlab.loop.rollouts.rollout import batch_repair_of, generate
from gradlab.loop.rollouts.spec import SamplingSpec
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask


def rows_batch(ro, rows, logps, adv, norms, t=None) -> TokenBatch:
    """The batch built by hand, field by field (the reference `token_batch` is held to)."""
    t = ro.response_ids.shape[1] if t is None else t
    rewards = ro.rewards[rows] if ro.rewards is not None else None
    return TokenBatch(ro.response_ids[rows, :t], ro.response_mask[rows, :t], logps,
                      ro.old_logps[rows, :t], adv[rows], ro.group[rows], rewards=rewards,
                      repair_of=batch_repair_of(ro.repair_of, rows), n_seqs=norms[0],
                      n_tokens=norms[1], width=norms[2], validate=False)

G = 8
FIELDS = ("tokens", "mask", "logps", "old_logps", "advantages", "group", "ref_logps", "rewards",
          "repair_of", "n_seqs", "n_tokens", "width", "validate")


@pytest.fixture(scope="module")
def rollouts():
    model, tok = load_policy()
    task = ArithmeticTask()
    problems = task.problems(2, 5) + [ArithmeticTask(1).problems(1, 0)[0], task.make_problem(100, 7)]
    keys = torch.arange(len(problems) * G) + 10_000
    T = task.max_new_tokens
    flat = generate(model, tok, problems, G, T, row_keys=keys, task=task)
    spec = SamplingSpec(G, T, 1.0, layout="repair", repair="splice")
    repair = generate_repair(model, tok, problems, spec, keys, task)
    return model, {"independent": flat, "repair": repair}


def _same(a: TokenBatch, b: TokenBatch) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), name
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert x == y, name


def _rows(ro) -> torch.Tensor:
    """Whole groups, last group first (a step's order is not the rollout's)."""
    n_groups = int(ro.group.max()) + 1
    return torch.cat([(ro.group == g).nonzero().squeeze(-1) for g in reversed(range(n_groups))])


@pytest.mark.parametrize("layout", ["independent", "repair"])
def test_token_batch_equals_rows_batch(rollouts, layout):
    model, ro = rollouts[0], rollouts[1][layout]
    rows = _rows(ro)
    t = int(ro.lengths.max()) - 1  # a cut shorter than the rollout's width
    s = ro.rows(rows, t=t)
    lp = token_logps(model, s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask)
    adv = advantages(ro.rewards, ro.group)
    norms = (3 * rows.numel(), 1000, 40)
    got = ro.token_batch(lp, adv, rows, t=t, norms=norms, validate=False)
    _same(got, rows_batch(ro, rows, lp, adv, norms, t))
    # each field against its own indexing, not against rows_batch
    assert torch.equal(got.tokens, ro.response_ids[rows][:, :t]) and got.logps is lp
    assert torch.equal(got.advantages, adv[rows]) and torch.equal(got.rewards, ro.rewards[rows])
    assert (got.n_seqs, got.n_tokens, got.width) == norms
    if layout == "repair":
        kept = (got.repair_of >= 0).nonzero().squeeze(-1)
        assert kept.numel() > 0  # the renumbering is exercised
        # batch row b corrects batch row repair_of[b]: the same rollout row as before
        assert torch.equal(rows[got.repair_of[kept]], ro.repair_of[rows[kept]])
    else:
        assert got.repair_of is None


@pytest.mark.parametrize("layout", ["independent", "repair"])
def test_token_batch_all_rows_and_overrides(rollouts, layout):
    model, ro = rollouts[0], rollouts[1][layout]
    N, T = ro.response_ids.shape
    lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    adv = advantages(ro.rewards, ro.group)
    every = ro.token_batch(lp, adv)  # rows None: all rows, the rollout's own order
    _same(every, rows_batch(ro, torch.arange(N), lp, adv, (None, None, None)).replace(validate=True))
    old = torch.zeros(N, T, dtype=torch.float64)
    assert ro.token_batch(lp, adv, old_logps=old).old_logps is old
    with pytest.raises(ValueError, match="old_logps"):
        ro.token_batch(lp, adv, old_logps=old[:, :1])  # TokenBatch names the field at fault
