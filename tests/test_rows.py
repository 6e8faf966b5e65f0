"""`TokenBatch.rows` and `Rollout.rows`: every field against its own field-by-field selection
(the dataclass fields are enumerated, so a new field must be classified here), a bool mask
equal to its index form, the empty selection, row references renumbered, clear errors for bad
indices, and figure2's one-group subset keeping every per-row field."""

import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from gradlab.core.batch import TokenBatch, advantages
from gradlab.loop.rollouts.rollout import Rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

B, T, P = 8, 5, 3
# The test's own classification of every field (a new field fails `test_every_field_is_known`).
BATCH_ROW = {"tokens", "mask", "logps", "old_logps", "advantages", "group", "ref_logps",
             "rewards"}
BATCH_REF = {"repair_of"}
BATCH_SAME = {"n_seqs", "n_tokens", "width", "validate"}
ROLLOUT_ROW = {"prompt_ids", "prompt_mask", "group", "rewards", "branch_at", "generated"}
ROLLOUT_TOKEN = {"response_ids", "response_mask", "old_logps"}
ROLLOUT_LIST = {"texts", "problems"}
ROLLOUT_REF = {"parent", "repair_of"}
ROLLOUT_SAME = {"temperature", "repairs_tried", "discarded_tokens"}

IDX = [torch.tensor([5, 1, 4]), torch.tensor([2, 3, 6, 7]), torch.tensor([0]),
       torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])]


def _batch(token_adv: bool = False) -> TokenBatch:
    """A batch with every optional field set: 4 groups of 2 (labels 10, 20, 30, 40, rows of a
    group not contiguous); rows 4 and 7 repair rows 0 and 3."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 4, 1, 2, 5, 3, 4])
    mask = torch.arange(T) < lengths[:, None]
    group = torch.tensor([10, 20, 30, 40, 10, 20, 30, 40])
    rewards = torch.rand(B, generator=g)
    adv = advantages(rewards, group)
    if token_adv:
        adv = adv[:, None] * torch.rand(B, T, generator=g)
    lp = lambda: -torch.rand(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return TokenBatch(torch.randint(0, 50, (B, T), generator=g), mask,
                      lp().requires_grad_(True), lp(), adv.double(), group, ref_logps=lp(),
                      rewards=rewards.double(), repair_of=torch.tensor([-1, -1, -1, -1, 0, -1, -1, 3]),
                      n_seqs=16, n_tokens=40, width=9)


def _rollout() -> Rollout:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 3, 4, 1, 2, 5, 3, 4])
    return Rollout(
        prompt_ids=torch.randint(0, 50, (B, P), generator=g),
        prompt_mask=torch.rand(B, P, generator=g) > 0.3,
        response_ids=torch.randint(0, 50, (B, T), generator=g),
        response_mask=torch.arange(T) < lengths[:, None],
        old_logps=-torch.rand(B, T, generator=g),
        group=torch.arange(B) // 2, texts=[f"text{i}" for i in range(B)],
        problems=[f"problem{i // 2}" for i in range(B)], temperature=0.7,
        rewards=torch.rand(B, generator=g),
        parent=torch.tensor([-1, 0, -1, 2, -1, 4, -1, 6]),
        branch_at=torch.tensor([-1, 2, -1, 1, -1, 3, -1, 0]),
        generated=torch.tensor([5, 1, 4, 0, 2, 2, 3, 4]),
        repair_of=torch.tensor([-1, -1, -1, 2, -1, -1, -1, 4]),
        repairs_tried=3, discarded_tokens=11)


def _ref_renumber(ref: torch.Tensor, idx: list[int]) -> list[int]:
    """Position in idx of the row each selected row refers to; −1 none or not selected."""
    out = []
    for r in idx:
        o = int(ref[r])
        out.append(idx.index(o) if o >= 0 and o in idx else -1)
    return out


def _stack(v: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Row selection one row at a time (independent of advanced indexing)."""
    return torch.stack([v[i] for i in idx]) if idx else v[:0]


