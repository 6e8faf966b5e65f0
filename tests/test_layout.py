"""The package layout names the architecture, checked on the source with `ast` (imports inside
functions included):

- no import circle among the modules of gradlab/ and analyses/;
- no private name (`_name`) imported, or read as `module._name`, from a module of another
  package folder (between the modules of one folder it is their own business);
- the science (gradlab.core) imports nothing else of gradlab; gradlab.probes and
  gradlab.instruments import nothing from gradlab.loop (the loop runs them, not the reverse);
- an integration runs the instruments and imports no measuring module itself;
- gradlab/loop is one sub-package per concern with imports flowing one way
  (`gradlab.loop.LAYERS`: a module imports from its own package and the ones before it);
- a loop module imports only from its file (no import hook);
- no function takes 7 or more positional parameters (self/cls not counted): past the first few,
  parameters are keyword-only (after a `*`) or travel together in a dataclass.

Run as a script (`python tests/test_layout.py`) it prints every finding at once."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

import gradlab.loop as loop

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gradlab"
LOOP = PKG / "loop"
TOPS = ("gradlab", "analyses")
# the modules that measure: an integration hands its step to the instruments, which call them
MEASURING = ("gradlab.probes.tax", "gradlab.probes.drift", "gradlab.probes.flips",
             "gradlab.probes.fisher", "gradlab.probes.residuals", "gradlab.probes.variance")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name → file, for every .py under root/gradlab and root/analyses."""
    out = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_lines(name: str, path: Path) -> list[tuple[str, str | None, str, int]]:
    """(module, imported name or None, the local name it binds, line) for each gradlab/analyses
    import in the file of module `name`, at module level or inside a function; relative imports
    resolved. `from M import n as k` gives (M, n, k), `import a.b` gives (a.b, None, a),
    `import a.b as k` gives (a.b, None, k)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] in TOPS:
                out += [(base, a.name, a.asname or a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None, a.asname or a.name.split(".")[0], node.lineno)
                    for a in node.names if a.name.split(".")[0] in TOPS]
    return out


def imported_names(name: str, path: Path) -> set[str]:
    """Dotted names the module imports: each module, and module.name for each `from` name."""
    return {t for base, n, _, _ in import_lines(name, path) for t in (base, f"{base}.{n}" if n else base)}


def graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module → the modules it imports (a `from` name that is a module counts as that module;
    the package a `from` names counts too: its __init__ runs). A package's __init__ is not an
    edge from its own sub-modules back to it."""
    files = modules() if files is None else files
    g = {}
    for m, p in files.items():
        deps = imported_names(m, p)
        g[m] = {t for t in deps if t in files and t != m and not m.startswith(t + ".")}
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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(files: dict[str, Path] | None = None, root: Path = ROOT) -> list[str]:
    """'file:line: what' for each private name taken from a module of another folder: `from M
    import _n`, or `M._n` read through a name bound to module M (`import a.b as M`, `from a
    import M`, `import a.b` then `a.b._n`)."""
    files = modules(root) if files is None else files
    bad = []
    for m, p in sorted(files.items()):
        where = p.relative_to(root)
        bound = {}  # local name → the module it is bound to
        for base, n, local, line in import_lines(m, p):
            if n is None:
                bound[local] = base if local != base.split(".")[0] else local
            elif f"{base}.{n}" in files:
                bound[local] = f"{base}.{n}"
            if n and _private(n) and base in files and files[base].parent != p.parent:
                bad.append(f"{where}:{line}: from {base} import {n}")
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, v = [], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in bound:
                owner = ".".join([bound[v.id], *reversed(chain)])
                if owner in files and files[owner].parent != p.parent:
                    bad.append(f"{where}:{node.lineno}: {owner}.{node.attr}")
    return bad


def _origin(files: dict[str, Path], module: str, name: str) -> str:
    """The module a name imported from `module` comes from: a package's __init__ re-export is
    followed to the module that defines it."""
    if f"{module}.{name}" in files:
        return f"{module}.{name}"
    path = files.get(module)
    if path is not None and path.name == "__init__.py":
        for base, n, _, _ in import_lines(module, path):
            if n == name and base != module:
                return _origin(files, base, name)
    return module


