"""`gradlab view`: the page is self-contained and works in a real headless Chromium (Playwright
driving the system's chromium): no console errors, the token count of a known trace, and a hover
that shows that token's traced W."""

import re
import shutil

import pytest

import gradlab
from gradlab.cli.main import main
from gradlab.loop.config import RunConfig
from gradlab.loop.train import train


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("view")
    train(RunConfig(out=str(d / "run"), objectives=["grpo", "gspo"], steps=2, prompts=2, G=4,
                    minibatches=2, probe_contexts=2, tax_every=1, trace_every=1, progress=False))
    assert main(["view", str(d / "run"), "--out", str(d / "page.html")]) == 0
    return d / "run", d / "page.html"


def test_page_is_self_contained(page_file):
    _, page = page_file
    text = page.read_text()
    assert "<svg" in text and 'id="data"' in text
    # nothing fetched: no external script, stylesheet, image or font (SVG namespace URIs are names)
    assert not re.search(r"(src|href)=\"(https?:)?//", text) and "<link" not in text
    assert "@import" not in text and not re.search(r"url\((?!#)", text)


def test_view_rejects_a_folder_without_a_run(tmp_path, capsys):
    assert main(["view", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_page_in_headless_chromium(page_file):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium binary (.ci/run installs it: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    run, page_path = page_file
    traces = gradlab.load_traces(run)
    at1 = traces[traces["step"] == 1]
    obj, group = (at1["W"] != 0).groupby([at1["objective"], at1["group"]]).sum().idxmax()
    known = at1[(at1["objective"] == obj) & (at1["group"] == group)]
    known = known.sort_values(["row", "position"]).reset_index(drop=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            pg = browser.new_page()
            errors = []
            pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.goto(page_path.as_uri())
            pg.select_option("#objective", obj)
            pg.select_option("#step", "1")
            pg.select_option("#group", str(int(group)))
            assert pg.locator("#strips .tok").count() == len(known)
            assert pg.inner_text("#count") == f"{len(known)} tokens"
            k = int(known.index[known["W"] != 0][-1])  # a token with a non-zero W
            pg.hover(f"#strips .tok >> nth={k}")
            detail = pg.inner_text("#detail")
            by_w = pg.locator("#strips .tok").evaluate_all("ts => ts.map(t => t.style.background)")
            pg.select_option("#colourby", "A")  # the advantage: one sign per row here
            by_a = pg.locator("#strips .tok").evaluate_all("ts => ts.map(t => t.style.background)")
        finally:
            browser.close()
    assert not errors, errors
    assert len(by_a) == len(by_w) == len(known)
    m = at1[at1["objective"] == obj]["A"].abs().max()  # the scale: the objective's step

    def alpha(c):  # "rgb(r, g, b)" is alpha 1
        return 1.0 if c.startswith("rgb(") else float(c.rstrip(")").split(",")[-1])

    want = (known["A"].abs() / m).clip(upper=1).to_numpy()
    assert [alpha(c) for c in by_a] == pytest.approx(want, abs=2e-3)
    red = [c.startswith(("rgb(214", "rgba(214")) for c in by_a]  # A ≥ 0 red, A < 0 blue
    assert red == [bool(a >= 0) for a in known["A"]]
    row = known.iloc[k]
    assert f"row {row['row']}  position {row['position']}" in detail
    w = float(re.search(r"W = (\S+)", detail).group(1))
    assert w == pytest.approx(float(row["W"]), rel=1e-5) and w != 0
    wc = float(re.search(r"W closed form = (\S+)", detail).group(1))
    assert wc == pytest.approx(float(row["W_closed"]), rel=1e-5)


def test_page_of_a_tied_run_says_undefined_never_zero(tmp_path):
    """Every group tied (a task no response solves): the page's table has "—" with the reason
    for ρ and the tax share, never a 0 cell, and the ρ panel says why it is empty."""
    task = tmp_path / "never.jsonl"
    task.write_text('{"prompt": "3+4=?", "answer": "never"}\n{"prompt": "1+2=?", "answer": "never"}\n')
    train(RunConfig(out=str(tmp_path / "run"), objectives=["grpo"], steps=1, prompts=2, G=4,
                    minibatches=1, probe_contexts=2, tax_every=1, trace_every=1,
                    progress=False, task=str(task)))
    assert main(["view", str(tmp_path / "run"), "--out", str(tmp_path / "p.html")]) == 0
    text = (tmp_path / "p.html").read_text()
    table = text[text.index('<table id="summary">'):text.index("</table>")]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", table)
    assert cells[0] == "grpo" and cells[1] == "0"  # reward 0: measured
    assert cells[3:] == ["—²", "—²", "—²"], cells  # ρ trie, ρ full-group, tax share
    assert table.count('title="no gradient: every group tied"') == 3
    assert "—² undefined (no gradient: every group tied)" in text
    assert "undefined at every step" in text  # the empty ρ panel of the curves says why


USER_INSTRUMENT = '''
import gradlab.instruments as gi


class AbsW(gi.Instrument):
    name = "abs_w_probe"
    needs = frozenset({"W", "batch"})
    curves = (("abs_w_mean", "mean |W| per response token"),
              ("abs_w_per_empty", "|W| per empty cell"))

    def measure(self, view):
        m = view.batch.mask
        return gi.Readings(sums={"abs_w_sum": (view.W.abs() * m).sum(), "abs_w_tokens": m.sum(),
                                 "abs_w_empty": (m * 0).sum()})

    def quantities(self):
        return [gi.Ratio("abs_w_mean", "abs_w_sum", "abs_w_tokens", "no response token",
                         unit="W per token"),
                gi.Ratio("abs_w_per_empty", "abs_w_sum", "abs_w_empty",
                         "the empty cell holds no token", unit="W per cell")]
'''


def test_view_draws_a_user_instrument_from_the_manifest_alone(tmp_path):
    """An instrument in a file of its own, measured by `gradlab run --instruments file:Class`;
    the file is deleted before viewing: the page titles its curves with their units and says
    why one is undefined, and the run store gives that reason — all from instruments.json."""
    import subprocess
    import sys

    import numpy as np

    from gradlab.loop.runs.store import load_run

    mod = tmp_path / "abs_w_probe_mod.py"
    mod.write_text(USER_INSTRUMENT)
    run = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "gradlab", "run", "grpo", "--out", str(run),
                    "--steps", "2", "--prompts", "2", "--G", "4", "--minibatches", "1",
                    "--eval-every", "0", "--probe-contexts", "2", "--no-progress",
                    "--instruments", f"cheap,{mod}:AbsW"], check=True, cwd=tmp_path)
    mod.unlink()
    assert "abs_w_probe_mod" not in sys.modules  # this process never imported it
    assert main(["view", str(run), "--out", str(tmp_path / "p.html")]) == 0
    page = (tmp_path / "p.html").read_text()
    assert "mean |W| per response token [W per token]" in page
    assert "|W| per empty cell [W per cell] — undefined (the empty cell holds no token)" in page
    tidy = load_run(run)
    mean = tidy[tidy["metric"] == "abs_w_mean"]
    empty = tidy[tidy["metric"] == "abs_w_per_empty"]
    assert len(mean) == len(empty) == 2 and np.isfinite(mean["value"]).all()
    assert empty["value"].isna().all()
    assert (empty["undefined"] == "the empty cell holds no token").all()


def test_view_of_a_run_without_its_manifest_says_how_to_remake_it(page_file, tmp_path, capsys):
    run, _ = page_file
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("instruments.json", "*.lock"))
    assert main(["view", str(bare), "--out", str(tmp_path / "p.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bare / "instruments.json") in err
    assert f"python -m gradlab.loop.recipes.manifest {bare}" in err
    from gradlab.loop.recipes.manifest import remake

    remake(bare)  # the command the message names
    assert (bare / "instruments.json").read_text() == (run / "instruments.json").read_text()
    assert main(["view", str(bare), "--out", str(tmp_path / "p.html")]) == 0
