"""Tree and repair rollouts: KV reuse equals recomputation, old log-probs, determinism and
layout independence, alignment on constructed pairs, the accounting, and the loop (resume,
two ranks = one process)."""

import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from procs import run_tree
from tolerance import assert_close_f32

import gradlab
from gradlab.loop.numerics.logprobs import positions, token_logps
from gradlab.loop.rollouts.layouts import _trie_points, layout_sums
from gradlab.loop.rollouts.repair import (
    edited_span,
    first_departure,
    generate_repair,
    local_positions,
    repair_plan,
)
from gradlab.loop.rollouts.rollout import Rollout, batch_repair_of, generate, stop_ids
from gradlab.loop.rollouts.spec import Decoding, SamplingSpec
from gradlab.loop.rollouts.tree import decode, generate_tree, mix_keys, tree_shape
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask
from gradlab.loop.update.batches import micro_batches

G = 8
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def setup():
    model, tok = load_policy()
    task = ArithmeticTask()
    # mixed prompt lengths exercise left padding
    problems = task.problems(2, 5) + [ArithmeticTask(1).problems(1, 0)[0], task.make_problem(100, 7)]
    keys = torch.arange(len(problems) * G) + 10_000
    return model, tok, task, problems, keys


def _tree(setup, **kw):
    model, tok, task, problems, keys = setup
    spec = SamplingSpec(G, task.max_new_tokens, 1.0, layout="tree", **kw)
    return generate_tree(model, tok, problems, spec, keys, task=task)


def test_tree_shape_breadth_first():
    assert tree_shape(8, 2, 2) == [(0, -1, 0), (1, -1, 0), (2, 0, 0), (3, 0, 1), (4, 1, 0),
                                   (5, 1, 1), (6, 2, 0), (7, 2, 1)]
    assert [p for _, p, _ in tree_shape(5, 1, 1)] == [-1, 0, 1, 2, 3]  # a chain
    assert [p for _, p, _ in tree_shape(4, 4, 3)] == [-1] * 4  # roots only


def _recompute(model, tok, ro, c: int, p: int, t: int, key: torch.Tensor, T: int,
               alternative: bool) -> None:
    """Row c re-sampled from position t with its whole prefix fed from scratch (no cache) and
    noise key `key` draws the same tokens with the same log-probs; p: the row it leaves."""
    stops = stop_ids(model, tok)
    assert torch.equal(ro.response_ids[c, :t], ro.response_ids[p, :t])  # the shared prefix
    pm = ro.prompt_mask[c]
    feed = torch.cat([ro.prompt_ids[c, pm], ro.response_ids[c, :t]])[None]
    fm = torch.ones_like(feed, dtype=torch.bool)
    pre = torch.zeros(1, T, dtype=torch.long)
    pre[0, :t] = ro.response_ids[c, :t]
    ex = ro.response_ids[p, t].view(1) if alternative else None
    ref = decode(model, feed, fm, positions(fm), cache=None, live=fm[:, :0], cpos=feed[:, :0],
                 start=torch.tensor([t]), keys=key.view(1),
                 prefix=(pre, torch.zeros(1, T), torch.zeros(1, T)), exclude=ex,
                 dec=Decoding(T, 1.0, tuple(stops), len(tok)))
    L = int(ro.lengths[c])
    assert int(ref.lengths[0]) == L and torch.equal(ref.tokens[0, t:L], ro.response_ids[c, t:L])
    assert_close_f32(ref.logps[0, t:L], ro.old_logps[c, t:L], msg="KV-reused vs recomputed")
    if alternative:
        assert ro.response_ids[c, t] != ro.response_ids[p, t]  # a different decision
    assert int(ro.generated[c]) == L - t


def _check_children(model, tok, ro, keys, T, alternative):
    """Every branched row equals its recomputation from scratch (`_recompute`); old_logps
    equal token_logps' recomputation."""
    lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    assert_close_f32(lp.detach(), ro.old_logps, msg="sampler vs forward log-probs")
    for c in (ro.parent >= 0).nonzero().squeeze(-1).tolist():
        _recompute(model, tok, ro, c, int(ro.parent[c]), int(ro.branch_at[c]), keys[c], T,
                   alternative)


