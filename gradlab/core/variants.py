"""Objective variants written inline: ``name[key=value, ...]``.

One tandem can train several readings of one objective side by side from one start, e.g.
``--objectives 'gspo,dfpo-min,dfpo-orth[nodes=trie],gspo[eps=1e9]'``. The whole string is the
variant's label (in the store, the checkpoints and the figures); the part before ``[`` is a
registry name and the bracketed pairs are its constructor parameters.

Values are read with `ast.literal_eval` (numbers, tuples, strings, booleans, None), never
`eval`; a bare word that is not a literal (``nodes=trie``) is taken as the string itself.

A user's own loss is named ``path/file.py:fn`` or ``module:fn`` (`gradlab.core.userloss`), with one
optional parameter, its label: ``my_losses.py:dr_grpo[name=drgrpo]``. The label (`label`)
names the objective in the store, the checkpoints and the figures; without ``name=`` it is
the function's name. config.json keeps the whole spec, so a resumed run loads it again.
This module is pure string handling: it imports neither torch nor any objective.
"""

from __future__ import annotations

import ast
import re

_BARE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.+\-]*$")  # a bare word taken as a string (ga+la)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_USER = re.compile(r"^[^\[\]:,]+:[A-Za-z_][A-Za-z0-9_]*$")  # path/file.py:fn or module:fn
_OPEN, _CLOSE = "[({", "])}"


def split_top(text: str, sep: str = ",") -> list[str]:
    """Split `text` at `sep` outside brackets and quotes; parts stripped, empty parts dropped.

    ``"gspo,dfpo[eps=(0.1,0.2)]"`` → ``["gspo", "dfpo[eps=(0.1,0.2)]"]``. Unbalanced brackets
    raise ValueError naming the text.
    """
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in {text!r}")
        elif ch == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if depth or quote:
        raise ValueError(f"unbalanced brackets or quotes in {text!r}")
    parts.append("".join(cur).strip())
    return [p for p in parts if p]


def _value(spec: str, key: str, raw: str):
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        if _BARE.match(raw):
            return raw
        raise ValueError(f"objective {spec!r}: value of {key!r} is not a literal: {raw!r}") from None


def parse(spec: str) -> tuple[str, dict]:
    """``"dfpo-orth[nodes=trie, eps=(0.1, 0.1)]"`` → ``("dfpo-orth", {"nodes": "trie", "eps": (0.1, 0.1)})``.

    A plain name gives ``(name, {})``. Malformed text (no closing ``]``, a pair without ``=``,
    a key given twice, a non-literal value) raises ValueError naming the spec. Whether the name
    and keys are valid is checked by `gradlab.core.objectives.get`.
    """
    spec = spec.strip()
    if is_user(spec):
        return _parse_user(spec)
    if "/" in spec:  # the label names a checkpoint folder
        raise ValueError(f"objective {spec!r}: '/' is not allowed in an objective label")
    if "[" not in spec:
        if not _NAME.match(spec):
            raise ValueError(f"objective {spec!r}: a name is letters, digits, '-', '_' or '.'")
        return spec, {}
    name, _, rest = spec.partition("[")
    name = name.strip()
    if not rest.endswith("]") or not _NAME.match(name):
        raise ValueError(f"objective {spec!r}: expected name[key=value, ...]")
    params: dict = {}
    for pair in split_top(rest[:-1]):
        key, eq, raw = pair.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(f"objective {spec!r}: {pair!r} is not key=value")
        if key in params:
            raise ValueError(f"objective {spec!r}: {key!r} given twice")
        params[key] = _value(spec, key, raw.strip())
    return name, params


def is_user(spec: str) -> bool:
    """Whether `spec` names a user's loss (``file.py:fn``, ``module:fn``, optionally
    ``[name=label]``) rather than a registry objective."""
    return ":" in spec.strip().partition("[")[0]


def _parse_user(spec: str) -> tuple[str, dict]:
    """``"my.py:fn[name=x]"`` → ``("my.py:fn", {"name": "x"})``; only `name` is a parameter."""
    target, bracket, rest = spec.partition("[")
    target = target.strip()
    if not _USER.match(target):
        raise ValueError(f"objective {spec!r}: a user loss is path/file.py:function or "
                         "module:function")
    if not bracket:
        return target, {}
    if not rest.endswith("]"):
        raise ValueError(f"objective {spec!r}: expected {target}[name=label]")
    try:
        _, params = parse(f"user[{rest}")
    except ValueError as e:  # the same errors as a registry spec's, naming this spec
        raise ValueError(str(e).replace(repr(f"user[{rest}"), repr(spec))) from None
    bad = sorted(set(params) - {"name"})
    if bad:
        raise ValueError(f"objective {spec!r}: a user loss takes only [name=label], not {bad}")
    return target, params


def label(spec: str) -> str:
    """The name an objective goes by in the run store and figures: a registry spec itself
    (``dfpo-orth[nodes=trie]``); a user loss's ``name=`` or else its function's name
    (``examples/my_losses.py:dr_grpo`` → ``dr_grpo``). A label that cannot name a folder
    raises ValueError naming the spec."""
    spec = spec.strip()
    if not is_user(spec):
        return spec
    target, params = _parse_user(spec)
    name = str(params.get("name", target.rsplit(":", 1)[1]))
    if not _NAME.match(name):
        raise ValueError(f"objective {spec!r}: label {name!r} must be letters, digits, '-', '_' "
                         "or '.'")
    return name
