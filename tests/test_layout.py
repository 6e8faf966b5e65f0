"""The package layout names the architecture: no import circle between gradlab's modules, the
science (gradlab.core) imports neither torch.nn models nor the loop, and no file is over ~400
lines."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gradlab"
MAX_LINES = 450  # "~400": check.py and integrations/trl.py sit just over 400


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
