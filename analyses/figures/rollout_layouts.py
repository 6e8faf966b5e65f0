"""Rollout layouts on the shipped policies: informative branch points per 1,000 generated
tokens and duplicate responses per group, independent vs tree vs repair (G = 8), and the
Min-Replace vs Orth-Proj parameter-gradient difference on real tree steps.

    OMP_NUM_THREADS=1 python -m analyses.figures.rollout_layouts            # a few CPU minutes
    -> figures/rollout_layouts.csv, figures/rollout_layouts.md

Rollouts are the loop's own (`gradlab.loop.train.sample`: same prompts, keys and layouts as
`gradlab tandem --rollout ...` at step k), from the untrained shipped policy; every figure is a
ratio of sums over all groups (`gradlab.loop.rollouts.layouts.layout_sums`).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from gradlab import objectives  # noqa: E402
from gradlab.core.batch import advantages  # noqa: E402
from gradlab.loop.config import RunConfig  # noqa: E402
from gradlab.loop.rollouts.layouts import layout_sums  # noqa: E402
from gradlab.loop.scale.dist import Dist  # noqa: E402
from gradlab.loop.setup.heldout import TrainSplit  # noqa: E402
from gradlab.loop.setup.policy import load_policy  # noqa: E402
from gradlab.loop.setup.realmodel import prepare_run  # noqa: E402
from gradlab.loop.setup.task import get_task  # noqa: E402
from gradlab.loop.train import Learner, sample  # noqa: E402

LAYOUTS = {  # label -> RunConfig options
    "independent": {},
    "tree": {"rollout": "tree"},
    "tree alternative": {"rollout": "tree", "branch_token": "alternative"},
    "tree uniform alternative": {"rollout": "tree", "branch_at": "uniform",
                                 "branch_token": "alternative"},
    "tree star": {"rollout": "tree", "roots": 1, "branches": 7},
    "tree star alternative": {"rollout": "tree", "roots": 1, "branches": 7,
                              "branch_token": "alternative"},
    "repair": {"rollout": "repair"},
    "repair alternative": {"rollout": "repair", "branch_token": "alternative"},
    "repair splice": {"rollout": "repair", "repair": "splice"},
    "repair local": {"rollout": "repair", "repair": "local"},
    "repair local alternative": {"rollout": "repair", "repair": "local",
                                 "branch_token": "alternative"},
}


def rollouts(task_name: str, opts: dict, steps: int, prompts: int, seed: int):
    """The loop's rollouts of steps 0..steps−1 (one learner, no update between them)."""
    cfg = RunConfig(task=task_name, G=8, prompts=prompts, seed=seed, threads=1, instruments="off",
                    minibatches=1,
                    **opts)
    task = get_task(task_name)
    model, tok = load_policy(task=task)
    task = prepare_run(cfg, model, tok, TrainSplit(task))
    L = Learner("x", None, model, None, None)
    return [sample(L, cfg, task, tok, k, Dist()) for k in range(steps)], model


def measure(task_name: str, steps: int, prompts: int, seed: int) -> list[dict]:
    out = []
    for label, opts in LAYOUTS.items():
        ros, _ = rollouts(task_name, opts, steps, prompts, seed)
        s = pd.DataFrame([layout_sums(ro) for ro in ros]).sum()
        groups = steps * prompts
        sampled_dup = sum(_dups(ro) for ro in ros)
        out.append({
            "task": task_name, "layout": label, "groups": groups,
            "generated_tokens": int(s.generated_tokens), "trained_tokens": int(s.trained_tokens),
            "informative_points": int(s.informative_points),
            "informative_per_1k": 1000 * s.informative_points / s.generated_tokens,
            "branch_points_per_group": s.branch_points / groups,
            "branch_depth": s.branch_depth_sum / max(s.branch_points, 1),
            "distinct_per_group": s.distinct_responses / groups,
            "duplicates_per_group": s.duplicate_responses / groups,
            "sampled_duplicates_per_group": sampled_dup / groups,
            "repair_success": s.repairs_kept / s.repairs_tried if s.repairs_tried else float("nan"),
            "edited_per_repair": s.edited_tokens / s.repairs_kept if s.repairs_kept else float("nan"),
        })
        print(out[-1], flush=True)
    return out


def _dups(ro) -> int:
    """Duplicates among the policy's own samples (repair rows left out)."""
    own = range(len(ro.texts)) if ro.repair_of is None else (ro.repair_of < 0).nonzero()[:, 0].tolist()
    n = 0
    for g in torch.unique(ro.group).tolist():
        rows = [i for i in own if int(ro.group[i]) == g]
        n += len(rows) - len({tuple(ro.response_ids[i][ro.response_mask[i]].tolist()) for i in rows})
    return n