@pytest.mark.parametrize("branch_token", ["sample", "alternative"])
def test_kv_reuse_equals_recomputation(setup, branch_token):
    model, tok, task, problems, keys = setup
    ro = _tree(setup, branch_token=branch_token, branch_at="uniform")
    assert int((ro.parent >= 0).sum()) == len(problems) * (G - 2)
    _check_children(model, tok, ro, keys, task.max_new_tokens, branch_token == "alternative")


def test_kv_reuse_at_real_vocabulary_with_sdpa():
    """A 151,936-row Qwen3 with SDPA attention and a 99-id tokenizer (the padded ids hold ~all
    the mass of a random init): no padded id is sampled, and KV reuse equals recomputation."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gradlab.loop.setup.policy import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen3Config(vocab_size=151_936, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = Qwen3ForCausalLM(cfg).eval()
    probs = ArithmeticTask().problems(2, seed=0)
    keys = torch.arange(8)
    star = SamplingSpec(4, 6, 1.0, layout="tree", roots=1, branches=3, branch_token="alternative")
    ro = generate_tree(model, tok, probs, star, keys)
    assert int(ro.response_ids.max()) < len(tok)
    _check_children(model, tok, ro, keys, 6, True)


def test_tree_is_deterministic_layout_independent_and_roots_match_independent(setup):
    model, tok, task, problems, keys = setup
    a, b = _tree(setup), _tree(setup)
    assert a.texts == b.texts and torch.equal(a.old_logps, b.old_logps)
    # one group alone (a data-parallel rank's share) samples what it samples in the batch
    part = generate_tree(model, tok, problems[1:2], SamplingSpec(G, task.max_new_tokens, layout="tree"),
                         keys[G:2 * G], task=task)
    assert part.texts == a.texts[G:2 * G]
    assert _tree(setup, branch_at="uniform").texts != a.texts
    ind = generate(model, tok, problems, G, task.max_new_tokens, row_keys=keys)
    roots = (a.parent < 0).nonzero().squeeze(-1)
    assert [a.texts[i] for i in roots] == [ind.texts[i] for i in roots]  # same keys, same rows
    assert a.group.tolist() == [i // G for i in range(len(problems) * G)]


def test_first_departure_and_edited_span_on_constructed_pairs():
    a = torch.tensor([[5, 6, 7, 8, 1, -1], [5, 6, 7, 1, -1, -1], [4, 4, 4, 1, -1, -1]])
    b = torch.tensor([[5, 6, 9, 8, 1, -2], [5, 6, 7, 9, 9, 1], [4, 4, 4, 1, -2, -2]])
    assert first_departure(a, b).tolist() == [2, 3, 4]  # equal rows depart where they end
    assert first_departure(a[2:], a[2:]).tolist() == [6]
    la, lb = torch.tensor([5, 4, 4]), torch.tensor([5, 6, 4])
    # one substituted token; two tokens inserted before the shared EOS; identical rows
    assert edited_span(a, la, b, lb).tolist() == [1, 2, 0]
    # "so 34+57=81" repaired to "so 34+57=91": the common suffix "1<eos>" is not edited
    x = torch.tensor([list(b"so 34+57=81") + [1]])
    y = torch.tensor([list(b"so 34+57=91") + [1]])
    assert edited_span(x, torch.tensor([12]), y, torch.tensor([12])).tolist() == [1]


def test_repair_plan_picks_the_longest_agreeing_correct_reference():
    tok = torch.tensor([[1, 2, 3, 4], [1, 2, 9, 4], [1, 7, 3, 4], [1, 2, 3, 5], [8, 8, 8, 8],
                        [2, 2, 2, 2]])
    mask = torch.ones_like(tok, dtype=torch.bool)
    correct = torch.tensor([False, True, True, True, False, False])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    # row 0 agrees with row 3 for 3 tokens (row 1: 2, row 2: 1); group 1 has no correct row
    assert repair_plan(tok, mask, correct, group) == [(0, 3, 3)]
    tok[3] = torch.tensor([1, 2, 9, 5])  # a tie at 2 tokens between rows 1 and 3: the lower
    assert repair_plan(tok, mask, correct, group) == [(0, 1, 2)]


@pytest.mark.parametrize("mode", ["resample", "splice", "local"])
def test_repair_rollout(setup, mode):
    model, tok, task, problems, keys = setup
    spec = SamplingSpec(G, task.max_new_tokens, 1.0, layout="repair", repair=mode,
                        branch_token="alternative")
    ro = generate_repair(model, tok, problems, spec, keys, task)
    ind = generate(model, tok, problems, G, task.max_new_tokens, row_keys=keys, task=task)
    own = (ro.repair_of < 0).nonzero().squeeze(-1)
    W = ind.response_ids.shape[1]
    assert torch.equal(ro.response_ids[own, :W], ind.response_ids)  # the same sampled rows
    assert torch.equal(ro.old_logps[own, :W], ind.old_logps) and ro.G == G
    rep = (ro.repair_of >= 0).nonzero().squeeze(-1)
    assert rep.numel() > 0 and ro.repairs_tried >= rep.numel()
    lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    assert_close_f32(lp.detach(), ro.old_logps, msg="sampler vs forward log-probs")
    for r in rep.tolist():
        i, d = int(ro.repair_of[r]), int(ro.branch_at[r])
        assert ro.group[i] == ro.group[r] and ro.rewards[i] == 0 and ro.rewards[r] == 1
        assert torch.equal(ro.response_ids[r, :d], ro.response_ids[i, :d])
        assert ro.response_ids[r, d] != ro.response_ids[i, d]  # departs at d
        if mode == "splice":  # equals a correct sampled row of the group
            assert ro.texts[r] in [ro.texts[j] for j in own.tolist() if ro.group[j] == ro.group[r]]
            assert int(ro.generated[r]) == 0
        else:
            assert int(ro.generated[r]) == int(ro.lengths[r]) - d
    rows = torch.arange(ro.group.numel())
    assert torch.equal(ro.group, ro.group.sort().values)  # group-major: repairs follow their group
    assert (ro.repair_of[rep] < rows[rep]).all()


def test_local_positions_start_before_the_stop_and_not_before_the_departure():
    stops = [1]
    tokens = torch.tensor([[5, 6, 7, 8, 1, 0], [5, 6, 7, 8, 9, 9], [5, 6, 1, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6, [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    # stop at 4 -> last token before it (3); no stop -> the last token (5); never before d
    assert local_positions(tokens, mask, torch.tensor([1, 2, 2]), stops).tolist() == [3, 5, 2]
    assert local_positions(tokens, mask, torch.tensor([4, 0, 0]), stops).tolist() == [4, 5, 1]


def _sampled_plan(ro):
    own = (ro.repair_of < 0).nonzero().squeeze(-1)
    s = ro.rows(own)
    return own, repair_plan(s.response_ids, s.response_mask, s.rewards > 0, s.group)


@pytest.mark.parametrize("branch_token", ["sample", "alternative"])
def test_local_repair_kv_reuse_equals_recomputation(setup, branch_token):
    """Each local repair is the re-sample of try k = p_0 − branch_at (key mixed with 1 + k)
    from position branch_at ∈ [d, p_0] of the row it repairs, and equals that re-sample fed
    from scratch; rows come out the same alone (one group: a data-parallel rank's share) and
    in a batch, and twice."""
    model, tok, task, problems, keys = setup
    T = task.max_new_tokens
    spec = SamplingSpec(G, T, 1.0, layout="repair", repair="local", branch_token=branch_token)
    ro = generate_repair(model, tok, problems, spec, keys, task)
    own, plan = _sampled_plan(ro)
    d_of = {int(own[i]): d for i, _, d in plan}
    rep = (ro.repair_of >= 0).nonzero().squeeze(-1).tolist()
    assert rep and len(plan) == ro.repairs_tried
    for r in rep:
        i, t = int(ro.repair_of[r]), int(ro.branch_at[r])
        p0 = int(local_positions(ro.response_ids[i:i + 1], ro.response_mask[i:i + 1],
                                 torch.tensor([d_of[i]]), stop_ids(model, tok))[0])
        k = p0 - t
        assert d_of[i] <= t <= p0 and 0 <= k < 4
        src = int(ro.group[i]) * G + (i - int((ro.group == ro.group[i]).nonzero()[0]))
        _recompute(model, tok, ro, r, i, t, mix_keys(keys[src].view(1), 1 + k)[0], T,
                   branch_token == "alternative")
    again = generate_repair(model, tok, problems, spec, keys, task)
    assert again.texts == ro.texts and torch.equal(again.old_logps, ro.old_logps)
    assert torch.equal(again.branch_at, ro.branch_at) and again.discarded_tokens == ro.discarded_tokens
    g = 1
    alone = generate_repair(model, tok, problems[g:g + 1], spec, keys[g * G:(g + 1) * G], task)
    rows = (ro.group == g).nonzero().squeeze(-1)
    assert alone.texts == [ro.texts[j] for j in rows.tolist()]
    assert torch.equal(alone.branch_at, ro.branch_at[rows])
    assert torch.equal(alone.repair_of, torch.where(ro.repair_of[rows] >= 0,
                                                    ro.repair_of[rows] - int(rows[0]), -1))


def test_trie_points_and_layout_sums():
    # a: 1 2 3 | b: 1 2 4 | c: 1 5 | d: 1 2 3  (rewards 1, 0, 0, 1)
    seqs = [(1, 2, 3), (1, 2, 4), (1, 5), (1, 2, 3)]
    # nodes with two children: after (1,) → {2, 5} (means 2/3 vs 0), after (1, 2) → {3, 4} (1 vs 0)
    assert _trie_points(seqs, [1, 0, 0, 1]) == (2, 2, 1 + 2)
    assert _trie_points(seqs, [0, 0, 0, 0]) == (2, 0, 3)
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 0], [1, 2, 3], [7, 7, 7]])
    mask = ids > 0
    ro = Rollout(ids[:, :1], torch.ones(5, 1, dtype=torch.bool), ids, mask, torch.zeros(5, 3),
                 torch.tensor([0, 0, 0, 0, 1]), [""] * 5, [None] * 5,
                 rewards=torch.tensor([1.0, 0, 0, 1, 0]), repair_of=torch.tensor([-1, -1, -1, 1, -1]),
                 generated=torch.tensor([3, 3, 2, 1, 3]), repairs_tried=2, discarded_tokens=4)
    s = layout_sums(ro)
    assert s == {"distinct_responses": 4, "duplicate_responses": 1, "branch_points": 2,
                 "informative_points": 2, "branch_depth_sum": 3, "generated_tokens": 12 + 4,
                 "trained_tokens": 14, "repairs_tried": 2, "repairs_kept": 1, "edited_tokens": 1}


def test_batch_repair_of_reindexes_into_the_batch():
    rep = torch.tensor([-1, -1, 0, -1, -1, 3, 4])  # rows 2 and 5, 6 repair rows 0 and 3, 4
    assert batch_repair_of(rep, torch.tensor([3, 4, 5, 6])).tolist() == [-1, -1, 0, 1]
    assert batch_repair_of(rep, torch.tensor([2, 0])).tolist() == [1, -1]
    assert batch_repair_of(None, torch.tensor([0])) is None


def test_micro_batches_pack_groups_of_varying_size():
    group = torch.tensor([0] * 4 + [1] * 6 + [2] * 4 + [3] * 5)
    parts = micro_batches(group, 8)
    assert [torch.unique(group[p]).tolist() for p in parts] == [[0], [1], [2], [3]]
    parts = micro_batches(group, 10)
    assert [torch.unique(group[p]).tolist() for p in parts] == [[0, 1], [2, 3]]
    fixed = torch.arange(16) // 4  # G = 4: size // G groups per part
    assert [p.tolist() for p in micro_batches(fixed, 8)] == [list(range(8)), list(range(8, 16))]


ARGS = ["--objectives", "dfpo-min", "--prompts", "4", "--G", "4", "--minibatches", "2",
        "--probe-contexts", "4", "--no-progress", "--eval-every", "0",
        "--ckpt-every", "1"]


def _cli(out, *extra):
    return [sys.executable, "-m", "gradlab", "tandem", "--out", str(out), *ARGS, *extra]


def _numbers(path) -> pd.DataFrame:
    df = gradlab.load_run(path)
    return df[~df["metric"].str.startswith("time_")].drop(columns="run").reset_index(drop=True)


@pytest.mark.parametrize("layout", [["--rollout", "tree", "--branch-token", "alternative"],
                                    ["--rollout", "repair", "--micro-batch", "4"]])
def test_layout_resume_equals_uninterrupted(tmp_path, layout):
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(_cli(full, "--steps", "2", *layout), env=ENV, check=True, capture_output=True)
    subprocess.run(_cli(cut, "--steps", "1", *layout), env=ENV, check=True, capture_output=True)
    subprocess.run(_cli(cut, "--steps", "2", "--resume"), env=ENV, check=True, capture_output=True)
    a, b = _numbers(full), _numbers(cut)
    pd.testing.assert_frame_equal(a, b)
    w = gradlab.load_run(full, wide=True)
    assert (w["generated_tokens"] > 0).all() and (w["branch_points_per_group"] > 0).all()
    if "repair" in layout:
        assert (w["trained_tokens"] > w["length"] * 4 * 4).all()  # repairs are trained on
    # traces and the viewer: each branched / repair row names its row and where it leaves it
    t = gradlab.load_traces(full, step=0)
    t = t[t["opt_step"] == t.groupby("group")["opt_step"].transform("min")]
    checked = 0
    for (g, _row), d in t.groupby(["group", "row"]):
        p, at = int(d["parent"].iloc[0]), int(d["branch_at"].iloc[0])
        if p < 0:
            continue
        mine = d.set_index("position")["token_id"]
        other = t[(t["group"] == g) & (t["row"] == p)].set_index("position")["token_id"]
        assert (mine.loc[: at - 1] == other.loc[: at - 1]).all()  # re-sampled from `at` on
        if "alternative" in layout:
            assert mine.loc[at] != other.get(at)
        checked += 1
    assert checked > 0
    from gradlab.viz.html import view

    page = view(full).read_text()
    assert "\u21b3" in page and '"parent":[-1,' in page  # the marker and the column


@pytest.mark.parametrize("layout,ranks", [
    (["--rollout", "tree", "--branch-at", "uniform"], []),  # DDP
    (["--rollout", "repair", "--micro-batch", "4", "--branch-token", "alternative"], ["--fsdp"]),
])
def test_two_ranks_equal_one_process(tmp_path, layout, ranks):
    """Two ranks (DDP; FSDP with micro-batches of repaired groups, whose sizes vary, so ranks
    run uneven passes) against one process: the same groups, accounting and updates."""
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(_cli(one, "--steps", "2", *layout), env=ENV, check=True, capture_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "gradlab", "tandem", "--out", str(two), *ARGS, "--steps", "2", *layout, *ranks]
    r = run_tree(cmd, timeout=600, together=120, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wa, wb = gradlab.load_run(one, wide=True), gradlab.load_run(two, wide=True)
    for m in ("generated_tokens", "trained_tokens", "distinct_per_group", "informative_per_1k",
              "branch_depth", "repair_success", "edited_per_repair", "reward"):
        np.testing.assert_array_equal(wa[m], wb[m], err_msg=m)
    for m in ("rho_trie", "grad_norm", "loss"):
        np.testing.assert_allclose(wa[m], wb[m], rtol=1e-3, atol=1e-6, err_msg=m)


@pytest.mark.parametrize("args,msg", [
    (["--rollout", "forest"], "--rollout: unknown 'forest'; valid: independent, tree, repair"),
    (["--roots", "9"], "--roots: 9 is invalid; must be in 1..G (8)"),
    (["--branches", "0"], "--branches: 0 is invalid; must be ≥ 1"),
    (["--branch-at", "middle"], "--branch-at: unknown 'middle'; valid: entropy, uniform"),
    (["--branch-token", "best"], "--branch-token: unknown 'best'; valid: sample, alternative"),
    (["--repair", "rewrite"], "--repair: unknown 'rewrite'; valid: resample, splice, local"),
    (["--repair-tries", "0"], "--repair-tries: 0 is invalid; must be ≥ 1"),
    (["--rollout", "repair", "--split-groups", "--minibatches", "2"],
     "--rollout repair: a repair trains next to the row it corrects"),
])
def test_bad_layout_option_is_a_one_line_error(args, msg, capsys):
    from gradlab.cli.main import main

    assert main(["tandem", "--out", "/tmp/x", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1