def imports_of(prefixes: tuple[str, ...], targets, files: dict[str, Path] | None = None,
               root: Path = ROOT) -> list[str]:
    """'file:line imports T' for each module under `prefixes` importing a module T that
    `targets(T)` accepts (a package's re-exported names followed to their module)."""
    files = modules(root) if files is None else files
    bad = []
    for m, p in sorted(files.items()):
        if not m.startswith(prefixes):
            continue
        for base, n, _, line in import_lines(m, p):
            for t in {base, _origin(files, base, n) if n else base}:
                if t != m and targets(t):
                    bad.append(f"{p.relative_to(root)}:{line} imports {t}")
    return sorted(set(bad))


def loop_imports_below_the_loop(files=None, root: Path = ROOT) -> list[str]:
    return imports_of(("gradlab.probes", "gradlab.instruments"),
                      lambda t: t == "gradlab.loop" or t.startswith("gradlab.loop."), files, root)


def measuring_imports_in_integrations(files=None, root: Path = ROOT) -> list[str]:
    return imports_of(("gradlab.integrations",), lambda t: t in MEASURING, files, root)


def _tree(tmp_path: Path, sources: dict[str, str]) -> dict[str, Path]:
    """A throwaway source tree: {'gradlab/a/b.py': text}; every folder gets an __init__."""
    for rel, text in sources.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in [*reversed(path.relative_to(tmp_path).parents)][1:]:
            (tmp_path / d / "__init__.py").touch()
        path.write_text(text)
    return modules(tmp_path)


def test_no_import_circle():
    g = graph()
    assert "gradlab.core.objectives" in g and "gradlab.core.dfpo" in g["gradlab.core.objectives"]
    assert "analyses.figures.real_trl_figure" in g
    assert find_cycle(g) is None, " → ".join(find_cycle(g))


def test_the_cycle_finder_finds_one(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # through a function-level import, across gradlab and analyses
    files = _tree(tmp_path, {"gradlab/x.py": "def f():\n    from analyses.y import g\n",
                             "analyses/y.py": "import gradlab.x\n"})
    assert find_cycle(graph(files)) == ["analyses.y", "gradlab.x", "analyses.y"]


def test_no_private_name_crosses_a_package():
    assert not private_imports(), "\n".join(private_imports())


def test_a_private_name_across_packages_is_caught(tmp_path):
    files = _tree(tmp_path, {
        "gradlab/a/m.py": "def _h(): pass\n",
        "gradlab/a/same.py": "from .m import _h\n",  # the same folder: allowed
        "gradlab/b/n.py": "def f():\n    from ..a.m import _h\n",
        "gradlab/b/o.py": "from gradlab.a import m\nm._h()\n",
        "gradlab/b/p.py": "import gradlab.a.m as mm\nmm.__name__\nmm._h\n",
        "gradlab/b/q.py": "from gradlab.a.m import __doc__, h as _h\n"})  # not private
    assert private_imports(files, tmp_path) == ["gradlab/b/n.py:2: from gradlab.a.m import _h",
                                                "gradlab/b/o.py:2: gradlab.a.m._h",
                                                "gradlab/b/p.py:3: gradlab.a.m._h"]


def test_core_is_the_science_only():
    for m, deps in graph().items():
        if m.startswith("gradlab.core"):
            bad = [d for d in deps if not d.startswith("gradlab.core")]
            assert not bad, f"{m} imports {bad}"


def test_probes_and_instruments_import_nothing_from_the_loop():
    assert not loop_imports_below_the_loop(), "\n".join(loop_imports_below_the_loop())


def test_a_probe_importing_the_loop_is_caught(tmp_path):
    files = _tree(tmp_path, {"gradlab/loop/faults/w.py": "", "gradlab/loop/runs.py": "",
                             "gradlab/probes/p.py": "def f():\n    from ..loop.faults.w import g\n",
                             "gradlab/instruments/i.py": "from gradlab.loop import runs\n",
                             "gradlab/viz/v.py": "from gradlab.loop import runs\n"})
    assert loop_imports_below_the_loop(files, tmp_path) == [
        "gradlab/instruments/i.py:1 imports gradlab.loop",
        "gradlab/instruments/i.py:1 imports gradlab.loop.runs",
        "gradlab/probes/p.py:2 imports gradlab.loop.faults.w"]


def test_integrations_import_no_measuring_module():
    assert not measuring_imports_in_integrations(), "\n".join(measuring_imports_in_integrations())


def test_a_measuring_import_in_an_integration_is_caught(tmp_path):
    files = _tree(tmp_path, {"gradlab/probes/__init__.py": "from .tax import learning_tax\n",
                             "gradlab/probes/tax.py": "", "gradlab/probes/modulation.py": "",
                             "gradlab/integrations/verl/a.py":
                                 "from gradlab.probes import learning_tax\n"
                                 "from gradlab.probes.modulation import P\n"})
    assert measuring_imports_in_integrations(files, tmp_path) == [
        "gradlab/integrations/verl/a.py:1 imports gradlab.probes.tax"]


def upward_imports() -> list[str]:
    """'file (its layer) imports layer' for every loop import against `loop.LAYERS`."""
    rank = {name: i for i, name in enumerate(loop.LAYERS)}
    bad = []
    for m, path in modules().items():
        if not m.startswith("gradlab.loop."):
            continue
        rel = path.relative_to(LOOP)
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for target in sorted(imported_names(m, path)):
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


def test_loop_modules_import_only_from_their_files():
    """gradlab.loop adds no import hook: a name under it that is not a file there (a module of
    a sub-package named without its package) does not import."""
    assert not any(type(f).__module__.startswith("gradlab") for f in sys.meta_path)
    for path in LOOP.rglob("*.py"):
        if path.parent != LOOP and path.name != "__init__.py" and \
                not (LOOP / path.name).exists() and not (LOOP / path.stem).is_dir():
            assert importlib.util.find_spec(f"gradlab.loop.{path.stem}") is None, path


@pytest.mark.parametrize("cmd", ["check", "doctor"])
def test_the_long_help_of_a_command_finds_its_module(cmd, capsys):
    """`gradlab check --help` and `gradlab doctor --help` print their module's help (the module
    path follows the folders); `python -m gradlab.check` has its entry point."""
    from gradlab.cli.main import main

    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0 and f"usage: gradlab {cmd}" in capsys.readouterr().out
    assert importlib.util.find_spec("gradlab.check.__main__") is not None


MAX_POSITIONAL = 6


def long_signatures(files: dict[str, Path] | None = None) -> list[str]:
    """'module.function (n): p1, p2, …' for every function (methods and nested ones included)
    taking more than MAX_POSITIONAL positional parameters, self/cls not counted."""
    out = []
    for name, path in (files or modules()).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in node.args.posonlyargs + node.args.args]
            if params[:1] in (["self"], ["cls"]):
                params = params[1:]
            where = f"{name}.{node.name}"
            if len(params) > MAX_POSITIONAL:
                out.append(f"{where} ({len(params)}): {', '.join(params)}")
    return out