def min_vs_orth(seed: int, opts: dict, prompts: int = 8) -> dict:
    """‖g_min − g_orth‖ / ‖g_orth‖ on a real off-policy minibatch of a tree (or independent)
    rollout: tests/test_fair.py's procedure (float64 model one GSPO step past the sampler at
    lr 3e-3, gradient on the other half of the groups), at full-group and at trie nodes."""
    from gradlab.testing import optimizer_step_on
    from tests import test_fair as T

    ros, model = rollouts("arithmetic", opts, 1, prompts, seed)
    ro = ros[0]
    adv = advantages(ro.rewards, ro.group)
    half = prompts // 2
    first, second = (ro.group < half).nonzero()[:, 0], (ro.group >= half).nonzero()[:, 0]
    stepped = copy.deepcopy(model)
    optimizer_step_on(stepped, ro, first, adv, objectives.get("gspo").loss, lr=3e-3)
    m = stepped.double()
    res = {}
    for nodes in ("prefix", "trie"):
        g = {t: T._grad(m, ro, second, adv, objectives.get(f"dfpo-{t}[nodes={nodes}]").loss)[0]
             for t in ("min", "orth")}
        res[nodes] = T._rel(g["min"], g["orth"])
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 step × 2 prompts (seconds; tests)")
    p.add_argument("--out", default=str(ROOT / "figures" / "rollout_layouts"))
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.prompts = 1, 2
    torch.set_num_threads(1)
    rows = measure("arithmetic", a.steps, a.prompts, a.seed) + \
        measure("scaffold", a.steps, a.prompts, a.seed)
    df = pd.DataFrame(rows)
    base = df[df.layout == "independent"].set_index("task")["informative_per_1k"]
    df["informative_vs_independent"] = df["informative_per_1k"] / df["task"].map(base)
    df.to_csv(a.out + ".csv", index=False)
    mo = {lab: min_vs_orth(a.seed, LAYOUTS[lab], 4 if a.quick else 8)
          for lab in ("independent", "tree alternative", "tree star alternative")}
    write_md(df, mo, a)
    return 0


def write_md(df: pd.DataFrame, mo: dict, a) -> None:
    cols = ["task", "layout", "groups", "generated_tokens", "informative_per_1k",
            "informative_vs_independent", "duplicates_per_group", "sampled_duplicates_per_group",
            "distinct_per_group", "branch_points_per_group", "branch_depth", "repair_success",
            "edited_per_repair"]
    lines = [
        "# Rollout layouts on the shipped policies (G = 8)", "",
        "`OMP_NUM_THREADS=1 python -m analyses.figures.rollout_layouts "
        f"--steps {a.steps} --prompts {a.prompts} --seed {a.seed}`: the loop's rollouts of steps 0..{a.steps - 1} "
        f"({a.steps * a.prompts} groups per row) from the untrained shipped policies; tree = "
        "2 roots × 2 branches per path ('star': 1 root × 7 branches, `--roots 1 --branches 7`), "
        "entropy-weighted positions unless 'uniform', branch token sampled unless "
        "'alternative'; repair = "
        "resample from the first departure with 4 tries unless 'splice'; 'local' = "
        "`--repair local` (4 tries, from the last position before the stop token, one "
        "position earlier per try). Ratios of sums over all groups. "
        "duplicates_per_group counts every row (a repair that reproduces a sampled correct "
        "response is a duplicate); sampled_duplicates_per_group only the policy's own samples.", "",
        "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df[cols].iterrows():
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v)
                                        for v in r.tolist()) + " |")
    lines += ["", "Min-Replace vs Orth-Proj, ‖g_min − g_orth‖ / ‖g_orth‖ on a real off-policy "
              f"minibatch (arithmetic, seed {a.seed}, {4 if a.quick else 8} prompts × G = 8, the "
              "second half of the groups after one GSPO step at lr 3e-3 on the first half; float64 "
              "model; tests/test_fair.py's procedure):", ""]
    lines += [f"- {lab}: full-group nodes {v['prefix']:.3g}, trie nodes {v['trie']:.3g}"
              for lab, v in mo.items()]
    lines += ["", "Why repair layouts do not raise the count: a repair departs from the incorrect "
              "response where its reference (a correct response of the group) already parts from "
              "it, so that trie node already has children of different mean reward; a repair adds "
              "a node only where its own continuation later leaves the reference, and its sampled "
              "tokens (failed tries included) add to the denominator. What a repair adds is the "
              "(incorrect, corrected) pair and its edited tokens, which this count does not see. "
              "A local repair adds a node only when a try from a position after the departure "
              "succeeds; on these policies most kept local repairs are tries at the departure "
              "itself (the last position before the stop is often where the response already "
              "parts from its reference: a wrong final digit), and a response that departs "
              "earlier is rarely fixed by rewriting its last tokens."]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
