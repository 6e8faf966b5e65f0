"""The token-flip ledger (gradlab.probes.flips), its loop option and polarity-balanced steps."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradlab import objectives
from gradlab.core.batch import advantages
from gradlab.core.nodes import shared_nodes
from gradlab.probes import flips as F

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stepped():
    """A real batch of the shipped tiny policy, before and after one AdamW step of GRPO on it:
    (batch with the step's advantages, log π before (B, T), log π after (B, T))."""
    from gradlab.loop.numerics.logprobs import token_logps
    from gradlab.loop.rollouts.rollout import generate
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask

    torch.manual_seed(0)
    model, tok = load_policy()
    ro = generate(model, tok, ArithmeticTask().problems(4, seed=3), G=4, max_new_tokens=12,
                  row_keys=torch.arange(16))
    args = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0])  # one tied group
    adv = advantages(rewards, ro.group)
    lp = token_logps(model, *args)
    batch = ro.token_batch(lp, adv, old_logps=lp.detach())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    objectives.get("grpo").loss(batch).backward()
    opt.step()
    with torch.no_grad():
        after = token_logps(model, *args)
    return batch.replace(logps=lp.detach()), lp.detach(), after


def _history(batch, j: int, t: int) -> list:
    """Row j's (token, mask) pairs at positions 0..t."""
    return [(int(batch.tokens[j, s]), bool(batch.mask[j, s])) for s in range(t + 1)]


def _brute(before, after, batch, bins=F.CONF_BINS) -> dict:
    """Independent ledger: a Python loop over every token, node kinds from pairwise prefixes."""
    B, T = batch.tokens.shape
    out = {}
    labels = F.conf_labels(bins)
    for i in range(B):
        same = [j for j in range(B) if int(batch.group[j]) == int(batch.group[i])]
        for t in range(T):
            if not batch.mask[i, t]:
                continue
            mine = _history(batch, i, t)
            sharers = [j for j in same if batch.mask[j, t] and _history(batch, j, t) == mine]
            kind = "own" if len(sharers) < 2 else "group" if len(sharers) == len(same) else "subset"
            a = float(batch.advantages[i])
            sign = "pos" if a > 0 else "neg" if a < 0 else "zero"
            p = math.exp(float(before[i, t]))
            conf = next(lab for lab, hi in zip(labels, bins[1:]) if p < hi or hi == 1.0)
            d = float(after[i, t]) - float(before[i, t])
            c = out.setdefault((sign, kind, conf), [0, 0.0, 0, 0, 0])
            c[0] += 1
            c[1] += d
            c[2] += d > 0
            c[3] += d < 0
            c[4] += (a > 0 and d < 0) or (a < 0 and d > 0)
    return out


def test_ledger_equals_a_per_token_loop_on_a_real_step(stepped):
    batch, before, after = stepped
    led = F.flip_ledger(before, after, batch)
    ref = _brute(before, after, batch)
    kinds = {k[1] for k in ref}
    assert {"group", "own"} <= kinds and {"pos", "neg", "zero"} <= {k[0] for k in ref}
    for (sign, kind, conf), c in ref.items():
        for f, v in zip(F.FIELDS, c):
            got = led[F.key(sign, kind, conf, f)]
            assert float(got) == pytest.approx(v, abs=1e-9), (sign, kind, conf, f)
    empty = [k for k in led if k.endswith("/count") and tuple(k.split("/")[1:4]) not in ref]
    assert empty and all(int(led[k]) == 0 for k in empty)


def test_cells_add_up_to_the_token_count(stepped):
    batch, before, after = stepped
    led = F.flip_ledger(before, after, batch, conf_bins=(0.0, 0.3, 1.0))
    assert sum(int(v) for k, v in led.items() if k.endswith("/count")) == int(batch.mask.sum())
    assert len([k for k in led if k.endswith("/count")]) == 3 * 3 * 2


def test_an_injected_sign_error_is_caught(stepped):
    batch, before, after = stepped
    ref = _brute(before, after, batch)
    wrong = F.flip_ledger(after, before, batch)  # Δ with its sign flipped (and π read after)
    diff = [abs(float(wrong[F.key(*c, "flipped")]) - v[4]) for c, v in ref.items()]
    assert max(diff) >= 1


def test_an_unchanged_policy_moves_no_token(stepped):
    batch, before, _ = stepped
    s = F.flip_shares({k: float(v) for k, v in F.flip_ledger(before, before, batch).items()})
    assert s["flips/signed/all/all/boosted_share"] == 0 == s["flips/signed/all/all/flipped_share"]


