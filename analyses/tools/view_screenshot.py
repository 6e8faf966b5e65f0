"""figures/view.png: `gradlab view` of a real (small) tandem run, screenshotted in headless
Chromium (the system's chromium, driven by Playwright).

    python -m analyses.tools.view_screenshot                   # trains runs/view-demo if missing
    python -m analyses.tools.view_screenshot --run runs/reproduce
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from analyses.tools.common import FIGURES, ROOT, set_threads
from gradlab.loop.config import RunConfig
from gradlab.loop.runs.traces import load_traces
from gradlab.viz.html import view

DEMO = dict(steps=8, prompts=4, G=4, minibatches=2, probe_contexts=4, tax_every=4, trace_every=2,
            ckpt_every=8, progress=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=str(ROOT / "runs" / "view-demo"))
    p.add_argument("--out", default=str(FIGURES / "view.png"))
    p.add_argument("--objective", default="gspo")
    a = p.parse_args(argv)
    set_threads(1)
    run = Path(a.run)
    if not (run / "metrics.jsonl").exists():
        from gradlab.loop.train import train

        train(RunConfig(out=str(run), **DEMO))
    page = view(run, run / "view.html")
    # shown: the latest traced (step, group) of the objective with mixed rewards (W ≠ 0)
    t = load_traces(run, objective=a.objective)
    live = t[t["A"] != 0]
    step, group = live.sort_values(["step", "group"]).iloc[-1][["step", "group"]].astype(int)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        pg = b.new_page(viewport={"width": 1100, "height": 800})
        pg.goto(page.as_uri())
        pg.select_option("#objective", a.objective)
        pg.select_option("#step", str(step))
        pg.select_option("#group", str(group))
        pg.hover("#strips .tok >> nth=14")
        top = pg.evaluate("document.querySelectorAll('h2')[1].getBoundingClientRect().top"
                          " + window.scrollY")
        bottom = pg.evaluate("document.getElementById('detail').getBoundingClientRect().bottom"
                             " + window.scrollY")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=a.out, full_page=True, clip={"x": 0, "y": top - 8, "width": 1100,
                                                        "height": bottom - top + 20})
        b.close()
    print(f"wrote {a.out} from {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
