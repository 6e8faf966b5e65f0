"""Read a run and plot it: accuracy (training and held-out) and the cancellation ratio per
objective.

`gradlab.load_run(folder)` returns one tidy table — run, objective, seed, step, tokens, metric,
value, and the reason where a value is undefined — for a run of gradlab's loop or of the TRL integration; `gradlab.viz.training_curves`
draws it with seaborn (one colour and dash per objective, so curves that coincide stay visible;
ρ on a log axis, with float round-off shaded). Without `--run` this script first trains a short
tandem of GSPO and DFPO (Min-Replace) from the shipped tiny policy. The figure goes to
RUN/plot.png unless --out says otherwise.

    python examples/plot_run.py --run runs/reproduce              # runs/reproduce/plot.png
    python examples/plot_run.py --steps 4 --out /tmp/plot.png      # trains runs/plot-example once
"""

import argparse
from pathlib import Path

import gradlab
from gradlab.loop.config import RunConfig
from gradlab.loop.train import train
from gradlab.viz import save, training_curves
from gradlab.viz.undefined import text_table

PANELS = [("accuracy", "training accuracy"), ("rho_prefix", "cancellation ratio ρ (full-group nodes)")]


def main(run: str | None, out: str | None, steps: int) -> None:
    if run is None:
        run = "runs/plot-example"
    if not Path(run, "metrics.jsonl").exists():  # train it once; later calls reuse it
        train(RunConfig(out=run, objectives=["gspo", "dfpo-min"], steps=steps, prompts=4, G=4,
                        minibatches=2, eval_every=max(steps // 2, 1), trace_every=0,
                        progress=False, threads=1))
    df = gradlab.load_run(run)
    out = out or str(Path(run) / "plot.png")
    save(training_curves(df, PANELS, x="step"), out)
    wide = gradlab.load_run(run, wide=True)
    last = wide[wide["step"] == wide["step"].max()]  # an undefined ρ prints "—" and why
    print(text_table(last, ["objective", "accuracy", "rho_prefix"], fmt=lambda x: f"{x:.10g}"))
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="a run folder to draw (default: the example's own run, "
                   "runs/plot-example, trained once)")
    p.add_argument("--out", default=None, help="PNG file to write (default RUN/plot.png)")
    p.add_argument("--steps", type=int, default=20, help="rollout steps of the tandem it trains")
    a = p.parse_args()
    if a.run is not None and not Path(a.run, "metrics.jsonl").exists():
        p.error(f"--run {a.run}: no run there (no metrics.jsonl); train one first (e.g. "
                "gradlab reproduce), or leave --run out for the example's own run")
    main(a.run, a.out, a.steps)
