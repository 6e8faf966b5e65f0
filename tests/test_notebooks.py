"""Every notebook runs headless (nbclient) on a tiny run and no cell errors."""

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    import torch

    from analyses.common import tiny_run

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_run(tmp_path_factory.mktemp("nb") / "run")
    finally:
        torch.set_num_threads(n)


def test_notebooks_exist_without_outputs():
    assert {p.name for p in NOTEBOOKS} >= {"explore.ipynb", "reproduce.ipynb"}
    for p in NOTEBOOKS:
        nb = nbformat.read(p, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, f"{p.name} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tiny_run, monkeypatch):
    monkeypatch.setenv("GRADLAB_RUN", str(tiny_run))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits the environment
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
