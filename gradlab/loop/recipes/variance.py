"""The variance claim, measured (docs/concepts/variance.md): at one fixed policy and one fixed prompt set, draw
K + R rollout batches and compute every objective's policy gradient on the *same* samples.

Per batch: one rollout (`draw`, layout `rollout`), one forward for the (B, T) log-probs, one
backward per objective (on-policy: old_logps are the sampling log-probs, so every ratio is 1 up
to float round-off). Batches 0..K−1 keep their gradients (the statistics, bootstrapped over
them); batches K..K+R−1 only add to the reference gradient g_ref = their mean. The statistics
are those of `gradlab.probes.variance`; `measure_variance` returns them as one tidy long table.

The prompt set is the loop's first rollout batch for `seed` (training split: held-out prompts
never appear); batch b samples row r with the hashed noise key (seed·1000003 + b)·1000003 + r.

Metrics (g = −∇L, the policy gradient over all parameters; per batch k < K, or on summary rows,
batch <NA>, with `_lo`/`_hi` = 95 % bootstrap interval over the K batches):
  per batch    grad_norm ‖g_k‖; cos_ref cos(g_k, g_ref); adv_nonzero_frac share of response tokens
               with A_{i,t} ≠ 0 (the advantages the objective's W is built from, `prepare`);
               reward_comparison_corr Pearson correlation over the batch's response tokens of
               R_i with A_{i,t} − A_i, the objective's token advantage minus the group-relative
               advantage in the same units (IBPO's comparison term, its process-level part; NaN
               for objectives trained on A_i). The authors say the comparison signal is
               negatively correlated with the terminal reward, which is why variance drops; this
               correlation is our reading of that statement. reward: the batch's mean reward.
  summary      grad_noise (+ _lo, _hi) tr Cov(g) / ⟨ḡ, g_ref⟩ (`gradlab.probes.variance`);
               trace_cov, signal its numerator and denominator; grad_noise_ref the same from the
               R reference batches alone (no interval; a cross-check); <metric>_mean (+ _lo, _hi)
               of each per-batch metric; noise_ratio_vs_grpo / _vs_gspo (+ _lo, _hi) paired;
               max_rel_diff_vs:<other> max_k ‖g_k − g_k^other‖ / ‖g_k^other‖ (~1e-6: the two
               objectives give the same gradient on these samples); K, reference_batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from ...core import objectives
from ...core.batch import advantages
from ...probes import variance as V
from ..config import ConfigError
from ..numerics.logprobs import token_logps
from ..rollouts.rollout import Rollout, generate
from ..rollouts.spec import SamplingSpec
from ..setup.heldout import TrainSplit
from ..setup.policy import load_policy
from ..setup.task import check_encodable, get_task

ROLLOUTS = ("independent", "tree", "repair")
COLUMNS = ("task", "rollout", "objective", "seed", "batch", "tokens", "metric", "value")
BASELINES = ("grpo", "gspo")
DEFAULT_OBJECTIVES = ("grpo", "gspo", "dfpo-min", "dfpo-orth", "ibpo[form=ga]", "ibpo[form=la]",
                      "ibpo[form=ga+la]", "ibpo[form=togo]", "ibpo[base=gspo]")  # noise ratios are reported against these when measured


def draw(rollout: str, model, tok, task, problems: list, *, G: int, b: int, seed: int,
         max_new_tokens: int, temperature: float) -> Rollout:
    """Rollout batch `b` of the measurement: G responses to each of `problems`, rewards scored.

    rollout: the layout (docs/guides/rollouts.md). "independent": G independent samples per
    prompt, row r's noise hashed from (seed, b, r) (`gradlab.loop.rollouts.rollout.hashed_uniform`);
    "tree": a star of G − 1 alternative branches off one root per group (`--rollout tree
    --roots 1 --branches G−1 --branch-token alternative`); "repair": the independent rows plus
    the repairs of their incorrect responses (`--rollout repair`, resample, 4 tries).
    """
    keys = (seed * 1_000_003 + b) * 1_000_003 + torch.arange(len(problems) * G)
    if rollout == "independent":
        return generate(model, tok, problems, G, max_new_tokens, temperature, task=task,
                        row_keys=keys)
    if rollout == "tree":
        from ..rollouts.tree import generate_tree

        star = SamplingSpec(G, max_new_tokens, temperature, layout="tree", roots=1,
                            branches=G - 1, branch_token="alternative")
        return generate_tree(model, tok, problems, star, keys, task=task)
    if rollout == "repair":
        from ..rollouts.repair import generate_repair

        spec = SamplingSpec(G, max_new_tokens, temperature, layout="repair")
        return generate_repair(model, tok, problems, spec, keys, task)
    raise ValueError(f"unknown rollout {rollout!r}; valid: {', '.join(ROLLOUTS)}")


def load_measured_policy(checkpoint: str | Path | None, task_name: str, task) -> tuple:
    """(model, tokenizer): the shipped warm start for the task (None), a Hugging Face model
    folder, or a run's checkpoint folder RUN/checkpoints/<objective> (its weights on the run's
    base model; the run's task must be `task_name`)."""
    if checkpoint is None:
        return load_policy(None, task=task)
    path = Path(checkpoint)
    if (path / "config.json").is_file():
        return load_policy(path)
    run_cfg = path.parent.parent / "config.json"
    if not ((path / "model.safetensors").is_file() and run_cfg.is_file()):
        raise FileNotFoundError(f"--checkpoint {path}: neither a Hugging Face model folder "
                                "(config.json) nor a run's checkpoints/<objective> folder")
    cfg = json.loads(run_cfg.read_text())
    if cfg.get("task") != task_name:
        raise ConfigError(f"--checkpoint {path} was trained on task {cfg.get('task')!r}, "
                          f"not --task {task_name!r}")
    model, tok = load_policy(cfg.get("model"), task=task)
    sd = load_file(path / "model.safetensors")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ConfigError(f"--checkpoint {path} does not fit the run's model (missing "
                          f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")
    return model, tok


def build(names: list[str], adv_scale: str) -> dict[str, objectives.Objective]:
    """label → objective (a user loss's label: its name= or function); one that scales its
    own advantages (IBPO) takes `adv_scale`."""
    out = {}
    for n in names:
        try:
            obj = objectives.get(n)
        except ValueError as e:
            raise ConfigError(f"--objectives: {e}") from None
        if getattr(obj, "scale", "") is None:
            obj.scale = adv_scale
        out[objectives.variants.label(n)] = obj
    return out


def batch_readings(model, params: list, ro: Rollout, objs: dict, adv_scale: str,
                   temperature: float) -> dict[str, dict]:
    """One forward and one backward per objective on rollout `ro`. Returns name → {"grad":
    (P,) float64 policy gradient −∇L, "adv_nonzero_frac", "corr"} where corr is the Pearson
    correlation over response tokens of R_i with A_{i,t} − A_i (the objective's token
    advantage minus the group-relative one: IBPO's comparison term; NaN for objectives
    trained on A_i itself, or where the term is constant)."""
    N = ro.response_ids.shape[0]
    rows = torch.arange(N)
    lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask,
                     temperature)
    adv = advantages(ro.rewards, ro.group, scale=adv_scale)
    batch = ro.token_batch(lp, adv, rows, norms=(N, int(ro.response_mask.sum()), ro.response_ids.shape[1]),
                           validate=False)
    m = batch.mask
    out = {}
    for name, obj in objs.items():
        grads = torch.autograd.grad(obj.loss(batch), params, retain_graph=True, allow_unused=True)
        g = torch.cat([(-x if x is not None else torch.zeros_like(p)).reshape(-1).double()
                       for x, p in zip(grads, params)])
        A = obj.prepare(batch).adv_tokens.detach()
        comp = (A - adv[:, None])[m].double()
        R = ro.rewards[:, None].expand_as(m)[m].double()
        corr = (float(torch.corrcoef(torch.stack([R, comp]))[0, 1])
                if comp.std() > 1e-12 and R.std() > 0 else float("nan"))
        out[name] = {"grad": g, "adv_nonzero_frac": float(((A != 0) & m).sum() / m.sum()),
                     "corr": corr}
    return out