def test_every_field_is_known():
    assert {f.name for f in fields(TokenBatch)} == BATCH_ROW | BATCH_REF | BATCH_SAME
    assert {f.name for f in fields(Rollout)} == (ROLLOUT_ROW | ROLLOUT_TOKEN | ROLLOUT_LIST
                                                 | ROLLOUT_REF | ROLLOUT_SAME)


@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("idx", IDX, ids=lambda i: "-".join(map(str, i.tolist())))
def test_token_batch_rows_every_field(idx, token_adv):
    b = _batch(token_adv)
    got = b.rows(idx)
    il = idx.tolist()
    for f in fields(TokenBatch):
        v, w = getattr(b, f.name), getattr(got, f.name)
        if f.name in BATCH_ROW:
            ref = _stack(v.detach(), il)
            assert w.dtype == v.dtype and w.shape == ref.shape and torch.equal(w.detach(), ref), f.name
        elif f.name in BATCH_REF:
            assert w.tolist() == _ref_renumber(v, il), f.name
        else:
            assert w == v, f.name
    assert got.logps.requires_grad  # the graph is kept: the gradient reaches the source rows
    got.logps.sum().backward()
    assert b.logps.grad.sum(-1).tolist() == [float(il.count(i) * T) for i in range(B)]


@pytest.mark.parametrize("t", [None, 3])
@pytest.mark.parametrize("idx", IDX, ids=lambda i: "-".join(map(str, i.tolist())))
def test_rollout_rows_every_field(idx, t):
    ro = _rollout()
    got = ro.rows(idx, t=t)
    il = idx.tolist()
    for f in fields(Rollout):
        v, w = getattr(ro, f.name), getattr(got, f.name)
        if f.name in ROLLOUT_ROW:
            assert w.dtype == v.dtype and torch.equal(w, _stack(v, il)), f.name
        elif f.name in ROLLOUT_TOKEN:
            ref = _stack(v, il)[:, : T if t is None else t]
            assert w.dtype == v.dtype and w.shape == ref.shape and torch.equal(w, ref), f.name
        elif f.name in ROLLOUT_LIST:
            assert w == [v[i] for i in il], f.name
        elif f.name in ROLLOUT_REF:
            assert w.tolist() == _ref_renumber(v, il), f.name
        else:
            assert w == v, f.name


def test_optional_fields_absent_stay_none():
    b = _batch().replace(ref_logps=None, rewards=None, repair_of=None, n_seqs=None)
    got = b.rows(torch.tensor([1, 0]))
    assert got.ref_logps is None and got.rewards is None and got.repair_of is None
    assert got.n_seqs is None and got.n_tokens == 40
    ro = _rollout()
    ro.parent = ro.repair_of = ro.rewards = None
    sub = ro.rows(torch.tensor([3]))
    assert sub.parent is None and sub.repair_of is None and sub.rewards is None


def test_bool_mask_equals_index_form():
    b, ro = _batch(), _rollout()
    m = torch.tensor([False, True, True, False, True, False, False, True])
    idx = m.nonzero().squeeze(-1)
    for x, y in ((b.rows(m), b.rows(idx)), (ro.rows(m, t=2), ro.rows(idx, t=2))):
        for f in fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, f.name
    assert b.rows([1, 2, 4, 7]).tokens.equal(b.rows(m).tokens)  # an int sequence too


def test_empty_selection():
    b, ro = _batch(), _rollout()
    for idx in (torch.zeros(0, dtype=torch.long), torch.zeros(B, dtype=torch.bool), []):
        e = b.rows(idx)
        assert e.B == 0 and e.T == T and e.repair_of.shape == (0,) and e.ref_logps.shape == (0, T)
        s = ro.rows(idx)
        assert s.response_ids.shape == (0, T) and s.prompt_ids.shape == (0, P)
        assert s.texts == [] and s.parent.shape == (0,)


def test_relabel_groups():
    b, ro = _batch(), _rollout()
    idx = torch.tensor([7, 2, 3, 6])  # labels 40, 30, 40, 30
    assert b.rows(idx).group.tolist() == [40, 30, 40, 30]  # labels kept by default
    assert b.rows(idx, relabel=True).group.tolist() == [1, 0, 1, 0]
    sub = ro.rows(torch.tensor([6, 7, 0, 1]), relabel=True)  # no repair among them
    assert sub.group.tolist() == [1, 1, 0, 0] and sub.G == 2


