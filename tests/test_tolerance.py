"""The shared float32 tolerance (tests/tolerance.py): it passes two reduction orders of one sum,
and it fails on what a bug does — a wrong scale, a shifted position, a NaN on one side."""

import numpy as np
import pytest
import torch
from tolerance import EPS32, ULPS, assert_close_f32, f32_atol


def _orders(n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A (64, n) float32 matrix summed along its rows two ways: whole rows, and in 7 chunks."""
    x = torch.randn(64, n, generator=torch.Generator().manual_seed(seed)) * 12
    whole = x.sum(-1)
    chunked = torch.stack([c.sum(-1) for c in x.tensor_split(7, dim=-1)], -1).sum(-1)
    return whole, chunked


def test_two_reduction_orders_pass_but_differ():
    whole, chunked = _orders()
    assert not torch.equal(whole, chunked)  # round-off: the orders really differ
    assert_close_f32(chunked, whole)
    assert_close_f32(chunked.numpy(), whole.numpy())  # arrays too


@pytest.mark.parametrize("bug", ["scale", "shift", "one_entry", "nan"])
def test_what_a_bug_does_fails(bug):
    whole, _ = _orders()
    wrong = {"scale": whole * 1.001, "shift": whole.roll(1), "nan": whole.clone().fill_(float("nan")),
             "one_entry": whole.clone().index_add_(0, torch.tensor([3]),
                                                  torch.tensor([1e-3]) * whole.abs().max())}[bug]
    with pytest.raises(AssertionError, match="float32 ulps"):
        assert_close_f32(wrong, whole)


def test_tolerance_scales_with_the_largest_magnitude():
    e = torch.tensor([12.0, 1e-3, 0.0])
    assert f32_atol(e) == pytest.approx(ULPS * EPS32 * 12.0)
    assert f32_atol(e, scale=1.0) == pytest.approx(ULPS * EPS32)
    # an entry near 0 may be off by a few ulps of the largest entry, not of its own size
    assert_close_f32(e + torch.tensor([0.0, 50 * EPS32 * 12, 0.0]), e)


def test_nan_on_both_sides_agrees_shapes_must_match():
    a = torch.tensor([1.0, float("nan")])
    assert_close_f32(a, a.clone())
    with pytest.raises(AssertionError, match="shape"):
        assert_close_f32(a, a[:1])
    assert_close_f32(np.zeros(3), np.zeros(3))