def test_no_function_takes_seven_positional_parameters():
    assert long_signatures() == []


def test_a_long_signature_is_caught(tmp_path):
    files = _tree(tmp_path, {"gradlab/a/b.py": (
        "def f(a, b, c, d, e, g, h=1):\n    pass\n\n\n"
        "def ok(a, b, c, d, e, g, *, h=1):\n    pass\n\n\n"
        "class C:\n    def m(self, a, b, c, d, e, g):\n        pass\n\n"
        "    def n(self, a, b, c, d, e, g, h):\n        pass\n")})
    assert long_signatures(files) == ["gradlab.a.b.f (7): a, b, c, d, e, g, h",
                                      "gradlab.a.b.n (7): a, b, c, d, e, g, h"]


def test_package_data_found_from_the_sub_packages():
    """Paths to gradlab/data come from each module's own file: a deeper folder must not lose
    them (without the shipped policy every run without --model is refused)."""
    from gradlab.loop.recipes.reference import REFERENCE
    from gradlab.loop.setup.policy import DEFAULT_POLICY_DIR, SCAFFOLD_POLICY_DIR

    for p in (DEFAULT_POLICY_DIR, SCAFFOLD_POLICY_DIR, REFERENCE):
        assert p.exists(), p


if __name__ == "__main__":
    g = graph()
    for title, found in (("import circle", [" → ".join(find_cycle(g) or [])] if find_cycle(g) else []),
                         ("private names across packages", private_imports()),
                         ("probes/instruments → loop", loop_imports_below_the_loop()),
                         ("integrations → measuring modules", measuring_imports_in_integrations()),
                         ("loop layers", upward_imports()),
                         ("7+ positional parameters", long_signatures())):
        print(f"{title}: {len(found)}", *found, sep="\n  ")