@pytest.mark.parametrize("bad,msg", [
    (torch.tensor([0, 8]), "index 8 (position 1 of idx) is out of range for 8 rows"),
    (torch.tensor([-1]), "index -1 (position 0 of idx) is out of range for 8 rows"),
    ([3, 12], "index 12 (position 1 of idx) is out of range for 8 rows"),
    (torch.ones(7, dtype=torch.bool), "a bool mask must have shape (8,), got (7,)"),
    (torch.tensor([[0, 1]]), "idx must be a (k,) integer or (8,) bool tensor"),
    (torch.tensor([0.0]), "idx must be a (k,) integer or (8,) bool tensor"),
])
def test_bad_index_is_named(bad, msg):
    with pytest.raises(ValueError, match=f"^TokenBatch.rows: {msg}".replace("(", r"\(")
                       .replace(")", r"\)")):
        _batch().rows(bad)
    with pytest.raises(ValueError, match=f"^Rollout.rows: {msg}".replace("(", r"\(")
                       .replace(")", r"\)")):
        _rollout().rows(bad)


def test_repeated_index_with_row_references():
    with pytest.raises(ValueError, match="TokenBatch.repair_of: row 4 is selected twice"):
        _batch().rows(torch.tensor([0, 4, 4]))
    with pytest.raises(ValueError, match="Rollout.parent: row 1 is selected twice"):
        _rollout().rows(torch.tensor([1, 0, 1]))
    got = _batch().replace(repair_of=None).rows(torch.tensor([2, 2]))  # nothing to renumber
    assert torch.equal(got.tokens, _batch().tokens[[2, 2]])


def test_figure2_group_subset_keeps_every_row_field():
    """figure2's ρ and attribution of the drawn group are those of the group's own batch, with
    ref_logps and repair_of (a KL term and a repair layout) carried along."""
    from analyses.figures import figure2
    from gradlab import objectives
    from gradlab.core.cancellation import attribution, cancellation
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask

    model, tok = load_policy()
    task = ArithmeticTask()
    ro = generate(model, tok, task.problems(3, seed=0), 4, task.max_new_tokens, 1.0,
                  generator=torch.Generator().manual_seed(0), task=task)
    rows = torch.tensor([8, 9, 10, 11, 4, 5, 6, 7])  # groups 2 and 1
    adv = advantages(ro.rewards, ro.group)
    g = torch.Generator().manual_seed(3)
    lp = ro.old_logps[rows] + 0.05 * torch.randn(len(rows), ro.response_ids.shape[1], generator=g)
    batch = ro.token_batch(lp, adv, rows).replace(
        ref_logps=ro.old_logps[rows] - 0.1, repair_of=torch.tensor([-1, 0, -1, -1, -1, -1, 4, -1]))
    panels = [("grpo", "grpo", {"norm": "const", "beta": 0.1}), ("ibpo", "ibpo", {})]
    Ws = {t: torch.randn(lp.shape, generator=g) for t, _, _ in panels}
    df = figure2.token_frame(tok, ro, rows, batch, Ws=Ws, clips={t: 0.0 for t, _, _ in panels}, g=2,
                             panels=panels)
    keep = [0, 1, 2, 3]
    own = TokenBatch(*(batch_field[keep] for batch_field in (
        batch.tokens, batch.mask, batch.logps, batch.old_logps, batch.advantages, batch.group)),
        ref_logps=batch.ref_logps[keep], rewards=batch.rewards[keep],
        repair_of=torch.tensor([-1, 0, -1, -1]))
    for t, n, p in panels:
        want = cancellation(Ws[t][keep], own, "prefix").ratio
        assert df.attrs["rho"][t] == want or (want != want and df.attrs["rho"][t] != df.attrs["rho"][t])
        assert df.attrs["attribution"][t] == attribution(objectives.get(n, **p), own)
