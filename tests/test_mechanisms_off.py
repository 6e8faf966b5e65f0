"""W with one mechanism switched off (`modulation(batch, off=...)`), against closed forms written
from the definitions (docs/concepts/modulation.md, docs/concepts/dfpo.md, docs/concepts/ibpo.md).

Switching a mechanism off replaces that one term of W and nothing else: "coupling" sets the
magnitude s_i to 1, "clip" sets the indicators to 1, "length" sets T_i to the mean length; the
clip indicator is always decided by the real sequence ratio s_i."""

import math

import pytest
import torch

import gradlab
from gradlab import objectives

EPS = (0.1, 0.1)
LENGTHS = (6, 4, 5, 3)
S = (1.3, 0.7, 0.95, 1.05)  # row 0 above 1 + eps, row 1 below 1 − eps, rows 2, 3 inside
A_SEQ = (1.0, -1.0, 0.5, -0.5)  # row 0 (A > 0, s > 1 + eps) and row 1 (A < 0, s < 1 − eps) clip
ACTIVE_SEQ = (False, False, True, True)
SHARED = 2  # the first two response tokens are the whole group's prefix
B, T = len(LENGTHS), max(LENGTHS)


def _batch(adv_tokens: bool, s=S, lengths=LENGTHS, a_seq=A_SEQ) -> gradlab.TokenBatch:
    """One group of four: a shared 2-token prefix, then distinct tokens; per-token log-ratios
    that vary along the row and average to log s_i over its T_i tokens."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    tokens = torch.zeros(B, T, dtype=torch.long)
    delta = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        tokens[i, :SHARED] = torch.tensor([7, 8])
        tokens[i, SHARED:n] = 10 + 10 * i + torch.arange(n - SHARED)
        wiggle = 0.03 * torch.tensor([(-1.0) ** t * (t + 1) for t in range(n)], dtype=torch.float64)
        delta[i, :n] = math.log(s[i]) + wiggle - wiggle.mean()
    old = torch.full((B, T), -1.0, dtype=torch.float64) * mask
    if adv_tokens:  # both signs in every row, so both sides of the clip fire somewhere
        adv = torch.tensor([[(-1.0) ** t * (0.2 + 0.1 * t) for t in range(T)]] * B,
                           dtype=torch.float64) * mask
    else:
        adv = torch.tensor(a_seq, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    return gradlab.TokenBatch(tokens, mask, old + delta, old, adv, torch.zeros(B, dtype=torch.long),
                              rewards=rewards)


def _by_hand(adv_tokens: bool, off: tuple, level: str, a_tok=None) -> torch.Tensor:
    """W (B, T) from the closed forms: GSPO W_{i,t} = (1/B)(s_i/T_i) A_i 1[active_i];
    token advantages: GSPO spreads (1/B)(s_i/T_i²) Σ_t A_{i,t} 1[active_{i,t}] over the row,
    GSPO-token keeps A_{i,t} (1/B)(s_i/T_i) 1[active_{i,t}]. active from the real s_i."""
    lo, hi = EPS
    T_bar = sum(LENGTHS) / B
    W = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        s = 1.0 if "coupling" in off else S[i]
        Ti = T_bar if "length" in off else n
        if not adv_tokens:
            act = 1.0 if "clip" in off else float(ACTIVE_SEQ[i])
            W[i, :n] = s / (B * Ti) * A_SEQ[i] * act
            continue
        terms = []
        for t in range(n):
            a = float(a_tok[i, t])
            clipped = (a > 0 and S[i] > 1 + hi) or (a < 0 and S[i] < 1 - lo)
            terms.append(a * (1.0 if "clip" in off or not clipped else 0.0))
        if level == "sequence":
            W[i, :n] = s / (B * Ti * Ti) * sum(terms)
        else:
            W[i, :n] = torch.tensor(terms, dtype=torch.float64) * s / (B * Ti)
    return W


OFFS = [(), ("coupling",), ("clip",), ("length",)]


def test_the_batch_clips_on_both_sides():
    b = _batch(False)
    s = torch.exp(((b.logps - b.old_logps) * b.mask).sum(-1) / b.mask.sum(-1))
    assert torch.allclose(s, torch.tensor(S, dtype=torch.float64), atol=1e-12)
    assert s[0] > 1 + EPS[1] and b.advantages[0] > 0 and s[1] < 1 - EPS[0] and b.advantages[1] < 0


@pytest.mark.parametrize("off", OFFS, ids=lambda o: "+".join(o) or "none")
@pytest.mark.parametrize("adv_tokens", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize("name,level", [("gspo", "sequence"), ("gspo-token", "token")])
def test_gspo_mechanism_off_matches_closed_form(name, level, adv_tokens, off):
    b = _batch(adv_tokens)
    W = objectives.get(name, eps=EPS).modulation(b, off=off)
    expect = _by_hand(adv_tokens, off, level, b.advantages)
    assert torch.allclose(W, expect, rtol=0, atol=1e-15), (W, expect)


@pytest.mark.parametrize("off", [("coupling",), ("length",)], ids=lambda o: o[0])
def test_dfpo_min_mechanism_off_keeps_the_clip(off):
    """Min-Replace over GSPO: at the shared prefix w̃ = min_j w_j = 0 (rows 0 and 1 are clipped
    by their real s_j), elsewhere w̃ = w; switching the coupling or the length off keeps that."""
    b = _batch(False)
    W = objectives.get("dfpo-min", eps=EPS).modulation(b, off=off)
    expect = _by_hand(False, off, "sequence")
    expect[:, :SHARED] = 0.0
    assert torch.allclose(W, expect, rtol=0, atol=1e-15), (W, expect)


def test_ibpo_coupling_off_keeps_the_clip():
    """IBPO over GSPO-token: W = A_{i,t} (1/B)(1/T_i) 1[active_{i,t}] with coupling off, A_{i,t}
    IBPO's token advantages and the indicator read from the real s_i."""
    b = _batch(False)
    obj = objectives.get("ibpo", base="gspo", eps=EPS)
    a_tok = obj.prepare(b).advantages
    lo, hi = EPS
    clipped = ((a_tok > 0) & (torch.tensor(S) > 1 + hi).unsqueeze(-1)) | (
        (a_tok < 0) & (torch.tensor(S) < 1 - lo).unsqueeze(-1))
    assert (clipped & b.mask).any()
    lengths = torch.tensor(LENGTHS, dtype=torch.float64).unsqueeze(-1)
    expect = a_tok * (~clipped) * b.mask / (B * lengths)
    W = obj.modulation(b, off=("coupling",))
    assert torch.allclose(W, expect, rtol=0, atol=1e-15)


def test_attribution_gives_the_clip_share_to_the_clip():
    """Equal lengths and one s for every row: the residual at the shared prefix comes from the
    clip dropping the A > 0 rows. With s→1 it shrinks by the factor 1/s (coupling share 1 − 1/s),
    with the indicators → 1 it vanishes (clip share 1)."""
    s = 1.3
    b = _batch(False, s=(s,) * B, lengths=(5,) * B, a_seq=(1.0, -1.0, 0.5, -0.5))
    att = gradlab.attribution(objectives.get("gspo", eps=EPS), b)
    # residual: the two prefix positions, each Σ over the active (A < 0) rows of s A_i / (B T)
    assert att["residual"] == pytest.approx(SHARED * s * 1.5 / (B * 5), rel=1e-12)
    assert att["coupling"] == pytest.approx(1 - 1 / s, rel=1e-12)
    assert att["clip"] == pytest.approx(1.0, rel=1e-12)
    assert att["length"] == pytest.approx(0.0, abs=1e-12)
