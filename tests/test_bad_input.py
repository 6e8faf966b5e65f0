"""Bad input gets a clear error naming the thing at fault, or a documented defined result."""

import pytest
import torch

import gradlab
from gradlab import objectives
from gradlab.core.cancellation import cancellation
from gradlab.testing import measure_modulation, random_batch

ALL = ["grpo", "grpo-fix", "gspo", "gspo-token", "dfpo-min", "dfpo-orth", "dfpo-scale"]


def test_group_of_one_and_equal_rewards_give_zero_w_without_nan():
    b = random_batch(n_groups=2, G=3, T=6, seed=0, rewards=torch.ones(6))
    assert (b.advantages == 0).all()
    for name in ALL:
        W = objectives.get(name).modulation(b)
        assert torch.isfinite(W).all() and (W == 0).all(), name
        assert cancellation(W, b).ratio == 0.0
    A = gradlab.advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 1]))
    assert A[0] == 0  # a group of one


def test_orth_with_nearly_equal_advantages_is_finite():
    """Equal rewards across a subset give exactly equal A: the projection must be skipped."""
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    b = random_batch(n_groups=1, G=7, T=8, seed=1, rewards=r, vocab=2)
    obj = objectives.get("dfpo", transform="orth", nodes="trie")
    W = obj.modulation(b)
    assert torch.isfinite(W).all() and W.abs().max() < 1.0


def test_empty_responses_and_all_padded_rows():
    b = random_batch(n_groups=2, G=3, T=6, seed=2)
    mask = b.mask.clone()
    mask[0] = False  # an all-padded (empty) row
    b = b.replace(mask=mask)
    for name in ALL:
        obj = objectives.get(name)
        W = obj.modulation(b)
        assert torch.isfinite(W).all() and (W[0] == 0).all()
        assert torch.isfinite(obj.loss(b))
        assert torch.allclose(W, measure_modulation(obj.loss, b), atol=1e-12)
    empty = b.replace(mask=torch.zeros_like(b.mask))
    assert cancellation(objectives.get("gspo").modulation(empty), empty).ratio == 0.0


@pytest.mark.parametrize("field", ["logps", "old_logps"])
def test_nan_logps_name_the_field_and_row(field):
    b = random_batch(seed=0)
    bad = getattr(b, field).clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"{field} is not finite at row 2, position 0"):
        b.replace(**{field: bad})
    # NaN at a padded position is ignored (padding is not part of the loss)
    pad = (~b.mask).nonzero()[0]
    ok = getattr(b, field).clone()
    ok[pad[0], pad[1]] = float("nan")
    b.replace(**{field: ok})


def test_nan_or_inf_reward_names_row_and_group():
    with pytest.raises(ValueError, match=r"row 2 \(group 1\) is inf"):
        gradlab.advantages(torch.tensor([1.0, 0.0, float("inf")]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="row 0"):
        gradlab.advantages(torch.tensor([float("nan")]), torch.tensor([0]))
    with pytest.raises(ValueError, match="scale"):
        gradlab.advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), scale="bogus")


def test_mismatched_shapes_and_dtypes_name_the_field():
    b = random_batch(seed=0)
    with pytest.raises(ValueError, match=r"TokenBatch.old_logps has shape"):
        b.replace(old_logps=b.old_logps[:, :-1])
    with pytest.raises(ValueError, match=r"TokenBatch.advantages has shape"):
        b.replace(advantages=b.advantages[:-1])
    with pytest.raises(ValueError, match="TokenBatch.mask must be bool"):
        b.replace(mask=b.mask.long())
    with pytest.raises(ValueError, match="TokenBatch.tokens must be"):
        b.replace(tokens=b.tokens[0])
    with pytest.raises(ValueError, match="TokenBatch.logps must be floating"):
        b.replace(logps=b.tokens)
    with pytest.raises(ValueError, match="W has shape"):
        cancellation(torch.zeros(2, 2), b)


def test_unknown_objective_and_parameters_list_valid_ones():
    with pytest.raises(ValueError, match="valid: grpo, grpo-fix, gspo"):
        objectives.get("ppo")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['clip'\]; valid: \['eps', 'norm'"):
        objectives.get("grpo", clip=0.2)
    with pytest.raises(ValueError, match="norm='mean'"):
        objectives.get("grpo", norm="mean")
    with pytest.raises(ValueError, match="transform='max'"):
        objectives.get("dfpo", transform="max")
    with pytest.raises(ValueError, match="stop_grad=False"):
        objectives.get("dfpo", base="grpo", stop_grad=False)
    with pytest.raises(ValueError, match="ref_logps"):
        objectives.get("grpo", beta=0.1).loss(random_batch(seed=0))
    with pytest.raises(ValueError, match="mechanism"):
        objectives.get("grpo").modulation(random_batch(seed=0), off=("lengths",))


def test_bf16_inputs_are_computed_in_float32():
    b = random_batch(seed=0, dtype=torch.float32)
    bb = b.replace(logps=b.logps.bfloat16(), old_logps=b.old_logps.bfloat16(),
                   advantages=b.advantages.bfloat16())
    for name in ALL:
        obj = objectives.get(name)
        W = obj.modulation(bb)
        assert W.dtype == torch.float32 and torch.isfinite(W).all()
        lp = bb.logps.clone().requires_grad_(True)
        obj.loss(bb.replace(logps=lp)).backward()
        assert lp.grad.dtype == torch.bfloat16
        assert torch.allclose(-lp.grad.float(), W, atol=2e-2 * float(W.abs().max()) + 1e-6)
