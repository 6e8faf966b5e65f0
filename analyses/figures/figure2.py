"""Figure 2 from a real measured step: does the shared-token gradient of one group cancel?

One rollout of the shipped tiny policy (prompts × G responses, fixed generator) is cut into two
minibatches as in the training loop; one AdamW step (lr 2e-4, GRPO loss) on the first makes the
second off-policy. On the second minibatch each panel's loss is built and backpropagated, and a
`ModulationProbe` hook on the real (B, T) log-prob tensor records W = −∂loss/∂l. One group of
it is drawn: tokens shared by the whole group blue, by a subset light blue, divergent orange,
the measured W under each token, and Σ_i W_{i,t} at the full-group shared positions, summed
from the hook's W (nothing is drawn from a closed form).

Group choice (a rule, not a pick): the first group of the second minibatch with mixed rewards,
at least one full-group shared token, at least one divergent token (not all responses
duplicated) and no GRPO clip active on its rows ("no clip active").

    python -m analyses.figures.figure2            # → figures/figure2.png, figures/figure2.csv
    python -m analyses.figures.figure2 --quick --out /tmp/f2.png

Drawing: `gradlab.viz.token_strips` (the same strips `gradlab view` and the explore notebook
draw from a run's token traces), with the caption of docs/concepts/dfpo.md#one-gradient-for-every-transform-at-full-group-nodes under the strips.

Data (figure2.csv): one row per (panel, row, position): panel, objective, row, position,
token_id, char, shared ("full" | "subset" | "none"), W, advantage, reward, text, clip_frac.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from analyses.tools.common import FIGURES, set_threads
from gradlab import objectives
from gradlab.core.batch import advantages
from gradlab.core.cancellation import attribution, cancellation
from gradlab.core.nodes import shared_nodes
from gradlab.loop.rollouts.rollout import generate
from gradlab.testing import measure_on_model, optimizer_step_on
from gradlab.viz.strips import CAPTION, group_sums, token_strips

PANELS = [  # (title, objective name, parameters)
    ("(a) GRPO, constant normalisation", "grpo", {"norm": "const"}),
    ("(b) GSPO", "gspo", {}),
    ("(c) DFPO Min-Replace", "dfpo-min", {}),
    ("(d) DFPO Orth-Proj", "dfpo-orth", {}),
]


def off_policy_step(model, tok, task, prompts: int, *, G: int, seed: int, lr: float):
    """Rollout → step on minibatch 1 → (stepped model, rollout, advantages, rows of minibatch 2)."""
    problems = task.problems(prompts, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ro = generate(model, tok, problems, G, task.max_new_tokens, 1.0, generator=g, task=task)
    adv = advantages(ro.rewards, ro.group)
    half = max(1, prompts // 2)
    first, second = (ro.group < half).nonzero()[:, 0], (ro.group >= half).nonzero()[:, 0]
    stepped = copy.deepcopy(model)
    optimizer_step_on(stepped, ro, first, adv, objectives.get("grpo", norm="const").loss, lr=lr)
    return stepped, ro, adv, second


def pick_group(W_grpo: torch.Tensor, batch, ro, rows: torch.Tensor) -> int:
    """The group label chosen by the rule of the module docstring (ValueError if none fits)."""
    grpo = objectives.get("grpo", norm="const")
    W_noclip = grpo.modulation(batch, off=("clip",))
    full = shared_nodes(batch, "prefix").node >= 0
    divergent = (shared_nodes(batch, "trie").node < 0) & batch.mask
    for g in batch.group.unique(sorted=True).tolist():
        m = batch.group == g
        mixed = ro.rewards[rows][m].unique().numel() > 1
        clipped = bool(((W_grpo[m] == 0) & (W_noclip[m] != 0)).any())
        if mixed and bool(full[m].any()) and bool(divergent[m].any()) and not clipped:
            return g
    raise ValueError("figure2: no group with mixed rewards, a shared prefix, a divergent token "
                     "and no GRPO clip; try another --seed or a larger --prompts")


def measure_panels(stepped, ro, rows: torch.Tensor, adv: torch.Tensor, panels=PANELS):
    """Hook-measured W of each panel's loss on `rows` of rollout `ro` under policy `stepped`.

    Returns (W {title: (R, T) float32}, clip fraction {title: float}, the TokenBatch).
    """
    Ws, clips = {}, {}
    for title, name, params in panels:
        obj = objectives.get(name, **params)
        Ws[title], batch = measure_on_model(stepped, ro, rows, adv, obj.loss)
        clips[title] = float(obj.stats(batch)["clip_frac"])
    return Ws, clips, batch


def token_frame(tok, ro, rows, batch, *, Ws: dict, clips: dict, g: int,
                panels=PANELS) -> pd.DataFrame:
    """The figure2.csv frame (module docstring) of group label g of `batch`; attrs carry ρ of
    the group per panel and the prompt."""
    keep = (batch.group == g).nonzero()[:, 0]
    full = shared_nodes(batch, "prefix").node >= 0
    trie = shared_nodes(batch, "trie").node >= 0
    recs = []
    for title, name, _ in panels:
        for i, r in enumerate(keep.tolist()):
            for t in range(int(batch.mask[r].sum())):
                tid = int(batch.tokens[r, t])
                recs.append({
                    "panel": title, "objective": name, "row": i, "position": t,
                    "token_id": tid, "char": _char(tok, tid),
                    "shared": "full" if full[r, t] else "subset" if trie[r, t] else "none",
                    "W": float(Ws[title][r, t]), "advantage": float(batch.advantages[r]),
                    "reward": float(ro.rewards[rows[r]]), "text": ro.texts[int(rows[r])],
                    "clip_frac": clips[title]})
    df = pd.DataFrame(recs)
    own = batch.rows(keep)  # the group's own batch, every per-row field
    df.attrs["rho"] = {t: cancellation(Ws[t][keep], own, "prefix").ratio
                       for t, _, _ in panels}
    df.attrs["prompt"] = ro.problems[int(rows[keep[0]])].prompt
    # share of the group's residual each mechanism accounts for (closed form, docs/concepts/shared-nodes.md#attribution)
    df.attrs["attribution"] = {t: attribution(objectives.get(n, **p), own)
                               for t, n, p in panels}
    return df


def measure(model, tok, task, prompts: int = 8, *, G: int = 4, seed: int = 0,
            lr: float = 2e-4) -> pd.DataFrame:
    """Measured W of every panel's loss on one real off-policy minibatch, for one group.

    Returns the figure2.csv frame (module docstring); W is float32 from the hook, per unit
    log-prob, in each loss's own scale (1/B factors included, B = the minibatch's rows).
    """
    stepped, ro, adv, rows = off_policy_step(model, tok, task, prompts, G=G, seed=seed, lr=lr)
    Ws, clips, batch = measure_panels(stepped, ro, rows, adv)
    g = pick_group(Ws[PANELS[0][0]], batch, ro, rows)
    return token_frame(tok, ro, rows, batch, Ws=Ws, clips=clips, g=g)


def _char(tok, tid: int) -> str:
    if tid == tok.eos_token_id:
        return "EOS"
    s = tok.convert_ids_to_tokens(tid)
    return "␣" if s == " " else s


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per panel: Σ_i W at each full-group shared position (they are listed in order), the
    largest |Σ|, Σ|W| there, ρ of the group and the loss's clip fraction on the minibatch."""
    s = group_sums(df)
    rows = []
    for title, d in s.groupby("panel", sort=False):
        rows.append({"panel": title, "Σ_i W at shared positions": ", ".join(
            f"{v:.3g}" for v in d["sum"]), "max |Σ|": d["sum"].abs().max(),
            "Σ|W| there": d["mass"].sum(), "ρ (group)": df.attrs.get("rho", {}).get(title),
            "clip frac (minibatch)": df[df["panel"] == title]["clip_frac"].iloc[0]})
    return pd.DataFrame(rows)


