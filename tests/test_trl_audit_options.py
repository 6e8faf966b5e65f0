"""`gradlab audit trl --options`: TRL options that mask or reweight tokens, on real (tiny, CPU)
GRPOTrainer runs; the emulated vLLM importance-sampling correction checked against TRL's
documented rule, and that check shown to catch a correction applied with the wrong threshold."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from gradlab.integrations.audit import trl_options as opts
from gradlab.integrations.audit.trl import WORKLOADS, grpo_args, make_trainer, quiet, to_markdown
from gradlab.integrations.trl import GradlabConfig

LENGTHS = WORKLOADS["lengths"]


ON = {}  # option name -> on-policy row, filled by the parametrized test below


@pytest.mark.parametrize("opt", opts.OPTIONS, ids=lambda o: o.name)
def test_every_option_row_is_produced_and_finite(opt):
    """Each option, one on-policy generation batch: finite figures. top_entropy_quantile keeps
    only high-entropy tokens; where that leaves no gradient at any full-group node ρ there is
    undefined (NaN), never 0."""
    r = ON[opt.name] = opts.audit_option(opt, False, LENGTHS, gens=1)
    assert r["option"] == opt.name and r["policy"] == "on"
    for k in ("rho_trie", "split", "dropped"):
        assert math.isfinite(r[k]), (k, r[k])
    if opt.name.startswith("top_entropy"):
        assert r["dropped"] > 0.5  # 80 % of the tokens masked
        assert math.isfinite(r["rho"]) or math.isnan(r["rho_step"])
    else:
        assert math.isfinite(r["rho"]) and math.isfinite(r["rho_step"])


@pytest.mark.parametrize("name, breaks", [
    ("none (base)", False), ("vLLM IS token_truncate", False), ("scale_rewards=batch", False),
    ("scale_rewards=none", False), ("mask_truncated_completions", True),
    ("vLLM IS sequence_mask", True), ("vLLM IS token_truncate, per-row sampler error", True)])
def test_which_options_cancel_on_policy(name, breaks):
    """dapo at token level cancels on-policy; so do reward scaling and token-level IS with a
    batch-invariant sampler error. Dropping truncated completions, one IS weight per sequence,
    or a per-row sampler error breaks it."""
    r = ON.get(name) or opts.audit_option(
        next(o for o in opts.OPTIONS if o.name == name), False, LENGTHS, gens=1)
    assert (r["rho"] > 1e-3) if breaks else (r["rho"] < 1e-6), r["rho"]


def test_off_policy_options_split_and_mask():
    """Off-policy: the sequence mask drops negative-advantage sequences and breaks cancellation
    above the base; steps_per_generation=8 splits every group."""
    base = opts.audit_option(opts.OPTIONS[0], True, LENGTHS, gens=1)
    opm = next(o for o in opts.OPTIONS if o.name.startswith("off_policy_mask"))
    masked = opts.audit_option(opm, True, LENGTHS, gens=1)
    spg8 = next(o for o in opts.OPTIONS if o.name == "steps_per_generation=8")
    split = opts.audit_option(spg8, True, LENGTHS, gens=1)
    assert masked["rho"] > base["rho"] + 1e-3 and masked["dropped"] > base["dropped"]
    assert split["spg"] == 8 and split["split"] == 1.0 and split["rho_step"] > 0.1


def _is_run(tmp_path, mode: str, applied_max: float | None = None):
    args = grpo_args("dapo", "token", 1, 1, str(tmp_path), vllm_importance_sampling_correction=True,
                     vllm_importance_sampling_mode=mode)
    with quiet():
        tr = make_trainer(args, LENGTHS, GradlabConfig(store=None, keep_windows=True),
                          cls=opts.OptionAuditTrainer)
        tr.emulate("context")
        if applied_max is not None:  # injected bug: TRL's code gets another threshold
            tr.vllm_importance_sampling_clip_max = applied_max
        tr.train()
    return tr


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_is_correction_matches_trls_documented_rule(tmp_path, mode):
    tr = _is_run(tmp_path, mode)
    assert tr.sampling and tr.sampling[0].shape == tr.gradlab_windows[0].W.shape
    assert opts.check_is_correction(tr) < 1e-4


def test_is_check_catches_a_correction_with_the_wrong_threshold(tmp_path):
    tr = _is_run(tmp_path, "token_truncate", applied_max=1.2)
    with pytest.raises(AssertionError, match="deviates from A·r_IS/N"):
        opts.check_is_correction(tr)


def test_is_weights_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    s = torch.log(torch.tensor([[0.5, 2.0, 1.0]], dtype=torch.float64))  # r = 2, 0.5, 1
    m = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    r = opts.is_weights(old, s, m, "token_truncate", None, 1.5)
    assert torch.allclose(r, torch.tensor([[1.5, 0.5, 1.0]], dtype=torch.float64))
    r = opts.is_weights(old, s, m, "token_mask", 0.6, 3.0)
    assert torch.allclose(r, torch.tensor([[2.0, 0.0, 1.0]], dtype=torch.float64))
    r = opts.is_weights(old, s, m, "sequence_mask", None, 3.0)  # r_seq = 2 · 0.5 = 1
    assert torch.allclose(r, torch.ones(1, 3, dtype=torch.float64))


def test_options_table_and_verdicts():
    """The option table prints one row per option with a verdict; the loss rows are untouched."""
    def row(option, policy, rho, spg=4, rho_step=0.5):
        return {"workload": "lengths", "loss_type": "dapo", "level": "token", "dfpo": "",
                "option": option, "policy": policy, "spg": spg if policy == "off" else 1,
                "rho": rho, "rho_trie": rho, "rho_step": rho_step, "split": 1.0, "dropped": 0.0}
    loss = {"workload": "lengths", "loss_type": "dapo", "level": "token", "dfpo": "",
            "policy": "on", "rho": 0.0, "rho_trie": 0.0, "rho_step": 0.0, "split": 0.0,
            "split_attr": 0.0}
    df = pd.DataFrame([loss, {**loss, "policy": "off", "rho": 1e-3},
                       row("none (base)", "on", 0.0), row("none (base)", "off", 0.001),
                       row("x", "on", 0.2), row("x", "off", 0.1),
                       row("y", "on", 1e-8), row("y", "off", 0.05),
                       row("z", "on", 1e-8), row("z", "off", 0.0015, spg=8, rho_step=0.9)])
    md = to_markdown(df, "cmd")
    assert "| dapo | token | — | ≈0 | ≈0 | 0.00 |" in md  # the loss table as before
    assert "| x | 0.200 |" in md and "yes: ρ 0.200 on-policy" in md
    assert "off-policy: ρ 0.050 (base 0.001)" in md
    assert "by the split only: ρ per step 0.900 (base 0.500)" in md
