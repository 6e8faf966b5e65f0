"""Two-step arithmetic word problems: a reasoning task generated from a seed, no download.

    "Tom has 3 apples. Tom buys 4 more, then gives 2 away. How many apples does Tom have now?
     Think step by step, then end with 'The answer is <number>.'"

The model writes a short chain of thought and ends with ``The answer is <number>.`` (the phrase
SmolLM2-135M-Instruct ends with by itself); the verifier reads the integer right after the
*last* marker, case ignored (`extract_marked`), and compares it with the true result. Reward is binary (1.0 correct, 0.0 otherwise, including a response without the marker).
The problem space is unbounded, so the held-out split is the hash rule of `loop/setup/heldout.py`
(`TrainSplit(task)` for training prompts, `eval_problems(task, n)` for the evaluation set).

`difficulty` sets the steps and operand range: 1 = one addition, operands 1..9 (what
SmolLM2-135M-Instruct partly solves: figures/real_trl_pilot.md); 2 = add then give away,
operands 1..9; 3 = add then give away or multiply, operands 2..20.
"""

from __future__ import annotations

import random
import re

from .answers import Problem

MARKER = "the answer is"
_NUMBER = re.compile(r"-?\d[\d,]*")
NAMES = ("Tom", "Ana", "Sam", "Mia", "Leo", "Zoe", "Ben", "Ivy")
ITEMS = ("apples", "books", "coins", "pens", "cards", "stickers", "marbles", "shells")
INSTRUCTION = "Think step by step, then end with 'The answer is <number>.'"
_RANGES = {1: (1, 9), 2: (1, 9), 3: (2, 20)}
# One worked example (question, answer) before each problem: it shows the marker (without it
# the base model ends with the marker in about a third of its sampled responses;
# figures/real_trl_pilot.md)
EXAMPLES = {
    1: ("Sam has 2 pens. Sam buys 3 more. How many pens does Sam have now?",
        "Sam has 2 + 3 = 5 pens. The answer is 5."),
    2: ("Sam has 2 pens. Sam buys 3 more, then gives 1 away. How many pens does Sam have now?",
        "Sam has 2 + 3 = 5 pens, then 5 - 1 = 4 pens. The answer is 4."),
}
EXAMPLES[3] = EXAMPLES[2]
FEWSHOT = ("inline", "chat")


def extract_marked(response: str, marker: str = MARKER) -> str | None:
    """The integer right after the last `marker` in `response` (case ignored; commas, "$" and
    "**" allowed between), as a string; None when there is no marker or no number follows it."""
    low = response.lower()
    at = low.rfind(marker.lower())
    if at < 0:
        return None
    m = _NUMBER.match(response[at + len(marker):].lstrip(" :$*"))
    return None if m is None else str(int(m.group(0).replace(",", "")))


class WordProblemTask:
    """Seeded two-step word problems with a binary reward on the marked final answer.

    difficulty: 1..3 (module docstring). seed: task seed, mixed into every `problems` call.
    max_new_tokens: completion budget in tokens (a short chain of thought fits in 128).
    fewshot: where the worked example goes. "inline": in the prompt's text, before the problem
    ("Example: … The answer is 5.\n\n<problem>"). "chat": as an earlier exchange of the
    conversation (`messages`: user example, assistant answer, user problem); the prompt text is
    then the problem alone. In the chat form SmolLM2-135M-Instruct answers in the example's
    words ("Tom has 2 + 7 = 9 cards. …"), so the G responses of a prompt often share their
    first tokens (figures/real_trl.md).
    """

    name = "word"

    def __init__(self, difficulty: int = 1, seed: int = 0, max_new_tokens: int = 128,
                 fewshot: str = "inline"):
        if difficulty not in _RANGES:
            raise ValueError(f"word task: difficulty={difficulty!r}; valid: 1, 2, 3")
        if max_new_tokens < 1:
            raise ValueError(f"word task: max_new_tokens={max_new_tokens}; valid: ≥ 1")
        if fewshot not in FEWSHOT:
            raise ValueError(f"word task: fewshot={fewshot!r}; valid: {', '.join(FEWSHOT)}")
        self.difficulty, self.seed, self._max_new = difficulty, seed, max_new_tokens
        self.fewshot = fewshot

    @property
    def key(self) -> str:
        return f"word-d{self.difficulty}" + ("-chat" if self.fewshot == "chat" else "")

    @property
    def max_new_tokens(self) -> int:
        return self._max_new

    def make_problem(self, rng: random.Random) -> Problem:
        """One problem from `rng`: start with a, gain b; at difficulty ≥ 2 then lose c (or, at
        3, get c times as many); the result stays ≥ 0."""
        lo, hi = _RANGES[self.difficulty]
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if self.difficulty == 1:
            text, result = "", a + b
        elif self.difficulty == 3 and rng.random() < 0.5:
            c = rng.randint(2, 4)
            text = f", then the number of {item} is multiplied by {c}"
            result = (a + b) * c
        else:
            c = rng.randint(lo, a + b)
            text = f", then gives {c} away"
            result = a + b - c
        prompt = (f"{who} has {a} {item}. {who} buys {b} more{text}. How many {item} does "
                  f"{who} have now? {INSTRUCTION}")
        if self.fewshot == "inline":
            question, answer = EXAMPLES[self.difficulty]
            prompt = f"Example: {question} {answer}\n\n{prompt}"
        return Problem(prompt=prompt, answer=str(result))

    def messages(self, problem: Problem) -> list[dict]:
        """The conversation of one problem (chat-template messages): the user's prompt, after
        the worked example's exchange when fewshot="chat"."""
        if self.fewshot == "inline":
            return [{"role": "user", "content": problem.prompt}]
        question, answer = EXAMPLES[self.difficulty]
        return [{"role": "user", "content": f"{question} {INSTRUCTION}"},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": problem.prompt}]

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, deterministic in (task seed, seed)."""
        rng = random.Random(self.seed * 1_000_003 + seed)
        return [self.make_problem(rng) for _ in range(n)]

    extract_answer = staticmethod(extract_marked)

    def is_correct(self, problem: Problem, response: str) -> bool:
        return extract_marked(response) == problem.answer

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 if the number after the last "the answer is" is the result, else 0.0."""
        return 1.0 if self.is_correct(problem, response) else 0.0

    def solution_form(self, problem: Problem, response: str) -> int | None:
        return None  # free-form chains of thought: no enumerated solution forms

    def solutions(self, problem: Problem) -> list[str]:
        return [f"The answer is {problem.answer}."]