def draw(df: pd.DataFrame) -> plt.Figure:
    """2×2 panels of token strips (gradlab.viz.token_strips) with the caption of docs/concepts/dfpo.md."""
    scale = 10.0 ** -np.floor(np.log10(df["W"].abs().max() or 1.0))
    title = (f"Measured W (×{scale:.0e}) on one group of a real off-policy step, prompt "
             f"{df.attrs.get('prompt', '')!r}: blue = shared by the whole group, light "
             "blue = by a subset, orange = divergent")
    return token_strips(df, title=title, caption=CAPTION)


def main(argv: list[str] | None = None) -> int:
    from gradlab.loop.setup.policy import load_policy
    from gradlab.loop.setup.task import ArithmeticTask

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="low-resolution image, for tests")
    p.add_argument("--out", default=str(FIGURES / "figure2.png"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-4)
    a = p.parse_args(argv)
    set_threads(1)
    t0 = time.time()
    model, tok = load_policy()
    df = measure(model, tok, ArithmeticTask(), a.prompts, G=a.G, seed=a.seed, lr=a.lr)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out.with_suffix(".csv"), index=False)
    fig = draw(df)
    fig.savefig(out, dpi=80 if a.quick else 130, bbox_inches="tight")
    plt.close(fig)
    print(summary(df).to_markdown(index=False, floatfmt=".3g"))
    for title, att in df.attrs["attribution"].items():
        rho = df.attrs["rho"][title]
        if rho != rho:  # NaN: no full-group node, or W ≡ 0 there
            print(f"{title}: ρ undefined (no gradient at a full-group token): nothing to attribute")
        elif rho > 1e-4:  # not float round-off
            print(f"{title}: residual Σ|d| = {att['residual']:.3g}; share removed by switching "
                  "off " + ", ".join(f"{m} {att[m]:.1%}" for m in ("coupling", "length", "clip")))
    print(f"wrote {out} and {out.with_suffix('.csv')} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
