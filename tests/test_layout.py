"""The package layout names the architecture: no import circle between gradlab's modules, the
science (gradlab.core) imports neither torch.nn models nor the loop, gradlab/loop is one
sub-package per concern with imports flowing one way (`gradlab.loop.LAYERS`: a module imports
from its own package and the ones before it, lazy imports included), a loop module imports
only from its file, and no file is over ~400 lines."""

import ast
import importlib.util
import sys
from pathlib import Path

import gradlab.loop as loop

PKG = Path(__file__).resolve().parents[1] / "gradlab"
MAX_LINES = 450  # "~400": check.py and integrations/trl.py sit just over 400
LOOP = PKG / "loop"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """gradlab modules `path` imports at module level or inside functions (relative resolved)."""
    name = module_name(path)
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("gradlab"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("gradlab"))
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    g = {}
    for m, p in files.items():
        # edges to modules only (an imported function name is not a module); a package's
        # __init__ re-exports are not an edge from its sub-modules back to it
        g[m] = {t for t in imports(p) if t in files and t != m and not m.startswith(t + ".")}
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t)):
                return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_circle():
    g = graph()
    assert "gradlab.core.objectives" in g and "gradlab.core.dfpo" in g["gradlab.core.objectives"]
    assert find_cycle(g) is None, " → ".join(find_cycle(g))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_is_the_science_only():
    for m, deps in graph().items():
        if m.startswith("gradlab.core"):
            bad = [d for d in deps if not d.startswith("gradlab.core")]
            assert not bad, f"{m} imports {bad}"


def test_no_file_over_the_line_limit():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def upward_imports() -> list[str]:
    """'file (its layer) imports layer' for every loop import against `loop.LAYERS`."""
    rank = {name: i for i, name in enumerate(loop.LAYERS)}
    bad = []
    for path in sorted(LOOP.rglob("*.py")):
        rel = path.relative_to(LOOP)
        if rel == Path("__init__.py"):
            continue
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for target in sorted(imports(path)):
            parts = target.split(".")
            if parts[:2] != ["gradlab", "loop"] or len(parts) < 3:
                continue
            if rank.get(parts[2], len(rank)) > rank.get(own, -1):
                bad.append(f"{rel} ({own}) imports {target}")
    return bad


def test_loop_imports_point_down_the_layers():
    assert not upward_imports(), "imports against gradlab.loop.LAYERS:\n" + "\n".join(upward_imports())


def test_an_upward_import_is_caught():
    bad = LOOP / "rollouts" / "_probe_upward.py"
    bad.write_text("def f():\n    from ..runs.store import load_run\n")
    try:
        assert upward_imports() == ["rollouts/_probe_upward.py (rollouts) imports gradlab.loop.runs.store",
                                    "rollouts/_probe_upward.py (rollouts) imports "
                                    "gradlab.loop.runs.store.load_run"]
    finally:
        bad.unlink()


def test_loop_top_level_is_small_and_each_package_says_its_concern():
    entries = sorted(p.name.removesuffix(".py") for p in LOOP.iterdir() if p.name != "__init__.py"
                     and (p.suffix == ".py" or (p / "__init__.py").exists()))
    assert len(entries) <= 10 and entries == sorted(loop.LAYERS), entries
    for pkg in (p for p in LOOP.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and "Imports" in doc, f"{pkg.name}/__init__.py: no docstring naming its imports"
    long = {str(p.relative_to(LOOP)): n for p in LOOP.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # "~400", as for the rest
    assert not long, long


def test_loop_modules_import_only_from_their_files():
    """gradlab.loop adds no import hook: a name under it that is not a file there (a module of
    a sub-package named without its package) does not import."""
    assert not any(type(f).__module__.startswith("gradlab") for f in sys.meta_path)
    for path in LOOP.rglob("*.py"):
        if path.parent != LOOP and path.name != "__init__.py" and \
                not (LOOP / path.name).exists() and not (LOOP / path.stem).is_dir():
            assert importlib.util.find_spec(f"gradlab.loop.{path.stem}") is None, path


def test_package_data_found_from_the_sub_packages():
    """Paths to gradlab/data come from each module's own file: a deeper folder must not lose
    them (without the shipped policy every run without --model is refused)."""
    from gradlab.loop.recipes.reference import REFERENCE
    from gradlab.loop.setup.policy import DEFAULT_POLICY_DIR, SCAFFOLD_POLICY_DIR

    for p in (DEFAULT_POLICY_DIR, SCAFFOLD_POLICY_DIR, REFERENCE):
        assert p.exists(), p
