"""MkDocs hooks: the CLI reference from gradlab's own argument parsers, the repository's
figures (PNG images and the Markdown tables beside them) published with the site, and the
search index as a script for pages opened from disk.

The CLI page holds the marker `<!-- gradlab:cli -->`; at build time it is replaced by the help
text that `gradlab <command> --help` prints, for every sub-command the parser in
gradlab/cli/main.py defines (sub-commands added later appear without editing the docs).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- gradlab:cli -->"
# sub-commands one level further down that dispatch to their own parser (gradlab/cli/main.py: _delegate)
NESTED = [["audit", "verl"]]


def _help(argv: list[str]) -> str:
    """What `gradlab ARGV --help` prints (argparse exits 0 after printing)."""
    from gradlab.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue().rstrip()


def _subcommands() -> list[tuple[str, str]]:
    """(name, one-line help) of every sub-command of `gradlab`, in the parser's order."""
    import argparse

    from gradlab.cli.main import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return [(a.dest, a.help or "") for a in action._choices_actions]
    raise RuntimeError("gradlab.cli.build_parser() has no sub-commands")


def cli_reference() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal width: fix it for the page
    subs = _subcommands()
    names = [n for n, _ in subs]
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| [`gradlab {n}`](#gradlab-{n}) | {h} |" for n, h in subs]
    lines += ["", "## gradlab", "", "```text", _help([]), "```"]
    for argv in [[n] for n in names] + [a for a in NESTED if a[0] in names]:
        title = "gradlab " + " ".join(argv)
        lines += ["", f"## {title}", "", "```text", _help(argv), "```"]
    return "\n".join(lines) + "\n"


def on_config(config):
    """Document this checkout's gradlab, not another installed copy. (Here, not at import: MkDocs
    pops its own sys.path entry after loading a hook file.)"""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    return markdown


def on_files(files, config):
    """Publish figures/*.png and figures/**/*.md under figures/ in the site (one source of truth:
    the files the analyses write)."""
    for path in sorted((ROOT / "figures").rglob("*")):
        if path.suffix in (".png", ".md") and path.is_file():
            uri = path.relative_to(ROOT).as_posix()
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


@event_priority(-100)  # after the search plugin has written search_index.json
def on_post_build(config) -> None:
    """search/search_index.js beside search_index.json: a page opened from disk (file://) loads
    the index as a script, since the browser refuses to fetch it, and finds none without this
    file (a console error). The browser runs no search worker from disk, so there the search
    box stays hidden; served over http (python -m http.server -d site) search works."""
    folder = Path(config.site_dir) / "search"
    index = folder / "search_index.json"
    if index.is_file():
        (folder / "search_index.js").write_text("var __index = " + index.read_text(encoding="utf-8"),
                                                encoding="utf-8")
