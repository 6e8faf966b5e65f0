"""Every notebook runs headless (nbclient) on a fresh tiny run, importing `gradlab` alone."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from gradlab.viz import resolve_run, tiny_run

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_run(tmp_path_factory.mktemp("nb") / "run")
    finally:
        torch.set_num_threads(n)


def test_notebooks_exist_without_outputs_and_import_gradlab_only():
    assert {p.name for p in NOTEBOOKS} >= {"explore.ipynb", "reproduce.ipynb"}
    for p in NOTEBOOKS:
        nb = nbformat.read(p, as_version=4)
        src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "sys.path" not in src and "analyses" not in src, p.name
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, f"{p.name} has outputs"


def test_first_cell_names_the_extra_it_needs():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for p in NOTEBOOKS:
        first = nbformat.read(p, as_version=4).cells[0]
        assert first.cell_type == "markdown", p.name
        named = [e for e in extras if f"pip install -e '.[{e}]'" in first.source]
        assert named, f"{p.name}: the first cell names no extra (pip install -e '.[NAME]')"
        assert any("jupyter" in d for e in named for d in extras[e]), (p.name, named)


def test_run_paths_resolve_relative_to_the_repository(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where a notebook's kernel runs
    assert resolve_run("runs/x") == (tmp_path / "runs" / "x").resolve()
    assert resolve_run(str(tmp_path / "runs" / "x")) == (tmp_path / "runs" / "x").resolve()
    with pytest.raises(FileNotFoundError, match="runs/nope"):
        resolve_run("runs/nope")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, run, monkeypatch):
    monkeypatch.setenv("GRADLAB_RUN", str(run))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits the environment
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 4, f"{path.name}: only {len(images)} figures drawn"
