"""Read a run and plot it with seaborn: accuracy and the cancellation ratio per objective.

`gradlab.load_run(folder)` returns one tidy table — run, objective, seed, step, tokens, metric,
value — for a run of gradlab's loop or of the TRL integration. Without `--run` this script first
trains a short tandem of GSPO and DFPO (Min-Replace) from the shipped tiny policy.

    python examples/plot_run.py --run runs/reproduce --out plot.png
    python examples/plot_run.py --steps 4 --out /tmp/plot.png      # trains runs/plot-example once
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

import gradlab  # noqa: E402
from gradlab.loop.config import RunConfig  # noqa: E402
from gradlab.loop.train import train  # noqa: E402


def main(run: str | None, out: str, steps: int) -> None:
    if run is None:
        run = "runs/plot-example"
    if not Path(run, "metrics.jsonl").exists():  # train it once; later calls reuse it
        train(RunConfig(out=run, objectives=["gspo", "dfpo-min"], steps=steps, prompts=4, G=4,
                        minibatches=2, eval_every=0, trace_every=0, progress=False))
    df = gradlab.load_run(run)
    df = df[df["metric"].isin(["accuracy", "rho_prefix"])].copy()
    last = df[df["step"] == df["step"].max()].pivot_table(index="objective", columns="metric",
                                                          values="value")
    rho = df["metric"] == "rho_prefix"   # 0 and float round-off (~1e-8) drawn at the 1e-9 floor
    df.loc[rho, "value"] = df.loc[rho, "value"].clip(lower=1e-9)
    grid = sns.relplot(data=df, x="step", y="value", hue="objective", col="metric",
                       kind="line", marker="o", facet_kws={"sharey": False}, height=3, aspect=1.3)
    grid.axes.flat[1].set_yscale("log")   # ρ spans round-off (~1e-8) to ~0.3
    grid.set_titles("{col_name}")
    grid.savefig(out, dpi=120)
    plt.close("all")
    print(last.to_string())                     # the last step's values, as stored
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="run folder (default runs/plot-example; trained if it holds no run)")
    p.add_argument("--out", default="plot.png", help="PNG file to write")
    p.add_argument("--steps", type=int, default=20, help="rollout steps of the tandem it trains")
    a = p.parse_args()
    main(a.run, a.out, a.steps)
