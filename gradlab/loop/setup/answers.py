"""What counts as a correct answer: the problem record, the answer extractor shared by every
task, and the math-verify equivalence of `--verifier math` (optional extra `gradlab[math]`)."""

from __future__ import annotations

from dataclasses import dataclass, field

MATH_INSTALL = "pip install gradlab[math]"


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer (compared as a stripped string)."""

    prompt: str
    answer: str
    solutions: tuple[str, ...] = field(default=(), compare=False)  # correct responses, by form


def extract_answer(response: str) -> str | None:
    """Text after the last '=' of `response`, stripped; None if there is no '=' or it is empty."""
    if "=" not in response:
        return None
    ans = response.rsplit("=", 1)[1].strip()
    return ans or None


def _solution_form(problem: Problem, response: str) -> int | None:
    """Index k of the correct solution that `response` equals (after strip), else None."""
    try:
        return problem.solutions.index(response.strip())
    except ValueError:
        return None


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ValueError(f"--verifier math needs math-verify: {MATH_INSTALL}") from None
    return math_verify


def math_equal(answer: str, response: str) -> bool:
    """math-verify equivalence of `response` (its final answer, else the text after its last
    "=") with the reference `answer`."""
    mv = _math_verify()
    gold = mv.parse(answer)
    cands = [response] + ([a] if (a := extract_answer(response)) else [])
    return any(mv.verify(gold, mv.parse(c)) for c in cands)
