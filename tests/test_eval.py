"""Held-out evaluation: the split is disjoint by construction (many draws, every task kind), the
evaluation is in the store, deterministic, and leaves training untouched."""

import hashlib
import json

import pandas as pd
import pytest
import torch

import gradlab
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.setup.heldout import (
    EVAL_BUCKETS,
    TrainSplit,
    eval_problems,
    evaluate_heldout,
    heldout_prompts,
    is_heldout,
)
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask, JsonlTask, ScaffoldTask
from gradlab.loop.train import train

SMALL = dict(steps=2, prompts=4, G=4, minibatches=2, ckpt_every=1, tax_every=0, progress=False,
             probe_contexts=4, instruments="cheap", eval_size=16)


def _bucket0(prompt: str) -> bool:  # independent re-statement of the hash rule
    return int(hashlib.sha1(prompt.encode()).hexdigest()[:16], 16) % 8 == 0


@pytest.mark.parametrize("task", [ArithmeticTask(), ArithmeticTask(difficulty=1), ScaffoldTask()])
def test_training_never_draws_a_heldout_problem(task):
    ev = {p.prompt for p in eval_problems(task, 64)}
    if task.key == "arithmetic-d1":  # a small space: all its held-out problems, independently
        space = {f"{a}+{b}=?" for a in range(10) for b in range(10) if a != b}
        assert ev == {p for p in space if _bucket0(p)} and 0 < len(ev) < 64
    else:
        assert len(ev) == 64 and all(_bucket0(p) for p in ev)
    split = TrainSplit(task)
    seen = set()
    for seed in range(300):
        ps = split.problems(8, seed=seed)
        assert len(ps) == 8
        seen |= {p.prompt for p in ps}
    assert not seen & ev and not any(_bucket0(p) for p in seen)
    # the stream is the task's own, held-out problems skipped (order kept)
    raw = [p for p in task.problems(2 * 8 + 8, seed=5) if not _bucket0(p.prompt)][:8]
    assert split.problems(8, seed=5) == raw
    assert eval_problems(task, 64) == eval_problems(task, 64)  # fixed for the task


def test_heldout_share_of_the_arithmetic_space():
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b]
    held = sum(is_heldout(f"{a}+{b}=?") for a, b in pairs)
    assert held == sum(_bucket0(f"{a}+{b}=?") for a, b in pairs)
    assert abs(held / len(pairs) - 1 / EVAL_BUCKETS) < 0.02  # ~1000 of 8010 problems


def _jsonl(path, n):
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return JsonlTask(path)


def test_jsonl_holds_out_a_fraction_of_lines(tmp_path):
    task = _jsonl(tmp_path / "t.jsonl", 40)
    held = heldout_prompts(task)
    prompts = sorted((f"{i}+1=?" for i in range(40)),
                     key=lambda s: hashlib.sha1(s.encode()).digest()[:8])
    assert held == frozenset(prompts[:5])  # floor(40 / 8) lines, smallest hash first
    assert {p.prompt for p in eval_problems(task, 64)} == held
    split = TrainSplit(task)
    for seed in range(200):
        assert not {p.prompt for p in split.problems(6, seed=seed)} & held
    small = _jsonl(tmp_path / "s.jsonl", 5)  # < 8 lines: nothing held out, training unchanged
    assert eval_problems(small, 64) == [] and TrainSplit(small).problems(3, 1) == small.problems(3, 1)


def _greedy(model, tok, prompt: str, max_new: int) -> str:
    """Plain greedy decoding, one full forward per token (no KV cache, no padding)."""
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = []
    for _ in range(max_new):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tok.decode(out)


def test_greedy_accuracy_matches_plain_greedy_decoding():
    task = ArithmeticTask()
    model, tok = load_policy(task=task)
    ps = eval_problems(task, 12)
    got = evaluate_heldout(model, tok, task, ps, temperature=1.0,
                           max_new_tokens=task.max_new_tokens, seed=0)
    ref = sum(task.is_correct(p, _greedy(model, tok, p.prompt, task.max_new_tokens)) for p in ps)
    assert got["eval_accuracy_greedy"] == ref / len(ps)
    again = evaluate_heldout(model, tok, task, ps, temperature=1.0,
                             max_new_tokens=task.max_new_tokens, seed=0)
    assert again == got and 0 <= got["eval_accuracy"] <= 1
    assert evaluate_heldout(model, tok, task, [], temperature=1.0, max_new_tokens=8, seed=0) == {}


def _metrics(path) -> pd.DataFrame:
    df = gradlab.load_run(path)
    return df[~df["metric"].str.startswith("time_")].drop(columns="run").reset_index(drop=True)


def test_eval_in_store_deterministic_and_training_untouched(tmp_path):
    kw = dict(objectives=["gspo", "dfpo-min"], **SMALL)
    train(RunConfig(out=str(tmp_path / "a"), eval_every=1, **kw))
    train(RunConfig(out=str(tmp_path / "b"), eval_every=1, **kw))
    train(RunConfig(out=str(tmp_path / "off"), eval_every=0, **kw))
    a, b, off = _metrics(tmp_path / "a"), _metrics(tmp_path / "b"), _metrics(tmp_path / "off")
    pd.testing.assert_frame_equal(a, b)
    ev = a[a["metric"].str.startswith("eval_")]
    assert len(ev) == 3 * 2 * 2  # 3 keys × 2 objectives × 2 evaluation steps
    assert set(ev["metric"]) == {"eval_accuracy", "eval_accuracy_greedy", "eval_accuracy_expected"}
    assert ev["value"].between(0, 1).all()
    rest = a[~a["metric"].str.startswith("eval_")].reset_index(drop=True)
    pd.testing.assert_frame_equal(rest, off)  # evaluating consumes no training randomness
    assert not off["metric"].str.startswith("eval_").any()
    # default eval_every=10 with 2 steps: evaluated at the end only
    train(RunConfig(out=str(tmp_path / "end"), **kw))
    wide = gradlab.load_run(tmp_path / "end", wide=True)
    assert wide[wide["step"] == 0]["eval_accuracy"].isna().all()
    assert wide[wide["step"] == 1]["eval_accuracy"].notna().sum() == 2


def test_bad_eval_options():
    with pytest.raises(ConfigError, match="--eval-every"):
        RunConfig(eval_every=-1)
    with pytest.raises(ConfigError, match="--eval-size"):
        RunConfig(eval_size=0)
