"""Every ```python block of the own-loss guide and the loss contract runs as written, from a
folder holding examples/my_losses.py (its folder on the path, as the guide says); the contract's
loss file is examples/my_losses.py itself; functions named test_* in a block are called."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/guides/own-loss.md", "docs/guides/loss-contract.md")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(page: str) -> list[str]:
    return FENCE.findall((ROOT / page).read_text())


def test_the_contract_ships_the_example_file_verbatim():
    assert blocks("docs/guides/loss-contract.md")[0] == (ROOT / "examples/my_losses.py").read_text()
    assert "loss-contract.md" in (ROOT / "docs/guides/own-loss.md").read_text()
    assert "guides/loss-contract.md" in (ROOT / "mkdocs.yml").read_text()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A user's folder: examples/my_losses.py copied in, its folder on sys.path."""
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples/my_losses.py", tmp_path / "examples/my_losses.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "examples"))
    monkeypatch.delitem(sys.modules, "my_losses", raising=False)
    yield tmp_path
    torch.set_num_threads(1)


def _record_baseline_as_documented(page: str) -> None:
    """The CI recipe's one-time step: the page's own `gradlab check ... --update` line, run."""
    import shlex
    import subprocess

    line = next(ln for ln in (ROOT / page).read_text().splitlines()
                if ln.startswith("gradlab check --loss") and "--update" in ln)
    (Path.cwd() / "tests").mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "gradlab", *shlex.split(line)[1:]],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("page,k", [(p, k) for p in PAGES for k in range(len(blocks(p)))])
def test_snippet_runs(workdir, page, k, capsys):
    ns: dict = {"__name__": f"snippet_{k}"}
    if "assert_matches_baseline(" in blocks(page)[k]:
        _record_baseline_as_documented(page)
    exec(compile(blocks(page)[k], f"{page}[{k}]", "exec"), ns)
    tests = [f for name, f in ns.items() if name.startswith("test_") and callable(f)]
    for f in tests:
        f()
    if "Qwen3Config" in blocks(page)[k]:  # the probes snippet: its printed ρ is round-off
        rho = float(re.search(r"rho (\S+),", capsys.readouterr().out).group(1))
        assert rho < 1e-6 and ns["W"].abs().max() > 0
    if "RunConfig" in blocks(page)[k]:  # the run from Python: both objectives, one thread
        rec = [json.loads(x) for x in ns["rows"].read_text().splitlines()]
        assert {(r["objective"], r["step"]) for r in rec} == {
            (o, s) for o in ("dr_grpo", "grpo") for s in (0, 1)}
        assert json.loads((ns["store"].path / "config.json").read_text())["threads"] == 1
