"""Gradient-noise statistics (gradlab.probes.variance) against brute force, the recipe
(gradlab.loop.recipes.variance) end to end on the shipped policy, the figure, the CLI and the analysis."""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from gradlab.cli.main import main
from gradlab.core import objectives
from gradlab.core.batch import advantages
from gradlab.loop.config import ConfigError
from gradlab.loop.numerics.logprobs import token_logps
from gradlab.loop.recipes.variance import COLUMNS, draw, measure_variance
from gradlab.loop.runs.store import RunStore
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import get_task
from gradlab.probes import variance as V
from gradlab.viz.variance import summary_table, variance_figure

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(K=2, reference_batches=2, prompts=2, G=4, progress=False, n_boot=200)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _grads(K=7, P=40, seed=0):
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=P)
    return mu + 1.5 * rng.normal(size=(K, P)), mu + 1.5 * rng.normal(size=(50, P)).mean(0)


def test_statistics_match_brute_force():
    g, ref = _grads()
    K = len(g)
    G, d = V.gram(g), g @ ref
    mean = g.mean(0)
    tc = np.trace(np.cov(g.T, ddof=1))
    assert V.trace_cov(G)[0] == pytest.approx(tc, rel=1e-12)
    assert V.signal(d)[0] == pytest.approx(mean @ ref, rel=1e-12)
    assert V.gradient_noise(G, d)[0] == pytest.approx(tc / (mean @ ref), rel=1e-12)
    cos = [gk @ ref / np.linalg.norm(gk) / np.linalg.norm(ref) for gk in g]
    np.testing.assert_allclose(V.cosines(d, G, ref @ ref), cos, rtol=1e-12)
    # every bootstrap resample equals the statistic of the materialised resample
    w = V.resample_counts(K, 5, seed=3)
    assert (w.sum(1) == K).all()
    idx = [np.repeat(np.arange(K), c.astype(int)) for c in w]
    brute = [np.trace(np.cov(g[i].T, ddof=1)) / (g[i].mean(0) @ ref) for i in idx]
    np.testing.assert_allclose(V.gradient_noise(G, d, w), brute, rtol=1e-10)


def test_reference_noise_and_interval():
    g, _ = _grads(K=30, P=12, seed=1)
    tc, sig = V.reference_noise(g.sum(0), float((g ** 2).sum()), len(g))
    assert tc == pytest.approx(np.trace(np.cov(g.T, ddof=1)), rel=1e-10)
    m = g.mean(0)
    assert sig == pytest.approx(m @ m - tc / len(g), rel=1e-10)
    assert V.interval(np.arange(101.0)) == (2.0, 98.0)  # 2.5 % / 97.5 %: lower and higher
    with pytest.raises(ValueError, match="K ≥ 2"):
        V.resample_counts(1, 10)
    with pytest.raises(ValueError, match=r"\(K, P\)"):
        V.gram(np.zeros(3))


def test_noise_is_inf_when_the_signal_is_not_positive():
    g = np.array([[1.0, 0.0], [-1.0, 0.0]])
    assert V.gradient_noise(V.gram(g), g @ np.array([1.0, 0.0]))[0] == np.inf


@pytest.fixture(scope="module")
def tiny():
    names = ["grpo", "ibpo[form=ga]", "ibpo[form=la]", "ibpo[form=togo]"]
    torch.set_num_threads(1)
    return names, measure_variance(names, **TINY)


def test_recipe_tidy_finite_deterministic(tiny):
    names, df = tiny
    assert tuple(df.columns) == COLUMNS
    assert list(dict.fromkeys(df["objective"])) == names
    per = df[df["batch"].notna()]
    assert set(per["batch"]) == {0, 1}
    assert set(per["metric"]) == {"grad_norm", "adv_nonzero_frac", "reward_comparison_corr",
                                  "reward", "cos_ref", "generated_tokens"}
    s = summary_table(df).set_index("objective")
    for m in ("grad_noise", "cos_ref_mean", "grad_norm_mean", "trace_cov", "signal",
              "adv_nonzero_frac_mean"):
        assert np.isfinite(s[m]).all(), m
    assert s["grad_noise_ref"].notna().all()  # R = 2: may be inf (debiased signal ≤ 0)
    # K = 2: a resample of one batch twice has no spread (0) or a non-positive signal (inf)
    pt = s["grad_noise"]
    assert ((s["grad_noise_lo"] <= pt * (1 + 1e-9)) & (pt <= s["grad_noise_hi"] * (1 + 1e-9))).all()
    assert (s["K"] == 2).all() and (s["reference_batches"] == 2).all()
    assert np.isnan(s.loc["grpo", "reward_comparison_corr_mean"])  # no comparison term
    assert (s.loc[names[1:], "reward_comparison_corr_mean"] < 0).all()  # the comparison term
    # on-policy, token-mean normalisation: ga redistributes credit among members of one trie
    # node, which share ∇l, so its gradient is GRPO's; la and togo likewise coincide
    assert s.loc["grpo", "max_rel_diff_vs:ibpo[form=ga]"] < 1e-5
    assert s.loc["ibpo[form=la]", "max_rel_diff_vs:ibpo[form=togo]"] < 1e-5
    assert s.loc["grpo", "max_rel_diff_vs:ibpo[form=la]"] > 1e-2
    assert s.loc["ibpo[form=ga]", "noise_ratio_vs_grpo"] == pytest.approx(1, abs=1e-4)
    again = measure_variance(names, **TINY)
    pd.testing.assert_frame_equal(df, again)


