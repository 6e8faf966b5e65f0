"""Token flips: what one optimizer step does to each sampled token, by advantage sign, node kind
and confidence, under three ways of cutting a rollout batch into optimizer steps.

Each run is a tandem `gradlab tandem --task T --objectives grpo,gspo,dfpo --instruments flips@1
--tax-every 1 --eval-every 0 --seed k` plus the variant's option: whole groups per step (the
default), `--split-groups` (rows shuffled over steps, like TRL) or `--balance-polarity` (whole
groups, each step its share of positive and negative rows). The ledger (`gradlab.probes.flips`)
is measured at every optimizer step of every rollout step; its cell sums are added over the
run's steps, then shares are ratios of those sums (pooled) or per seed (for the intervals).

Writes <out>/token_flips.csv (tidy long: task, variant, seed, objective, sign, kind, conf,
field, value — the cell sums of each run over its steps), token_flips.md (tables),
token_flips.json (provenance, sizes, summary and `runs`: one row per run, `common.run_row`)
and token_flips.png.

    OMP_NUM_THREADS=1 python -m analyses.figures.token_flips           # ~10 CPU minutes
    OMP_NUM_THREADS=1 python -m analyses.figures.token_flips --quick   # seconds, for tests
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pandas as pd

from analyses.tools.common import (
    FIGURES,
    ROOT,
    load_seeds,
    provenance,
    run_seeds,
    set_threads,
    write_meta,
)
from gradlab.probes.flips import ALL, FIELDS, KINDS, PREFIX, SIGNS, conf_labels

OBJECTIVES = ["grpo", "gspo", "dfpo"]
VARIANTS = {"whole": {}, "split": {"split_groups": True}, "balanced": {"balance_polarity": True}}
BASE = dict(objectives=OBJECTIVES, instruments="flips@1", tax_every=1, eval_every=0,
            ckpt_every=1000, progress=False)
FULL = {"arithmetic": dict(steps=10, seeds=5), "scaffold": dict(steps=2, seeds=3)}
QUICK = {"arithmetic": dict(steps=1, seeds=1, prompts=2, G=4, minibatches=2)}
CONFS = conf_labels()


def collect(runs: Path, plan: dict, ledger: list) -> pd.DataFrame:
    """Train (or reuse) every (task, variant, seed) tandem; the cell sums of each run, added
    over its rollout steps, as tidy rows. `ledger` gets one provenance row per run."""
    parts = []
    for task, size in plan.items():
        size = dict(size)
        seeds = range(size.pop("seeds"))
        for variant, opts in VARIANTS.items():
            root = runs / task / variant
            run_seeds(root, seeds, ledger=ledger, task=task, **BASE, **size, **opts)
            t = load_seeds(root)
            t = t[t["metric"].str.startswith(PREFIX) & t["seed"].isin(list(seeds))]
            keys = t["metric"].str[len(PREFIX):].str.split("/", expand=True)
            t = t.assign(sign=keys[0], kind=keys[1], conf=keys[2], field=keys[3])
            t = t[t["sign"].isin(SIGNS) & t["kind"].isin(KINDS) & (t["conf"] != ALL)
                  & t["field"].isin(FIELDS)]
            s = t.groupby(["seed", "objective", "sign", "kind", "conf", "field"], as_index=False)[
                "value"].sum()
            parts.append(s.assign(task=task, variant=variant))
    cols = ["task", "variant", "seed", "objective", "sign", "kind", "conf", "field", "value"]
    return pd.concat(parts, ignore_index=True)[cols]


def pooled(tidy: pd.DataFrame, by: list[str], **where) -> pd.DataFrame:
    """Sums of the cells matching `where` (column → value or list), grouped by `by`, with
    boosted/suppressed/flipped shares and mean Δ; NaN where a group holds no token."""
    d = tidy
    for col, v in where.items():
        d = d[d[col].isin(v if isinstance(v, list) else [v])]
    w = d.pivot_table(index=by, columns="field", values="value", aggfunc="sum").reindex(
        columns=list(FIELDS), fill_value=0.0)
    n = w["count"].where(w["count"] > 0)  # an empty cell: NaN, never 0
    return w.assign(boosted_share=w["boosted"] / n, suppressed_share=w["suppressed"] / n,
                    flipped_share=w["flipped"] / n, dlogp_mean=w["dlogp_sum"] / n).reset_index()


def _pct(x: float) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def sign_table(tidy: pd.DataFrame, task: str) -> list[str]:
    """Boosted / suppressed shares by advantage sign (whole groups), per objective."""
    p = pooled(tidy, ["objective", "sign"], task=task, variant="whole")
    lines = ["| objective | sign of A | tokens | boosted % | suppressed % | flipped % | mean Δ (nats) |",
             "|---|---|---|---|---|---|---|"]
    for _, r in p.iterrows():
        flip = "— (no sign)" if r["sign"] == "zero" else _pct(r["flipped_share"])
        lines.append(f"| {r['objective']} | {r['sign']} | {int(r['count'])} | {_pct(r['boosted_share'])} "
                     f"| {_pct(r['suppressed_share'])} | {flip} | {r['dlogp_mean']:+.2e} |")
    return lines


def kind_conf_table(tidy: pd.DataFrame, task: str) -> list[str]:
    """Flipped share (% of tokens with A ≠ 0, tokens in brackets) by node kind × confidence,
    whole groups, every objective pooled and per objective."""
    lines = []
    for obj in [OBJECTIVES] + [[o] for o in OBJECTIVES]:
        p = pooled(tidy, ["kind", "conf"], task=task, variant="whole", sign=["pos", "neg"],
                   objective=obj).set_index(["kind", "conf"])
        lines += [f"*{' + '.join(obj)}*", "", "| node kind | " + " | ".join(f"π ∈ {c}" for c in CONFS)
                  + " |", "|---|" + "---|" * len(CONFS)]
        for kind in KINDS:
            cells = [f"{_pct(p.loc[(kind, c), 'flipped_share'])} ({int(p.loc[(kind, c), 'count'])})"
                     if (kind, c) in p.index else "— (0)" for c in CONFS]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def per_seed(tidy: pd.DataFrame, task: str, **where) -> pd.DataFrame:
    """Flipped share of signed tokens per (variant, objective, seed)."""
    return pooled(tidy, ["variant", "objective", "seed"], task=task, sign=["pos", "neg"], **where)


def variant_table(tidy: pd.DataFrame, task: str) -> tuple[list[str], dict]:
    """Flipped share (signed tokens) per variant and objective, mean over seeds, and paired t
    intervals of split − whole and balanced − whole over seeds (≥ 3 seeds)."""
    from gradlab.stats import paired_interval

    s = per_seed(tidy, task)
    w = s.pivot_table(index=["objective", "seed"], columns="variant", values="flipped_share")
    n_seeds = s["seed"].nunique()
    lines = ["| objective | whole % | split % | balanced % | split − whole (pp) | balanced − whole (pp) |",
             "|---|---|---|---|---|---|"]
    out = {}
    for obj in OBJECTIVES:
        d = w.loc[obj]
        row, res = [f"{_pct(d[v].mean())}" for v in VARIANTS], {}
        for v in ("split", "balanced"):
            if n_seeds >= 3:
                r = paired_interval(d[v].values, d["whole"].values)
                res[v] = {k: r[k] for k in ("mean", "lo", "hi", "p", "n")}
                row.append(f"{100 * r['mean']:+.2f} [{100 * r['lo']:+.2f}, {100 * r['hi']:+.2f}], p {r['p']:.2f}")
            else:
                row.append(f"— (needs ≥ 3 seeds, {n_seeds} here)")
        out[obj] = {"mean": {v: float(d[v].mean()) for v in VARIANTS}, "paired": res}
        lines.append(f"| {obj} | " + " | ".join(row) + " |")
    return lines, out


LOW = ["0-0.5", "0.5-0.9"]  # "low confidence": π < 0.9 (our cut, with the default bins)


def claims(tidy: pd.DataFrame, task: str, variants: dict) -> dict:
    """The paper's three claims, measured on whole-group steps (all objectives pooled), with
    the numbers each verdict is read from. Thresholds are ours and stated in the table."""
    sg = pooled(tidy, ["sign"], task=task, variant="whole").set_index("sign")
    b_pos, b_neg = float(sg.loc["pos", "boosted_share"]), float(sg.loc["neg", "boosted_share"])
    signed = dict(task=task, variant="whole", sign=["pos", "neg"])
    allf = float(pooled(tidy, ["task"], **signed)["flipped_share"].iloc[0])
    kc = pooled(tidy, ["kind"], conf=LOW, **signed).set_index("kind")["flipped_share"]
    hi = pooled(tidy, ["kind"], conf=[c for c in CONFS if c not in LOW], **signed).set_index(
        "kind")["flipped_share"]
    out = {"boosted_share_pos": b_pos, "boosted_share_neg": b_neg,
           "suppressed_share_pos": float(sg.loc["pos", "suppressed_share"]),
           "suppressed_share_neg": float(sg.loc["neg", "suppressed_share"]),
           "similar_shares": abs(b_pos - b_neg) < 0.10,
           "flipped_share_all": allf,
           "flipped_share_low_conf": {k: float(v) for k, v in kc.items()},
           "flipped_share_high_conf": {k: float(v) for k, v in hi.items()}}
    lo = out["flipped_share_low_conf"]
    nan = math.nan
    # two parts: shared by rows of both signs (whole-group nodes) vs own tokens, at π < 0.9;
    # low vs high confidence, over all signed tokens
    out["shared_over_own_low_conf"] = bool(lo.get("group", nan) > lo.get("own", nan))
    conf = pooled(tidy, ["conf"], **signed).set_index("conf")["flipped_share"]
    out["flipped_share_by_conf"] = {k: float(v) for k, v in conf.items()}
    low_all = pooled(tidy, ["task"], conf=LOW, **signed)["flipped_share"].iloc[0]
    high_all = pooled(tidy, ["task"], conf=[c for c in CONFS if c not in LOW], **signed)[
        "flipped_share"].iloc[0]
    out["flipped_share_low_vs_high"] = [float(low_all), float(high_all)]
    out["low_over_high_conf"] = bool(low_all > high_all)
    out["remedies"] = {obj: {v: _verdict(r, v) for v, r in res["paired"].items()}
                       for obj, res in variants.items()}
    return out


def _verdict(r: dict, variant: str) -> str:
    """split − whole > 0 supports "keep groups whole"; balanced − whole < 0 supports balance."""
    lo, hi = (r["lo"], r["hi"]) if variant == "split" else (-r["hi"], -r["lo"])
    p = f", exact p {r['p']:.2g}" if "p" in r else ""
    if lo > 0:  # the whole interval on the side the claim predicts
        return f"supported (t interval{p}; exploratory)"
    if hi < 0:
        return f"the opposite (t interval{p}; exploratory)"
    return "not resolved (interval holds 0)"


def claims_lines(c: dict) -> list[str]:
    f = lambda d, k: _pct(d.get(k, math.nan))  # noqa: E731
    lines = [f"- *Positive and negative rollouts show similar boosted/suppressed shares*: A > 0 tokens "
             f"boosted {_pct(c['boosted_share_pos'])} %, A < 0 tokens boosted "
             f"{_pct(c['boosted_share_neg'])} %; suppressed {_pct(c['suppressed_share_pos'])} % and "
             f"{_pct(c['suppressed_share_neg'])} % → "
             + ("within our 10 pp: supported." if c["similar_shares"] else
                "they differ by ≥ 10 pp (our threshold): not supported."),
             f"- *Flipping concentrates at identical low-confidence tokens that appear in rollouts of "
             f"both signs*: flipped share of signed tokens {_pct(c['flipped_share_all'])} % overall; "
             f"at π < 0.9: whole-group shared {f(c['flipped_share_low_conf'], 'group')} %, subset "
             f"{f(c['flipped_share_low_conf'], 'subset')} %, own {f(c['flipped_share_low_conf'], 'own')} %; "
             f"at π ≥ 0.9: whole-group {f(c['flipped_share_high_conf'], 'group')} %, own "
             f"{f(c['flipped_share_high_conf'], 'own')} %. *Identical tokens of rows of both "
             "signs*: " + ("supported (at π < 0.9 whole-group tokens flip more often than own ones)"
                           if c["shared_over_own_low_conf"] else "not supported (at π < 0.9 "
                           "whole-group tokens do not flip more often than own ones)")
             + f"; *low confidence*: all signed tokens at π < 0.9 flip {_pct(c['flipped_share_low_vs_high'][0])} %, "
             f"at π ≥ 0.9 {_pct(c['flipped_share_low_vs_high'][1])} % → "
             + ("supported." if c["low_over_high_conf"] else "not supported (low-confidence "
                                                              "tokens flip less often).")]
    for obj, v in c["remedies"].items():
        lines.append(f"- *Remedies* ({obj}): keeping a prompt's rollouts in one step vs splitting: "
                     f"{v.get('split', '— (< 3 seeds)')}; polarity balance: {v.get('balanced', '— (< 3 seeds)')}.")
    return lines


def figure(tidy: pd.DataFrame, tasks: list[str], path: Path) -> None:
    """Per task: flipped share by node kind × confidence (whole groups, objectives pooled), and
    flipped share per variant and objective (bars: pooled; dots: seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.6 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        p = pooled(tidy, ["kind", "conf"], task=task, variant="whole", sign=["pos", "neg"])
        for k, kind in enumerate(KINDS):
            q = p[p["kind"] == kind].set_index("conf").reindex(CONFS)
            row[0].bar([i + 0.27 * (k - 1) for i in range(len(CONFS))], 100 * q["flipped_share"],
                       0.27, label=kind)
        row[0].set_xticks(range(len(CONFS)), [f"π ∈ {c}" for c in CONFS])
        row[0].set_ylabel("flipped, % of tokens (A ≠ 0)")
        row[0].set_title(f"{task}: by node kind × confidence (whole groups)")
        row[0].legend(title="node")
        s = per_seed(tidy, task)
        for j, obj in enumerate(OBJECTIVES):
            for v, variant in enumerate(VARIANTS):
                x = j + 0.27 * (v - 1)
                d = s[(s["objective"] == obj) & (s["variant"] == variant)]["flipped_share"]
                row[1].bar(x, 100 * d.mean(), 0.27, color=f"C{v}", label=variant if j == 0 else None)
                row[1].plot([x] * len(d), 100 * d, "k.", ms=4)
        row[1].set_xticks(range(len(OBJECTIVES)), OBJECTIVES)
        row[1].set_ylabel("flipped, % of tokens (A ≠ 0)")
        row[1].set_title(f"{task}: variants (bars: mean over seeds; dots: seeds)")
        row[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(tidy: pd.DataFrame, plan: dict, summary: dict, stamp_line: str) -> str:
    lines = ["# Token flips", ""]
    for task, size in plan.items():
        lines += [f"## {task}", "", f"{size['seeds']} seed(s) × {size['steps']} rollout step(s) per "
                  f"variant, objectives {', '.join(OBJECTIVES)}; ledger at every optimizer step.", "",
                  "### Boosted / suppressed shares by advantage sign (whole groups)", ""]
        lines += sign_table(tidy, task)
        lines += ["", "### Flipped share by node kind × confidence (whole groups; % of tokens with "
                  "A ≠ 0, tokens in brackets; — : no token)", ""]
        lines += kind_conf_table(tidy, task)
        lines += ["### Variants: flipped share of tokens with A ≠ 0 (mean over seeds; paired "
                  "differences with 95 % t intervals over seeds, `gradlab.stats.paired_interval`)", ""]
        lines += summary[task]["variant_lines"]
        lines += ["", "### The paper's claims, as measured here", ""] + claims_lines(summary[task]["claims"])
        lines.append("")
    lines += [f"Made by {stamp_line}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one tiny run per variant (seconds), for tests")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default arithmetic,scaffold)")
    p.add_argument("--runs", help="default runs/token_flips (quick: runs/token_flips-quick)")
    p.add_argument("--out", help="output folder (default figures/; quick: the runs folder)")
    a = p.parse_args(argv)
    from analyses.tools.common import stamp

    prov = provenance("analyses.figures.token_flips", argv)
    set_threads(1)
    plan = dict(QUICK if a.quick else FULL)
    if a.tasks:
        plan = {t: plan[t] if t in plan else dict(FULL.get(t, FULL["arithmetic"])) for t in a.tasks.split(",")}
    runs = Path(a.runs or ROOT / ("runs/token_flips-quick" if a.quick else "runs/token_flips"))
    out = Path(a.out or (runs if a.quick else FIGURES))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ledger: list[dict] = []
    tidy = collect(runs, plan, ledger)
    summary = {}
    for task in plan:
        vl, vres = variant_table(tidy, task)
        summary[task] = {"variant_lines": vl, "variants": vres, "claims": claims(tidy, task, vres)}
    seconds = time.time() - t0
    tidy.to_csv(out / "token_flips.csv", index=False)
    (out / "token_flips.md").write_text(markdown(tidy, plan, summary, stamp(prov)))
    figure(tidy, list(plan), out / "token_flips.png")
    write_meta(out / "token_flips.json", prov, plan=plan, base=BASE, variants=VARIANTS,
               seconds=round(seconds), summary={t: {k: v for k, v in s.items() if k != "variant_lines"}
                                                for t, s in summary.items()}, runs=ledger)
    print((out / "token_flips.md").read_text())
    print(f"{seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
