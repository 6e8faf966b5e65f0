"""Griffe extension for the API pages: gradlab's docstrings lay out fields, shapes and commands
as indented blocks (plain text, not Markdown); render each such block verbatim, in monospace."""

from __future__ import annotations

import griffe


def preformat(text: str) -> str:
    """Wrap every run of indented lines (blank lines inside a run kept) in a ```text fence."""
    out, block = [], []

    def flush() -> None:
        while block and not block[-1].strip():
            block.pop()
        if block:
            out.extend(["", "```text", *block, "```", ""])
            block.clear()

    for line in text.splitlines():
        if line.startswith("  ") or (block and not line.strip()):
            block.append(line)
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out)


class Preformat(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = preformat(obj.docstring.value)
