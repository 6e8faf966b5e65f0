"""Tasks: problem generation, reward, answer extraction, solution forms, JSONL parsing."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradlab.loop.setup.task import ArithmeticTask, JsonlTask, Problem, extract_answer, get_task

TINY = Path(__file__).parent / "data" / "tiny_task.jsonl"


def test_problems_deterministic_and_sized():
    task = ArithmeticTask(difficulty=3, seed=5)
    a, b = task.problems(20, seed=1), task.problems(20, seed=1)
    assert a == b
    assert a != task.problems(20, seed=2)
    assert a != ArithmeticTask(difficulty=3, seed=6).problems(20, seed=1)
    for p in a:
        x, y = p.prompt.removesuffix("=?").split("+")
        assert len(x) == len(y) == 3 and x != y
        assert p.answer == str(int(x) + int(y))


def test_reward_right_wrong_malformed():
    task = ArithmeticTask()
    p = task.make_problem(34, 57)
    assert p.prompt == "34+57=?" and p.answer == "91"
    assert task.reward(p, "so 34+57=91") == 1.0
    assert task.reward(p, "so 57+34=91") == 1.0
    assert task.reward(p, " so 57+34=91 ") == 1.0  # surrounding whitespace ignored
    assert task.reward(p, "so 34+57=92") == 0.0  # wrong sum
    assert task.reward(p, "so 34+58=91") == 0.0  # right number, mis-copied operand (strict)
    for bad in ["", "so ", "91", "so 34+57", "so 34+57=", "so 34+57=91=", "s0 34+57=91"]:
        assert task.reward(p, bad) == 0.0, bad


def test_outcome_reward_and_format_bonus():
    p = ArithmeticTask().make_problem(34, 57)
    loose = ArithmeticTask(strict=False)
    assert loose.reward(p, "so 34+58=91") == 1.0
    assert loose.reward(p, "the answer is =91") == 1.0
    assert loose.reward(p, "so 34+57=90") == 0.0
    fmt = ArithmeticTask(format_bonus=0.1)
    assert fmt.reward(p, "so 34+57=91") == pytest.approx(1.1)
    assert fmt.reward(p, "so 34+57=90") == pytest.approx(0.1)
    assert fmt.reward(p, "so 34+57") == 0.0


def test_solution_forms_share_template_prefix():
    task = ArithmeticTask()
    p = task.make_problem(12, 7)
    assert task.solutions(p) == ["so 12+7=19", "so 7+12=19"]
    assert task.solutions(Problem(p.prompt, p.answer)) == task.solutions(p)  # from the prompt
    assert task.solution_form(p, "so 12+7=19") == 0
    assert task.solution_form(p, "so 7+12=19") == 1
    assert task.solution_form(p, "so 7+12=20") is None
    assert task.solution_form(p, "so 12+8=19") is None
    assert task.solution_form(p, "12+7=19") is None
    assert all(s.startswith("so ") for s in task.solutions(p))


def test_extract_answer():
    assert extract_answer("so 12+7=19") == "19"
    assert extract_answer("a=b= 42 ") == "42"
    assert extract_answer("no equals sign") is None
    assert extract_answer("so 12+7=") is None
    assert ArithmeticTask.extract_answer("so 1+2=3") == "3"


@given(st.integers(10, 99), st.integers(10, 99))
def test_both_forms_rewarded_property(a, b):
    if a == b:
        return
    task = ArithmeticTask()
    p = task.make_problem(a, b)
    sols = task.solutions(p)
    assert [task.reward(p, s) for s in sols] == [1.0, 1.0]
    assert [task.solution_form(p, s) for s in sols] == [0, 1]
    assert task.reward(p, f"so {a}+{b}={a + b + 1}") == 0.0
    assert task.max_new_tokens >= max(len(s) for s in sols) + 1  # room for the EOS


def test_jsonl_task():
    task = JsonlTask(TINY)
    assert len(task) == 5  # the blank line is skipped
    ps = task.problems(12, seed=0)
    assert ps == task.problems(12, seed=0) and len(ps) == 12
    assert {p.prompt for p in ps[:5]} == {p.prompt for p in task.problems(5, seed=3)}
    p = next(p for p in ps if p.prompt == "3+4=?")
    assert task.reward(p, "so 3+4=7") == 1.0 and task.reward(p, "so 3+4=8") == 0.0
    assert task.reward(p, "7") == 0.0  # the extractor needs an "="
    assert task.solutions(p) == ["so 3+4=7", "so 4+3=7"]
    assert task.solution_form(p, "so 4+3=7") == 1
    q = next(p for p in ps if p.prompt.startswith("2*6"))
    assert q.answer == "12" and task.reward(q, "2*6 = 12") == 1.0
    assert task.solutions(q) == []
    assert task.key == JsonlTask(TINY).key


@pytest.mark.parametrize(
    "lines, msg",
    [
        (['{"prompt": "a", "answer": "1"}', "{not json"], ":2: invalid JSON"),
        (['{"prompt": "a"}'], ':1: expected an object with "prompt" and "answer"'),
        (["", '{"prompt": "a", "answer": "1", "solutions": "x"}'], ':2: "solutions"'),
        (["[1, 2]"], ":1: expected an object"),
    ],
)
def test_jsonl_bad_lines(tmp_path, lines, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=msg):
        JsonlTask(f)


def test_jsonl_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlTask(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no problems"):
        JsonlTask(tmp_path / "empty.jsonl")


def test_get_task():
    assert isinstance(get_task("arithmetic"), ArithmeticTask)
    assert get_task("arithmetic", difficulty=3).difficulty == 3
    assert isinstance(get_task(str(TINY)), JsonlTask)
    with pytest.raises(ValueError, match="arithmetic"):
        get_task("sudoku")
    with pytest.raises(ValueError, match="difficulty"):
        ArithmeticTask(difficulty=0)
