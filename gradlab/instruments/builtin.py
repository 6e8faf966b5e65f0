"""The built-in instruments (docs/concepts/instruments.md): what the gradlab loop, the TRL
trainer and verl's actor measure, each one object. The math lives in gradlab.core and
gradlab.probes; an instrument picks what it reads, when, and how its numbers reduce."""

from __future__ import annotations

import torch

from ..core.cancellation import attribution_sums, node_coefficients
from ..core.losses import MECHANISMS
from ..probes.drift import divergent_dlogp, drift_sums
from ..probes.flips import PREFIX as FLIPS
from ..probes.flips import flip_ledger, flip_shares
from .base import Derived, Instrument, Ratio, Readings

KINDS = ("prefix", "trie")  # full-group nodes, and every node of the trie


def residual_sums(W: torch.Tensor, batch, nodes: dict, prefix: str = "") -> dict:
    """Σ|d|, Σ mass and Σ scale (ρ's normaliser) per node kind; W (B, T) in the loss's units."""
    out = {}
    for kind, sn in nodes.items():
        k = node_coefficients(W, batch, sn)
        out[f"{prefix}residual_{kind}"] = k.d.abs().sum()
        out[f"{prefix}mass_{kind}"] = k.mass.sum()
        out[f"{prefix}scale_{kind}"] = k.scale.sum()
    return out


def rho_ratios(prefix: str = "") -> list[Ratio]:
    why = "no node of the kind, or W ≡ 0 at its nodes (every group tied)"
    return [Ratio(f"{prefix}rho_{k}", f"{prefix}residual_{k}", f"{prefix}scale_{k}", why)
            for k in KINDS]


class Residual(Instrument):
    """ρ = Σ|d| / Σ scale at full-group (prefix) and trie nodes, from W's own advantages
    (`objective.prepare`: per-token for IBPO); shared-token counts and, where the host gives
    entropy, the mean entropy at full-group tokens."""

    name = "residual"
    writes = ("rho_prefix", "rho_trie", "shared_frac_prefix", "shared_frac_trie", "entropy_shared",
              "residual_*", "mass_*", "scale_*", "n_shared_*")

    def measure(self, view) -> Readings:
        nodes = view.nodes()
        r = Readings()
        r.sums.update(residual_sums(view.W, view.trained, nodes))
        for kind, sn in nodes.items():
            r.sums[f"n_shared_{kind}"] = (sn.node >= 0).sum()
        if getattr(view, "entropy", None) is not None:
            r.sums["entropy_shared_sum"] = (view.entropy * (nodes["prefix"].node >= 0)).sum()
        return r

    def quantities(self) -> list:
        out = rho_ratios()
        out += [Ratio(f"shared_frac_{k}", f"n_shared_{k}", "n_tokens", "no response token", unit="share")
                for k in KINDS]
        out.append(Ratio("entropy_shared", "entropy_shared_sum", "n_shared_prefix",
                         "no full-group token", drop_num=True, unit="nats"))
        return out


class Modulation(Instrument):
    """max |W − closed form| (`w_dev`, the exactness check of a measured W) and max |W|."""

    name = "modulation"
    needs = frozenset({"W", "batch", "objective"})
    writes = ("w_dev", "w_max")

    def measure(self, view) -> Readings:
        W = view.W
        return Readings(maxes={"w_dev": (W - view.objective.modulation(view.batch)).abs().max(),
                               "w_max": W.abs().max()})


class SameBatch(Instrument):
    """The residual sums of other objectives' closed-form W on this very batch (`cf/<name>/…`,
    same-batch mode). others: (name, objective) pairs."""

    name = "same_batch"
    needs = frozenset({"batch", "others"})
    writes = ("cf/<objective>/rho_prefix", "cf/<objective>/rho_trie")

    def __init__(self, schedule=None, others: list | tuple = ()) -> None:
        super().__init__(schedule)
        self.others = list(others)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.others]

    def measure(self, view) -> Readings:
        nodes = view.nodes()
        r = Readings()
        for name, obj in self.others:
            r.sums.update(residual_sums(obj.modulation(view.batch), obj.prepare(view.batch), nodes,
                                        f"cf/{name}/"))
        return r

    def quantities(self) -> list:
        return [q for n in self.names for q in rho_ratios(f"cf/{n}/")]


class Attribution(Instrument):
    """Share of the full-group residual each mechanism (coupling, length, clip) accounts for:
    attr_m = Σ(res − res_off) / Σ res over the scheduled steps' nodes. A loss with nothing to
    switch off (a user loss) gives NaN: undefined."""

    name = "attribution"
    needs = frozenset({"batch", "objective"})
    writes = ("attr_coupling", "attr_length", "attr_clip", "attr_residual")
    cost = "closed-form"

    def measure(self, view) -> Readings:
        obj = view.objective
        if not getattr(obj, "mechanisms", True):
            nan = torch.tensor(float("nan"), dtype=torch.float64)
            return Readings(sums={"attr_residual": nan, **{f"attr_{m}_sum": nan for m in MECHANISMS}})
        att = attribution_sums(obj, view.batch, "prefix")
        r = Readings(sums={"attr_residual": torch.tensor(att.pop("residual"), dtype=torch.float64)})
        r.sums.update({f"attr_{m}_sum": torch.tensor(v, dtype=torch.float64) for m, v in att.items()})
        return r

    def quantities(self) -> list:
        return [Ratio(f"attr_{m}", f"attr_{m}_sum", "attr_residual",
                      "the residual Σ|d| is 0 (nothing to attribute)", drop_num=True, unit="share")
                for m in MECHANISMS]


