"""Verifiable tasks with a sparse terminal reward.

Two tasks share one interface (`problems`, `reward`, `is_correct`, `solution_form`,
`solutions`, `extract_answer`, `key`, `max_new_tokens`):

- `ArithmeticTask`: seeded multi-digit addition. Prompt ``"34+57=?"``; the two equally correct
  responses are ``"so 34+57=91"`` (form 0, operands in prompt order) and ``"so 57+34=91"``
  (form 1, swapped). Every response of a group starts with the template prefix ``"so "``, so the
  G responses of one prompt share their first tokens (the shared nodes of docs/concepts/shared-nodes.md), and
  the first operand is the branch point between the two solution forms (docs/concepts/drift.md#entropy-collapse).
- `JsonlTask`: any ``{"prompt": ..., "answer": ...}`` file (optional ``"solutions": [...]``).

The answer extractor is the same for both: the text after the last ``"="`` of the response,
stripped of whitespace (None when there is no ``"="``).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from ..config import ConfigError
from ..faults.untrusted import check_task_size
from .answers import (
    Problem,
    _math_verify,
    _solution_form,
    extract_answer,
    math_equal,
)

TEMPLATE_PREFIX = "so "
# Well-formed arithmetic response: "so <int>+<int>=<int>".
_FORMAT = re.compile(r"^so (\d+)\+(\d+)=(\d+)$")


class ArithmeticTask:
    """Seeded addition of two `difficulty`-digit numbers with a sparse terminal reward in {0, 1}.

    difficulty: digits per operand (1..9). Operands are distinct, so the two forms differ.
    seed: task-level seed, mixed into every `problems(n, seed)` call.
    strict: (default) the verifier checks the whole stated equation: reward 1.0 iff the response
        is exactly one of the two solutions, "so a+b=c" or "so b+a=c" (surrounding whitespace
        ignored). A right number after "=" with mis-copied operands ("so 34+58=91" for
        "34+57=?") earns 0, so the rewarded responses are exactly the two solution forms.
        strict=False: outcome-only reward, 1.0 iff `extract_answer(response)` equals the answer.
    format_bonus: optional extra reward for a well-formed response ("so <int>+<int>=<int>");
        0 by default, which keeps the reward binary.
    """

    name = "arithmetic"

    def __init__(
        self, difficulty: int = 2, seed: int = 0, strict: bool = True, format_bonus: float = 0.0
    ):
        if not 1 <= difficulty <= 9:
            raise ValueError(f"difficulty must be in 1..9 digits, got {difficulty}")
        self.difficulty = difficulty
        self.seed = seed
        self.strict = strict
        self.format_bonus = format_bonus

    @property
    def key(self) -> str:
        """Identifies the task for caching warm-started policies (seed does not change the task)."""
        return f"arithmetic-d{self.difficulty}" + ("" if self.strict else "-outcome")

    @property
    def exact_answers(self) -> bool:
        """True when the verifier accepts exactly `solutions(problem)` (strict): a policy's
        expected accuracy is then a sum of sequence probabilities (loop/recipes/evaluation.py)."""
        return self.strict

    @property
    def max_new_tokens(self) -> int:
        """Enough response tokens for "so a+b=c" plus EOS, with a little slack."""
        return 3 + 2 * self.difficulty + 1 + (self.difficulty + 1) + 1 + 2

    def make_problem(self, a: int, b: int) -> Problem:
        """The problem a+b with both solution forms (form 0: a+b, form 1: b+a)."""
        c = a + b
        sols = (f"{TEMPLATE_PREFIX}{a}+{b}={c}", f"{TEMPLATE_PREFIX}{b}+{a}={c}")
        return Problem(prompt=f"{a}+{b}=?", answer=str(c), solutions=sols)

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, deterministic in (task seed, seed). Operands are distinct."""
        rng = random.Random(self.seed * 1_000_003 + seed)
        lo = 0 if self.difficulty == 1 else 10 ** (self.difficulty - 1)
        hi = 10**self.difficulty - 1
        out = []
        while len(out) < n:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if a != b:  # a == b would make the two forms identical
                out.append(self.make_problem(a, b))
        return out

    def all_problems(self) -> list[Problem]:
        """Every problem of the task's space (a ≠ b), in operand order; ValueError beyond 10^6."""
        lo = 0 if self.difficulty == 1 else 10 ** (self.difficulty - 1)
        hi = 10**self.difficulty - 1
        if (hi - lo + 1) ** 2 > 10**6:
            raise ValueError(f"arithmetic difficulty {self.difficulty}: too many problems to list")
        return [self.make_problem(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                if a != b]

    extract_answer = staticmethod(extract_answer)

    def is_well_formed(self, response: str) -> bool:
        return _FORMAT.match(response.strip()) is not None

    def is_correct(self, problem: Problem, response: str) -> bool:
        """Correctness as the verifier sees it (see `strict` in the class docstring)."""
        if self.strict:
            return self.solution_form(problem, response) is not None
        return extract_answer(response) == problem.answer

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 if `is_correct`, else 0.0; plus `format_bonus` for a well-formed response."""
        r = 1.0 if self.is_correct(problem, response) else 0.0
        if self.format_bonus and self.is_well_formed(response):
            r += self.format_bonus
        return r

    def solution_form(self, problem: Problem, response: str) -> int | None:
        """0 for "so a+b=c", 1 for "so b+a=c" (exactly, correct c), None for anything else."""
        return _solution_form(problem, response)

    def solutions(self, problem: Problem) -> list[str]:
        """Both correct responses, [form 0, form 1]."""
        if problem.solutions:
            return list(problem.solutions)
        a, b = (int(x) for x in problem.prompt.rstrip("=?").split("+"))
        return list(self.make_problem(a, b).solutions)


class JsonlTask:
    """Problems from a JSONL file: one ``{"prompt": str, "answer": str}`` object per line.

    An optional ``"solutions": [str, ...]`` per line gives correct responses (index = form); they
    enable `warm_start` and `solution_form`. Blank lines are skipped; a malformed line raises
    ValueError naming the file and the 1-based line number.

    Answer extractor: the text after the last "=" of the response, stripped (see
    `extract_answer`); the reward is 1.0 iff it equals the line's "answer" (stripped), else 0.0.
    """

    name = "jsonl"

    def __init__(self, path: str | Path, seed: int = 0):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"JSONL task file not found: {self.path}")
        self.seed = seed
        check_task_size(self.path)  # refused before it is read (loop/faults/untrusted.py)
        raw = self.path.read_bytes()
        self._digest = hashlib.sha1(raw).hexdigest()[:12]
        self._items = self._parse(_decode_utf8(self.path, raw))

    def _parse(self, text: str) -> list[Problem]:
        items = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{self.path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{where}: invalid JSON at column {e.colno} ({e.msg})") from None
            if not isinstance(obj, dict) or "prompt" not in obj or "answer" not in obj:
                raise TaskFileError(f'{where}: expected an object with "prompt" and "answer"')
            sols = obj.get("solutions", [])
            if not isinstance(sols, list) or not all(isinstance(s, str) for s in sols):
                raise TaskFileError(f'{where}: "solutions" must be a list of strings')
            items.append(Problem(str(obj["prompt"]), str(obj["answer"]).strip(), tuple(sols)))
        if not items:
            raise TaskFileError(f"{self.path}: no problems in file")
        return items

    @property
    def key(self) -> str:
        return f"jsonl-{self._digest}"

    @property
    def max_new_tokens(self) -> int:
        longest = max((len(s) for p in self._items for s in p.solutions), default=16)
        return longest + 4

    def __len__(self) -> int:
        return len(self._items)

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems: the file's lines in a seeded shuffled order, cycled (reshuffled per pass)."""
        rng = random.Random(self.seed * 1_000_003 + seed)
        out: list[Problem] = []
        while len(out) < n:
            order = list(range(len(self._items)))
            rng.shuffle(order)
            out.extend(self._items[i] for i in order[: n - len(out)])
        return out

    extract_answer = staticmethod(extract_answer)

    verifier = "exact"  # or "math" (set_verifier): math-verify equivalence

    def is_correct(self, problem: Problem, response: str) -> bool:
        if self.verifier == "math":
            return math_equal(problem.answer, response)
        return extract_answer(response) == problem.answer

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 if the extracted answer equals the line's "answer", else 0.0 (`verifier`)."""
        return 1.0 if self.is_correct(problem, response) else 0.0

    def solution_form(self, problem: Problem, response: str) -> int | None:
        """Index of the line's solution that `response` equals (after strip), else None."""
        return _solution_form(problem, response)

    def solutions(self, problem: Problem) -> list[str]:
        return list(problem.solutions)


class TaskFileError(ConfigError):
    """A task file that cannot be used: the message names the file, the line and what is wrong."""


def _decode_utf8(path: Path, raw: bytes) -> str:
    """The file's text (UTF-8, a leading BOM allowed); else one line naming line and byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise TaskFileError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                            f"{col}: {e.reason}); save the file as UTF-8") from None


def check_encodable(task, tokenizer) -> None:
    """Refuse a JSONL task with characters the tokenizer cannot encode (they would silently
    become <unk>): one line with their count, the characters and the first line holding one.
    Tokenizers without an unknown token (byte-level BPE) encode everything; other tasks pass."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(task, JsonlTask) or unk is None:
        return
    texts = [t for p in task._items for t in (p.prompt, p.answer, *p.solutions)]
    counts: dict[str, int] = {}
    for t in texts:
        for ch in t:
            counts[ch] = counts.get(ch, 0) + 1
    bad = {ch: n for ch, n in counts.items()
           if unk in tokenizer(ch, add_special_tokens=False)["input_ids"]}
    if not bad:
        return
    lines = _decode_utf8(task.path, task.path.read_bytes()).splitlines()
    first = next(i for i, line in enumerate(lines, 1) if any(ch in line for ch in bad))
    shown = ", ".join(f"{ch!r} ×{n}" for ch, n in sorted(bad.items(), key=lambda x: -x[1])[:8])
    raise TaskFileError(f"{task.path}:{first}: {sum(bad.values())} character(s) the tokenizer "
                        f"cannot encode (they would become <unk>): {shown}; replace them in the "
                        "file, or pass --model with a tokenizer that covers them")


TASKS = ("arithmetic", "scaffold", "<path>.jsonl")
BUILTIN_TASKS = ("arithmetic", "scaffold")


def get_task(name_or_path: str, **kw) -> ArithmeticTask | JsonlTask | ScaffoldTask:
    """ "arithmetic" -> ArithmeticTask(**kw); "scaffold" -> ScaffoldTask(**kw); a path ending in
    .jsonl -> JsonlTask(path, **kw)."""
    if name_or_path == "arithmetic":
        return ArithmeticTask(**kw)
    if name_or_path == "scaffold":
        return ScaffoldTask(**kw)
    if str(name_or_path).endswith(".jsonl"):
        return JsonlTask(name_or_path, **kw)
    raise ValueError(f"unknown task {name_or_path!r}; valid values: {', '.join(TASKS)}")


VERIFIERS = ("exact", "math")


def set_verifier(task, name: str) -> None:
    """Switch a JSONL task's answer check: "exact" (string after the last "=") or "math"
    (math-verify: the response's final answer, or the text after its last "=", mathematically
    equal to the line's answer). ValueError for an unknown name, an arithmetic task, or
    math-verify missing (naming the install command)."""
    if name not in VERIFIERS:
        raise ValueError(f"--verifier: unknown {name!r}; valid: {', '.join(VERIFIERS)}")
    if name == "math":
        if not isinstance(task, JsonlTask):
            raise ValueError("--verifier math: applies to JSONL tasks (arithmetic has its own)")
        _math_verify()
    task.verifier = name


# ----------------------------------------------------------------------------- scaffold task

# The fixed plan every correct scaffold response starts with (57 characters = 57 tokens of the
# toy character tokenizer): the long full-group prefix the verifier requires.
SCAFFOLD_PREAMBLE = "plan: add the numbers one at a time and keep a running sum. "


class ScaffoldTask:
    """Running sums behind a long fixed preamble: a task whose learning tax is large.

    Prompt ``"7+5+8=?"`` (2..`max_terms` digits 1-9, first ≠ last). The two equally correct
    responses are the preamble then the running sums, form 0 left to right, form 1 right to left:
    ``PREAMBLE + "7+5=12,12+8=20"`` and ``PREAMBLE + "8+5=13,13+7=20"``. The verifier is strict:
    reward 1.0 iff the response is exactly one of the two (the preamble included), else 0.0.
    Why: every response of a group shares the preamble (≥ 60 % of response tokens sit at
    full-group nodes), while the number of worked steps follows the prompt's term count, so a
    response that skips or adds a step (wrong) is shorter or longer than a right one and GSPO's
    1/T_i and sequence ratio differ inside a group (docs/concepts/shared-nodes.md: the length mechanism).
    """

    name = "scaffold"
    preamble = SCAFFOLD_PREAMBLE
    exact_answers = True  # the verifier accepts exactly `solutions(problem)` (loop/recipes/evaluation.py)

    def __init__(self, max_terms: int = 4, seed: int = 0):
        if not 2 <= max_terms <= 6:
            raise ValueError(f"max_terms must be in 2..6, got {max_terms}")
        self.max_terms = max_terms
        self.seed = seed

    @property
    def key(self) -> str:
        """Identifies the task for caching warm-started policies (seed does not change the task)."""
        return f"scaffold-t{self.max_terms}"

    @property
    def max_new_tokens(self) -> int:
        """Preamble + (terms − 1) steps of at most "99+9=99," (8 chars) + EOS, with slack."""
        return len(self.preamble) + 8 * (self.max_terms - 1) + 4

    def make_problem(self, terms: list[int]) -> Problem:
        """The problem Σ terms with both solution forms (form 0: left to right, 1: reversed)."""
        sols = tuple(self.preamble + _running_sums(t) for t in (terms, terms[::-1]))
        return Problem("+".join(map(str, terms)) + "=?", str(sum(terms)), sols)

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, deterministic in (task seed, seed); term count uniform in 2..max_terms."""
        rng = random.Random(self.seed * 1_000_003 + seed + 77)
        out = []
        while len(out) < n:
            terms = [rng.randint(1, 9) for _ in range(rng.randint(2, self.max_terms))]
            if terms[0] != terms[-1]:  # a palindrome would make the two forms identical
                out.append(self.make_problem(terms))
        return out

    def all_problems(self) -> list[Problem]:
        """Every problem of the task's space (2..max_terms digits 1-9, first ≠ last)."""
        from itertools import product

        return [self.make_problem(list(t)) for k in range(2, self.max_terms + 1)
                for t in product(range(1, 10), repeat=k) if t[0] != t[-1]]

    extract_answer = staticmethod(extract_answer)

    def is_correct(self, problem: Problem, response: str) -> bool:
        """Exactly one of the two solutions (so the preamble is required)."""
        return response.strip().startswith(self.preamble.strip()) and \
            self.solution_form(problem, response) is not None

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if self.is_correct(problem, response) else 0.0

    def solution_form(self, problem: Problem, response: str) -> int | None:
        """0 for left-to-right sums, 1 for right-to-left (exactly, preamble included), else None."""
        return _solution_form(problem, response)

    def solutions(self, problem: Problem) -> list[str]:
        """Both correct responses, [form 0, form 1]."""
        if problem.solutions:
            return list(problem.solutions)
        return list(self.make_problem([int(x) for x in problem.prompt.rstrip("=?").split("+")]).solutions)


def _running_sums(terms: list[int]) -> str:
    """"7+5=12,12+8=20" for [7, 5, 8]: one worked step per term after the first."""
    steps, acc = [], terms[0]
    for x in terms[1:]:
        steps.append(f"{acc}+{x}={acc + x}")
        acc += x
    return ",".join(steps)