def test_empty_cells_give_nan_shares_not_zero(stepped):
    batch, before, after = stepped
    sums = {k: float(v) for k, v in F.flip_ledger(before, after, batch).items()}
    s = F.flip_shares(sums)
    empty = [k[:-len("/count")] for k, v in sums.items() if k.endswith("/count") and v == 0]
    assert empty
    for cell in empty:
        for f in ("boosted_share", "suppressed_share", "flipped_share", "dlogp_mean"):
            assert math.isnan(s[f"{cell}/{f}"]), cell
    assert math.isnan(s["flips/zero/all/all/flipped_share"])  # A = 0: no sign to oppose
    assert s["flips/zero/all/all/count"] > 0
    n = s["flips/signed/all/all/count"]
    assert s["flips/signed/all/all/flipped"] / n == s["flips/signed/all/all/flipped_share"]


def test_bad_input_is_named(stepped):
    batch, before, after = stepped
    with pytest.raises(ValueError, match="after must be"):
        F.flip_ledger(before, after[:, :-1], batch)
    with pytest.raises(ValueError, match="conf_bins"):
        F.flip_ledger(before, after, batch, conf_bins=(0.0, 0.9, 0.5, 1.0))
    with pytest.raises(ValueError, match="trie nodes"):
        F.flip_ledger(before, after, batch, nodes=shared_nodes(batch, "prefix"))


@pytest.mark.parametrize("split", [False, True])
def test_polarity_balance_keeps_every_row_once_and_balances_signs(split):
    from gradlab.loop.update.batches import minibatches

    gen = torch.Generator().manual_seed(1)
    group = torch.arange(8).repeat_interleave(4)
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0,
                            1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float)
    adv = advantages(rewards, group)
    parts = minibatches(group, 4, gen, split, 8, polarity=adv)
    rows = torch.cat(parts)
    assert sorted(rows.tolist()) == list(range(32))  # every row exactly once
    pos = [int((adv[p] > 0).sum()) for p in parts]
    neg = [int((adv[p] < 0).sum()) for p in parts]
    if split:
        assert max(pos) - min(pos) <= 1 and max(neg) - min(neg) <= 1
    else:
        for p in parts:  # groups stay whole
            assert all(int((group[p] == g).sum()) in (0, 4) for g in range(8))
        plain = minibatches(group, 4, torch.Generator().manual_seed(1), False, 8)
        imb = lambda ps: max(abs(int((adv[p] > 0).sum()) - int((adv[p] < 0).sum())) for p in ps)  # noqa: E731
        assert imb(parts) <= imb(plain) and imb(parts) <= 2
        assert [len(p) for p in parts] == [len(p) for p in plain]


SMALL = dict(steps=2, prompts=2, G=4, minibatches=2, tax_every=1, probe_contexts=2,
             ckpt_every=100, progress=False, eval_every=0, objectives=["grpo", "ibpo"])


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in (Path(path) / "metrics.jsonl").read_text().splitlines()]


def test_loop_option_off_changes_nothing_and_on_adds_the_ledger(tmp_path):
    from gradlab.loop.config import RunConfig
    from gradlab.loop.train import train

    train(RunConfig(out=str(tmp_path / "off"), **SMALL))
    train(RunConfig(out=str(tmp_path / "on"), instruments="full", **SMALL))
    train(RunConfig(out=str(tmp_path / "nodrift"), instruments="cheap,attribution,tax,flips",
                    **SMALL))
    off, on, nodrift = _rows(tmp_path / "off"), _rows(tmp_path / "on"), _rows(tmp_path / "nodrift")
    for a, b in zip(off, on):
        why_a, why_b = a.pop("undefined", {}), b.pop("undefined", {})  # reasons of the nulls
        assert {k: w for k, w in why_b.items() if not k.startswith(F.PREFIX)} == why_a
        assert not any(k.startswith(F.PREFIX) for k in a)
        assert {k: v for k, v in b.items() if not k.startswith(F.PREFIX)}.keys() == a.keys()
        for k in a:
            if not k.startswith("time_"):
                assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), k  # NaN == NaN
        assert b["flips/signed/all/all/count"] > 0
        assert b["flips/pos/all/all/count"] + b["flips/neg/all/all/count"] + \
            b["flips/zero/all/all/count"] == b["n_tokens"]
    for b, c in zip(on, nodrift):  # the ledger's own forward equals the drift's "after"
        assert {k: v for k, v in b.items() if k.startswith(F.PREFIX)} == \
            {k: v for k, v in c.items() if k.startswith(F.PREFIX)}


def test_study_quick_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "analyses.figures.token_flips", "--quick",
                        "--runs", str(tmp_path / "runs"), "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((tmp_path / "token_flips.json").read_text())
    assert meta["provenance"]["command"].startswith("python -m analyses.figures.token_flips")
    assert len(meta["runs"]) == 3
    assert "## arithmetic" in (tmp_path / "token_flips.md").read_text()
    assert (tmp_path / "token_flips.png").stat().st_size > 0