class Tax(Instrument):
    """The learning tax: ‖g_tax‖ / ‖g‖, its cosine with g, per layer group (one extra forward
    and backward over the nodes' representative rows; the host computes g_tax, reduced over
    ranks). Shares are averaged over the steps where they are defined."""

    name = "tax"
    needs = frozenset({"W", "batch", "model", "grads"})
    writes = ("tax_share", "tax_cos", "tax_norm", "total_norm", "tax_share/<layer group>")
    phase, cost = "update", "forward"

    def before(self, view) -> Readings:
        return self.readings(view.learning_tax())

    @staticmethod
    def readings(d: dict) -> Readings:
        """Readings of a `gradlab.probes.tax.tax_report` dict (one step's figures)."""
        r = Readings()
        for k in ("tax_norm", "total_norm"):
            r.mean(k, d[k])
        r.mean("tax_share", d["tax_share"], d["total_norm"] != 0)
        r.mean("tax_cos", d["tax_cos"], d["tax_norm"] * d["total_norm"] != 0)
        for group, g in d["groups"].items():
            r.mean(f"tax_share/{group}", g["tax_share"], g["total_norm"] != 0)
        return r


class Drift(Instrument):
    """How the step moved the policy at full-group nodes: Δ log π of the shared token and
    KL(π_before ‖ π_after) (a capped sample of nodes), from forwards before and after."""

    name = "drift"
    needs = frozenset({"batch", "model"})
    writes = ("drift_node_dlogp_mean", "drift_node_kl_mean", "drift_node_*")
    phase, cost = "update", "forward"

    def before(self, view) -> None:
        view.keep_node_logprobs()

    def after(self, view) -> Readings:
        moved = view.node_drift()  # (N,) Δ log π, (K,) KL; None without a node
        if moved is None:
            return Readings()
        return Readings(sums={f"drift_{k}": v for k, v in drift_sums(*moved).items()})

    def quantities(self) -> list:
        why = "no full-group node"
        return [Ratio("drift_node_dlogp_mean", "drift_node_dlogp_sum", "drift_node_count", why, unit="nats"),
                Ratio("drift_node_kl_mean", "drift_node_kl_sum", "drift_node_kl_count", why, unit="nats")]


class DivergentDrift(Instrument):
    """Δ log π of the sampled token at divergent positions (in no full-group node), by the
    sign of the advantage: one forward over the step's rows after the step."""

    name = "drift_divergent"
    needs = frozenset({"batch", "model"})
    writes = ("drift_div_pos_dlogp_mean", "drift_div_neg_dlogp_mean", "drift_div_*")
    phase, cost = "update", "forward"

    def after(self, view) -> Readings:
        after = view.sampled_after()
        if after is None:
            return Readings()
        out = divergent_dlogp(view.trained.logps, after, view.trained, view.nodes()["prefix"])
        return Readings(sums={f"drift_{k}": v for k, v in out.items()})

    def quantities(self) -> list:
        return [Ratio(f"drift_{s}_dlogp_mean", f"drift_{s}_dlogp_sum", f"drift_{s}_count",
                      f"no divergent token with A {'>' if s == 'div_pos' else '<'} 0", unit="nats")
                for s in ("div_pos", "div_neg")]


class Flips(Instrument):
    """The token-flip ledger: Δ log π of every sampled token across the step, by advantage
    sign × node kind × confidence (`gradlab.probes.flips`)."""

    name = "flips"
    needs = frozenset({"batch", "model"})
    writes = ("flips/<sign>/<kind>/<confidence>/<field>",)
    phase, cost = "update", "forward"

    def after(self, view) -> Readings:
        after = view.sampled_after()
        if after is None:
            return Readings()
        trained = view.trained
        return Readings(sums=flip_ledger(trained.logps, after, trained, nodes=view.nodes()["trie"]))

    def quantities(self) -> list:
        return [Derived(FLIPS, flip_shares, "no token in the cell; flipped_share of A = 0 tokens")]


class Fisher(Instrument):
    """Is the step small? Prop. 3.1 at a sample of full-group nodes: the measured
    KL(π_θ ‖ π_θ+δ) of the step δ just taken against ½ δᵀF(h)δ, the Fisher's quadratic form
    (float64, one forward-mode pass per node context; `gradlab.probes.fisher`). Their ratio
    `fisher_kl_ratio` → 1 on small steps; far from 1: the step is not in the quadratic regime.
    Holds a copy of θ across the step and a float64 copy of the model while it measures."""

    name = "fisher"
    needs = frozenset({"batch", "model"})
    writes = ("fisher_kl_ratio", "fisher_*")
    phase, cost = "update", "forward"
    curves = (("fisher_kl_ratio", "KL / ½ δᵀFδ at shared contexts (Prop. 3.1)"),)

    def __init__(self, schedule=None, nodes: int = 8) -> None:
        super().__init__(schedule)
        self.nodes = nodes  # node contexts measured per optimizer step (evenly spaced)

    def before(self, view) -> None:
        view.keep_params()

    def after(self, view) -> Readings:
        got = view.fisher(self.nodes)
        if got is None:
            return Readings()
        return Readings(sums={"fisher_kl_sum": got["kl"].sum(),
                              "fisher_half_sum": got["half_fisher"].sum(),
                              "fisher_nodes": torch.tensor(got["kl"].numel())})

    def quantities(self) -> list:
        return [Ratio("fisher_kl_ratio", "fisher_kl_sum", "fisher_half_sum",
                      "no full-group node, or a zero step (δᵀFδ = 0)")]
