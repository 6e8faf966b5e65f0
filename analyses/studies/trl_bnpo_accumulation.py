"""Does TRL's loss cancel on-policy when gradient accumulation splits the groups?

One optimizer step per generation batch (on-policy: steps_per_generation =
gradient_accumulation_steps = k), the batch cut into k loss calls after TRL's row shuffle, so
a group's rows land in different micro-batches (the share of such groups: `split_micro`). `bnpo` normalises each
loss call by *its own* token count, so rows of one group get different weights when k > 1;
`dapo` (tokens of the whole accumulated batch) and `dr_grpo` (a constant) do not. W is
hook-measured on TRL's own loss; ρ at full-group nodes of the whole optimizer step (all its
micro-batches), pooled over the generation batches, and the per-step range.

    python -m analyses.studies.trl_bnpo_accumulation                # ~2-4 min on 2 shared CPU cores
    python -m analyses.studies.trl_bnpo_accumulation --gens 3 --loss-types bnpo
"""

from __future__ import annotations

import argparse
import math
import tempfile

import torch

from gradlab.integrations.audit.trl import WORKLOADS, grpo_args, make_trainer, quiet
from gradlab.integrations.trl import GradlabConfig


def measure(loss_type: str, k: int, workload: str, gens: int, seed: int) -> dict:
    """Pooled and per-step ρ over `gens` optimizer steps of k accumulated micro-batches."""
    from gradlab.core.batch import split_share
    from gradlab.core.cancellation import cancellation
    from gradlab.core.nodes import shared_nodes

    with tempfile.TemporaryDirectory() as tmp, quiet():
        args = grpo_args(loss_type, "token", k, gens, tmp, seed=seed,
                         gradient_accumulation_steps=k, max_steps=gens)
        tr = make_trainer(args, WORKLOADS[workload], GradlabConfig(store=None, keep_windows=True))
        tr.train()
    res = mass = 0.0
    per_step, split = [], []
    for w in tr.gradlab_windows:
        c = cancellation(w.W, w.batch, sn=shared_nodes(w.batch, "prefix"))
        res, mass = res + c.residual, mass + c.mass
        per_step.append(c.ratio)
        split.append(split_share(w.batch.group, w.micro))  # groups over loss calls
    defined = [r for r in per_step if r == r]  # NaN: a step with no gradient at its nodes
    return {"loss_type": loss_type, "accumulation": k, "workload": workload,
            "rho": res / mass if mass > 0 else math.nan,
            "rho_min": min(defined) if defined else math.nan,
            "rho_max": max(defined) if defined else math.nan,
            "split_micro": sum(split) / len(split), "steps": len(per_step),
            "steps_defined": len(defined)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss-types", default="bnpo,dapo,dr_grpo")
    p.add_argument("--accumulation", default="1,2,4")
    p.add_argument("--workloads", default="arithmetic,lengths")
    p.add_argument("--gens", type=int, default=6, help="optimizer steps (= generation batches)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| workload | loss_type | gradient_accumulation_steps | ρ full-group (pooled) | "
          "ρ per step, min–max | groups split over micro-batches |")
    print("|---|---|---|---|---|---|")
    for wl in a.workloads.split(","):
        for lt in a.loss_types.split(","):
            for k in (int(x) for x in a.accumulation.split(",")):
                r = measure(lt, k, wl, a.gens, a.seed)
                print(f"| {wl} | {lt} | {k} | {r['rho']:.3g} | {r['rho_min']:.3g}–"
                      f"{r['rho_max']:.3g} | {r['split_micro']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
