"""The documentation site builds strictly, its generated CLI reference covers every sub-command
and option of the parser, and its pages render in a real headless Chromium (Playwright driving
the system's chromium, as tests/test_view.py does) without console errors. `gradlab --version`.

.ci/run builds the site once (mkdocs build --strict --site-dir site) and points
GRADLAB_DOCS_SITE at it; without that variable the site is built here into a temporary folder.
"""

import argparse
import contextlib
import functools
import http.server
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gradlab
from gradlab.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_distributions(tmp_path):
    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "gradlab", "--version"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"gradlab {want}\n"
    assert importlib.metadata.version("gradlab") == want == gradlab.__version__


def test_readme_is_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "pip install torch==2.13.0 && pip install -e . && gradlab reproduce\n" in readme
    assert "bash .ci/run\n" in readme and (ROOT / ".ci" / "run").exists()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    given = os.environ.get("GRADLAB_DOCS_SITE")
    if given and (Path(given) / "index.html").exists():
        return Path(given)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_cli_reference_covers_every_subcommand_and_option(site):
    page = (site / "reference" / "cli" / "index.html").read_text()
    subs = _subparsers(build_parser())
    for name, sub in subs.items():
        assert f'id="gradlab-{name}"' in page, name
        for action in sub._actions:  # delegated sub-commands list their options in their own help
            for flag in action.option_strings:
                assert flag in page, (name, flag)
    assert "--version" in page and "--findings" in page  # top level; gradlab audit verl


@contextlib.contextmanager
def _browse(site: Path):
    """Serve the built site on localhost and yield (base URL, open(path) → page, errors):
    each page collects its console errors and uncaught exceptions; everything is closed after."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium binary (.ci/run installs it: apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])

            def open_page(route=None):
                pg, errors = browser.new_page(), []
                if route is not None:
                    pg.route("**/*", route)
                pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                pg.on("pageerror", lambda x: errors.append(str(x)))
                return pg, errors

            try:
                yield base, open_page
            finally:
                browser.close()
    finally:
        server.shutdown()


def test_index_and_api_pages_render_in_headless_chromium(site):
    seen = {}
    with _browse(site) as (base, open_page):
        for path in ("/", "/reference/api/core/"):
            pg, errors = open_page()
            pg.goto(base + path, wait_until="networkidle")
            seen[path] = (pg.title(), pg.inner_text("article"), errors,
                          pg.eval_on_selector_all("article img", "els => els.map(i => i.naturalWidth)"))
            pg.close()
    title, text, errors, images = seen["/"]
    assert not errors, errors
    assert title.startswith("gradlab") and "effective token modulation" in text
    assert images and all(w > 0 for w in images)  # the W-strips figure loaded
    title, text, errors, _ = seen["/reference/api/core/"]
    assert not errors, errors
    assert "TokenBatch" in text and "shared_nodes" in text and "Min-Replace" in text


def test_concept_pages_typeset_their_formulas_offline(site):
    """The formulas are typeset by KaTeX served from the site: with every request outside the
    local server refused, a concept page shows rendered math, no raw TeX and no console error."""
    outside, seen = [], {}
    with _browse(site) as (base, open_page):
        def only_local(route):  # the network is off: only the site's own server answers
            if route.request.url.startswith(base):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        for path in ("/concepts/shared-nodes/", "/concepts/ibpo/"):
            pg, errors = open_page(only_local)
            pg.goto(base + path, wait_until="networkidle")
            pg.wait_for_selector("article .katex", timeout=10_000)
            seen[path] = (errors, pg.eval_on_selector_all("article .katex-display", "e => e.length"),
                          pg.eval_on_selector_all("article .katex", "e => e.length"),
                          pg.eval_on_selector_all("article .katex-error", "e => e.length"),
                          pg.inner_text("article"))
            pg.close()
    assert not outside, outside
    for path, (errors, display, inline, bad, text) in seen.items():
        assert not errors, (path, errors)
        assert display >= 1 and inline >= 10 and bad == 0, (path, display, inline, bad)
        assert "\\frac" not in text and "\\sum" not in text, path  # no TeX left as text


def _shell_commands(path: Path) -> list[str]:
    """The `gradlab ...` command lines of a page's bash blocks (continuations joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("gradlab ")]


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_tour_commands_parse_and_paste_in_zsh(page):
    """Every `gradlab` command the page prints is accepted by the parser, and a bracketed
    objective list is quoted (zsh, the macOS shell, expands an unquoted one as a glob)."""
    import shlex

    commands = _shell_commands(ROOT / page)
    assert len(commands) >= 3, commands
    for cmd in commands:
        for word in shlex.split(cmd, comments=True, posix=False):
            assert "[" not in word or word[0] in "'\"", (page, cmd)
        argv = shlex.split(cmd, comments=True)[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:  # --version / --help exit 0 after printing
            assert e.code == 0, f"{page}: {cmd!r} is refused by the parser"


def test_docs_references_in_code_name_existing_pages_and_anchors(site):
    """Docstrings, messages and notebooks point at documentation pages (docs/…/page.md#anchor):
    each page exists and each anchor is a heading id on the built page."""
    ref = re.compile(r"docs/([A-Za-z0-9_/.-]+?)\.md(?:#([a-z0-9-]+))?")
    files = [p for d in ("gradlab", "analyses", "examples", "notebooks")
             for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".ipynb")]
    seen = set()
    for f in files:
        for page, anchor in ref.findall(f.read_text()):
            seen.add((page, anchor))
            assert (ROOT / "docs" / f"{page}.md").is_file(), (f.name, page)
            if anchor:
                built = site / (page[: -len("index")] if page.endswith("index") else page + "/") / "index.html"
                assert f'id="{anchor}"' in built.read_text(), (f.name, page, anchor)
    assert len(seen) >= 5


def test_the_project_cites_only_its_own_documentation():
    """No file names a specification the repository does not hold: formulas are referenced by
    their documentation page (docs/concepts/…)."""
    name = "MATH" + ".md"  # spelled in two parts so this file does not match itself
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    hits = [p for p in tracked.stdout.split() if (ROOT / p).is_file()
            and (ROOT / p).suffix in (".py", ".md", ".ipynb", ".yml", ".toml", ".txt", "")
            and name in (ROOT / p).read_text(errors="ignore")]
    assert not hits, hits


def test_pages_opened_from_disk_log_no_console_error(site):
    """A page opened as a file (file://, no server) logs no console error: it loads the search
    index as search/search_index.js (docs/_hooks/gradlab_docs.py writes it); the theme hides
    its search box there, since the browser runs no search worker from disk."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium binary (.ci/run installs it: apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    seen = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        for path in ("index.html", "concepts/modulation/index.html"):
            pg, errors = browser.new_page(), []
            pg.on("console", lambda m, e=errors: e.append(m.text) if m.type == "error" else None)
            pg.on("pageerror", lambda x, e=errors: e.append(str(x)))
            pg.goto((site / path).as_uri(), wait_until="load")
            pg.wait_for_timeout(1000)  # the index script loads after the page
            seen[path] = (errors, pg.inner_text("article")[:200])
        browser.close()
    for path, (errors, text) in seen.items():
        assert not errors and text.strip(), (path, errors)