def measure_variance(names: list[str], task: str = "arithmetic", *, K: int = 32,
                     reference_batches: int = 128, prompts: int = 8, G: int = 8,
                     checkpoint: str | Path | None = None, seed: int = 0,
                     rollout: str = "independent", temperature: float = 1.0,
                     max_new_tokens: int | None = None, adv_scale: str = "group",
                     difficulty: int = 2, threads: int = 1, n_boot: int = 2000,
                     progress: bool = True) -> pd.DataFrame:
    """Gradient noise of each objective in `names` at one fixed policy; the tidy long table.

    K batches for the statistics (bootstrapped over them, `n_boot` resamples shared by all
    objectives), `reference_batches` = R more for g_ref; each batch is `prompts` × G responses
    to the same prompts. checkpoint: see `load_measured_policy`. threads: torch intra-op
    threads (results are bitwise identical for a seed at a fixed count; 0 = leave as is).
    Columns: task, rollout, objective, seed, batch (k; <NA> on summary rows), tokens (response
    tokens of the batch, or of all K batches on summary rows), metric, value; the metrics are
    listed in this module's docstring.
    """
    if K < 2 or reference_batches < 2:
        raise ConfigError(f"--K and --reference-batches must be ≥ 2, got {K} and {reference_batches}")
    if rollout not in ROLLOUTS:
        raise ConfigError(f"--rollout: unknown {rollout!r}; valid: {', '.join(ROLLOUTS)}")
    objs = build(names, adv_scale)  # bad names fail before any model is loaded
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t = get_task(task, **({"difficulty": difficulty} if task == "arithmetic" else {}))
    model, tok = load_measured_policy(checkpoint, task, t)
    check_encodable(t, tok)
    problems = TrainSplit(t).problems(prompts, seed=seed * 1_000_003)
    kept, ref, per_batch = _draw_all(model, tok, t, problems, objs, K=K, R=reference_batches, G=G,
                                     seed=seed, rollout=rollout, temperature=temperature,
                                     max_new_tokens=max_new_tokens or t.max_new_tokens,
                                     adv_scale=adv_scale, progress=progress)
    rows = per_batch + _summarise(kept, ref, per_batch, K=K, R=reference_batches, n_boot=n_boot,
                                  seed=seed)
    df = pd.DataFrame(rows)
    df.insert(0, "task", task)
    df.insert(1, "rollout", rollout)
    df.insert(3, "seed", seed)
    df["batch"] = df["batch"].astype("Int64")
    return df[list(COLUMNS)]