def test_recipe_batch_zero_by_hand(tiny):
    """Batch 0's GRPO gradient norm and A≠0 share, recomputed from a fresh draw."""
    _, df = tiny
    task = get_task("arithmetic")
    model, tok = load_policy(None, task=task)
    model.train()
    from gradlab.loop.setup.heldout import TrainSplit

    ro = draw("independent", model, tok, task, TrainSplit(task).problems(2, seed=0), G=4, b=0,
              seed=0, max_new_tokens=task.max_new_tokens, temperature=1.0)
    lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    adv = advantages(ro.rewards, ro.group)
    N = len(ro.texts)
    b = ro.token_batch(lp, adv, torch.arange(N), norms=(N, int(ro.response_mask.sum()), lp.shape[1]),
                       validate=False)
    objectives.get("grpo").loss(b).backward()
    norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    row = df[(df["objective"] == "grpo") & (df["batch"] == 0)].set_index("metric")["value"]
    assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    share = float(((adv != 0)[:, None] & ro.response_mask).sum() / ro.response_mask.sum())
    assert row["adv_nonzero_frac"] == pytest.approx(share)
    assert row["reward"] == pytest.approx(float(ro.rewards.mean()))


def test_recipe_reads_a_run_checkpoint(tmp_path, tiny):
    model, _ = load_policy(None, task=get_task("arithmetic"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    store = RunStore(tmp_path / "run", {"task": "arithmetic", "model": None})
    store.save_checkpoint("grpo", model, torch.optim.AdamW(model.parameters()), {"step": 1,
                          "tokens": 1}, {})
    store.close()
    ck = tmp_path / "run" / "checkpoints" / "grpo"
    df = measure_variance(["grpo"], checkpoint=ck, **TINY)
    base = tiny[1]
    pick = lambda d: d[(d["objective"] == "grpo") & (d["metric"] == "grad_norm")]["value"].to_numpy()  # noqa: E731
    assert not np.allclose(pick(df), pick(base))
    with pytest.raises(ConfigError, match="trained on task 'arithmetic'"):
        measure_variance(["grpo"], task="scaffold", checkpoint=ck, **TINY)
    with pytest.raises(FileNotFoundError, match="--checkpoint"):
        measure_variance(["grpo"], checkpoint=tmp_path, **TINY)


def test_bad_options():
    with pytest.raises(ConfigError, match="unknown objective 'nope'"):
        measure_variance(["nope"], **TINY)
    with pytest.raises(ConfigError, match="--rollout: unknown 'forest'"):
        measure_variance(["grpo"], rollout="forest", **TINY)


def test_figure(tiny):
    fig = variance_figure(tiny[1], "t")
    assert len(fig.axes) == 2
    assert fig.axes[0].get_xscale() == "log"
    with pytest.raises(ValueError, match="missing column"):
        variance_figure(tiny[1].drop(columns="batch"))


def test_cli_writes_its_files(tmp_path, capsys):
    out = tmp_path / "v"
    rc = main(["variance", "--objectives", "grpo,ibpo[form=ga+la]", "--K", "2",
               "--reference-batches", "2", "--prompts", "2", "--G", "2", "--out", str(out)])
    assert rc == 0
    df = pd.read_csv(out / "variance.csv")
    assert tuple(df.columns) == COLUMNS
    assert set(df["objective"]) == {"grpo", "ibpo[form=ga+la]"}
    assert (out / "variance.png").stat().st_size > 10_000
    assert main(["variance", "--objectives", "grpo,bad", "--out", str(out)]) == 2
    assert "unknown objective 'bad'" in capsys.readouterr().err


def test_analysis_quick(tmp_path):
    sys.path.insert(0, str(ROOT))
    from analyses.figures import variance

    out = tmp_path / "variance.png"
    assert variance.main(["--quick", "--out", str(out)]) == 0
    df = pd.read_csv(out.with_suffix(".csv"))
    assert set(df["task"]) == {"arithmetic", "scaffold"}
    md = out.with_suffix(".md").read_text()
    assert "K = 2 batches" in md and "| scaffold | ibpo[form=ga] |" in md
    assert "grpo = ibpo[form=ga]" in md  # measured: the two gradients coincide


@pytest.mark.parametrize("rollout", ["tree", "repair"])
def test_variance_on_counterfactual_layouts(rollout):
    from gradlab.loop.recipes.variance import measure_variance

    df = measure_variance(["grpo", "ibpo[form=ga+la]"], task="arithmetic", K=2,
                          reference_batches=2, prompts=2, G=4, rollout=rollout, progress=False)
    assert set(df["rollout"]) == {rollout}
    gen = df[df["metric"] == "generated_tokens"]["value"]
    assert len(gen) and (gen > 0).all()
    noise = df[df["batch"].isna() & (df["metric"] == "grad_noise")]["value"]
    assert len(noise) == 2 and noise.notna().all()
