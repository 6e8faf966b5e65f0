"""The analyses package: every script is a module of one sub-package, run with
`python -m analyses.<folder>.<name>` from the repository root, and no script edits sys.path;
every analyses command or path the pages print names a module or file that exists."""

import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANALYSES = ROOT / "analyses"
FOLDERS = ("benchmarks", "figures", "studies", "tools")
MODULE = re.compile(r"python\s+-m\s+(analyses(?:\.\w+)+)")
PATH = re.compile(r"\b(analyses/[\w/]+\.(?:py|sh|md))\b")


def _pages() -> list[Path]:
    """The pages a reader copies commands from (the other figures/*.md end in the stamp of the
    command that made them, a record of the past)."""
    written = [ROOT / "figures" / f for f in ("README.md", "bench_scale.md", "real_trl.md",
                                                "real_trl_cost.md")]
    return [ROOT / "README.md", *written, *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_script_sits_in_a_subpackage_and_leaves_sys_path_alone():
    assert sorted(p.name for p in ANALYSES.iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(FOLDERS)
    assert {p.name for p in ANALYSES.iterdir() if p.is_file()} == {"__init__.py"}
    for folder in FOLDERS:
        init = ANALYSES / folder / "__init__.py"
        assert init.is_file() and importlib.import_module(f"analyses.{folder}").__doc__, folder
    scripts = sorted(ANALYSES.rglob("*.py"))
    assert len(scripts) >= 30
    for p in scripts:
        text = p.read_text()
        assert "sys.path" not in text, f"{p.relative_to(ROOT)} edits sys.path"
        assert not re.search(r"^\s*(from|import) (common|comparisons|quoted\w*|bench_\w+|real_vocab_run|test_\w+)\b",
                             text, re.M), f"{p.relative_to(ROOT)}: a sibling imported by bare name"


def test_every_module_imports_as_a_package_module():
    """Importing runs no script (each waits for `__main__`) and resolves every package import."""
    for p in sorted(ANALYSES.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if p.name == "__init__.py" else parts)
        assert importlib.import_module(name).__file__ == str(p), name


def test_every_analyses_command_and_path_in_the_pages_exists():
    seen = set()
    for page in _pages():
        text = page.read_text()
        for mod in MODULE.findall(text):
            seen.add(mod)
            assert importlib.util.find_spec(mod) is not None, f"{page.relative_to(ROOT)}: {mod}"
            assert (ANALYSES.parent / (mod.replace(".", "/") + ".py")).is_file(), (page.name, mod)
        for path in PATH.findall(text):
            seen.add(path)
            assert (ROOT / path).is_file(), f"{page.relative_to(ROOT)}: {path}"
    assert len(seen) >= 20, seen