def _draw_all(model, tok, task, problems, objs, *, K, R, G, seed, rollout, temperature,
              max_new_tokens, adv_scale, progress) -> tuple[dict, dict, list]:
    """Sample K + R batches. Returns (name → (K, P) float32 gradients, name → [Σ_r g_r (P,)
    float64, Σ_r ‖g_r‖²], per-batch tidy rows of the K kept batches)."""
    model.train()  # as in the loop (no dropout in these policies: same numbers either way)
    params = [p for p in model.parameters() if p.requires_grad]
    P = sum(p.numel() for p in params)
    kept = {n: torch.empty(K, P, dtype=torch.float32) for n in objs}
    ref = {n: [torch.zeros(P, dtype=torch.float64), 0.0] for n in objs}
    rows = []
    for b in tqdm(range(K + R), desc=f"variance {task.key}", disable=not progress):
        ro = draw(rollout, model, tok, task, problems, G=G, b=b, seed=seed,
                  max_new_tokens=max_new_tokens, temperature=temperature)
        out = batch_readings(model, params, ro, objs, adv_scale, temperature)
        n_tok = int(ro.response_mask.sum())
        gen = int(ro.new_tokens.sum()) + ro.discarded_tokens  # what sampling cost (layouts.py)
        for name, r in out.items():
            g = r["grad"]
            if b >= K:
                ref[name][0] += g
                ref[name][1] += float(g @ g)
                continue
            kept[name][b] = g.float()
            for metric, v in (("grad_norm", float(g.norm())), ("adv_nonzero_frac", r["adv_nonzero_frac"]),
                              ("reward_comparison_corr", r["corr"]),
                              ("reward", float(ro.rewards.mean())),
                              ("generated_tokens", gen)):
                rows.append({"objective": name, "batch": b, "tokens": n_tok, "metric": metric,
                             "value": v})
    return kept, ref, rows


def _mean_ci(x: np.ndarray, w: np.ndarray) -> tuple[float, float, float]:
    """Mean of per-batch values x (K,) ignoring NaN, and its bootstrap interval under counts w."""
    ok = np.isfinite(x)
    if not ok.any():
        return (float("nan"),) * 3
    xs = np.where(ok, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = (w @ xs) / (w @ ok.astype(float))
    boot = boot[np.isfinite(boot)]
    return (float(xs.sum() / ok.sum()), *V.interval(boot))


def _summarise(kept: dict, ref: dict, per_batch: list, *, K: int, R: int, n_boot: int,
               seed: int) -> list[dict]:
    """Summary rows per objective (batch <NA>; `_objective_summary`), per-batch cosines to
    g_ref, and noise ratios against the baselines (paired: the same resamples of batches)."""
    w = V.resample_counts(K, n_boot, seed)
    pb = pd.DataFrame(per_batch)
    tok_k = pb.drop_duplicates("batch").sort_values("batch")["tokens"].to_numpy()
    total = int(tok_k.sum())
    rows, points, boots = [], {}, {}
    for name, g in kept.items():
        stats, cos, points[name], boots[name] = _objective_summary(g, ref[name], R, w,
                                                                  pb[pb["objective"] == name])
        stats.update(K=K, reference_batches=R)
        rows += [{"objective": name, "batch": pd.NA, "tokens": total, "metric": m,
                  "value": float(v)} for m, v in stats.items()]
        rows += [{"objective": name, "batch": b, "tokens": int(tok_k[b]), "metric": "cos_ref",
                  "value": float(c)} for b, c in enumerate(cos)]
    rows += _pairs(kept, total)
    for name in kept:
        for base in (b for b in BASELINES if b in kept and b != name):
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.nan_to_num(boots[name] / boots[base], nan=np.inf)
            lo, hi = V.interval(ratio)
            rows += [{"objective": name, "batch": pd.NA, "tokens": total,
                      "metric": f"noise_ratio_vs_{base}{s}", "value": float(v)}
                     for s, v in (("", points[name] / points[base]), ("_lo", lo), ("_hi", hi))]
    return rows


def _pairs(kept: dict, tokens: int) -> list[dict]:
    """Which objectives give the same gradient on the same samples: for every ordered pair,
    max over the K batches of ‖g_a − g_b‖ / ‖g_b‖ (metric "max_rel_diff_vs:<b>"; float
    round-off ~1e-6 in float32 means the two coincide)."""
    rows = []
    for a, ga in kept.items():
        for b, gb in kept.items():
            if a != b:
                nb = gb.double().norm(dim=1).clamp(min=1e-300)
                v = float(((ga.double() - gb.double()).norm(dim=1) / nb).max())
                rows.append({"objective": a, "batch": pd.NA, "tokens": tokens,
                             "metric": f"max_rel_diff_vs:{b}", "value": v})
    return rows


def _objective_summary(g: torch.Tensor, ref: list, R: int, w: np.ndarray,
                       mine: pd.DataFrame) -> tuple[dict, np.ndarray, float, np.ndarray]:
    """One objective's statistics from its (K, P) gradients g, its reference sums and its
    per-batch rows. Returns (metric → value, cos (K,), noise, noise of each resample)."""
    gd, g_ref = g.double(), ref[0] / R
    Gm, d = V.gram(gd.numpy()), (gd @ g_ref).numpy()
    noise, boot = V.gradient_noise(Gm, d)[0], V.gradient_noise(Gm, d, w)
    tc_ref, sig_ref = V.reference_noise(ref[0].numpy(), ref[1], R)
    cos = V.cosines(d, Gm, float(g_ref @ g_ref))
    lo, hi = V.interval(boot)
    out = {"grad_noise": noise, "grad_noise_lo": lo, "grad_noise_hi": hi,
           "trace_cov": V.trace_cov(Gm)[0], "signal": V.signal(d)[0],
           "grad_noise_ref": tc_ref / sig_ref if sig_ref > 0 else np.inf}
    series = {"cos_ref": cos, **{m: mine[mine["metric"] == m].sort_values("batch")["value"]
                                 .to_numpy(float) for m in ("grad_norm", "adv_nonzero_frac",
                                                            "reward_comparison_corr")}}
    for m, x in series.items():
        out.update(zip((f"{m}_mean", f"{m}_mean_lo", f"{m}_mean_hi"), _mean_ci(x, w)))
    return out, cos, noise, boot
