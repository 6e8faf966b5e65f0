"""Instruments: the registry and its spec, the presets against the run flags, a user's
instrument in the loop (against an independent computation) and in TRL, and `gradlab view`."""

import json
import math
from pathlib import Path

import pytest
import torch

import gradlab
import gradlab.instruments as gi
from gradlab.core import objectives
from gradlab.core.batch import advantages
from gradlab.core.nodes import shared_nodes
from gradlab.loop.config import ConfigError, RunConfig
from gradlab.loop.rollouts.rollout import generate
from gradlab.loop.scale.dist import Dist
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask
from gradlab.loop.train import Learner, train
from gradlab.loop.update.metrics import StepMetrics
from gradlab.loop.update.step import StepWork, optimizer_step
from gradlab.viz.html import view

ROOT = Path(__file__).parents[1]
OWN = f"{ROOT / 'examples' / 'own_instrument.py'}:SharedMass"
SMALL = dict(objectives=["grpo", "gspo"], steps=3, prompts=3, G=4, minibatches=2, tax_every=2,
             eval_every=0, probe_contexts=4, progress=False, ckpt_every=100)


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if not k.startswith("time_"):
                assert x[k] == y[k] or (x[k] != x[k] and y[k] != y[k]), k  # NaN == NaN


def test_registry_lists_every_builtin_and_names_what_is_wrong():
    assert {"modulation", "residual", "same_batch", "attribution", "tax", "drift",
            "drift_divergent", "flips"} <= set(gi.available())
    got = gi.resolve("cheap,tax@10,flips@off")
    assert [i.name for i in got] == ["modulation", "residual", "tax", "flips"]
    assert got[2].schedule.every == 10 and not got[3].schedule.enabled
    assert [i.schedule.every for i in gi.resolve("default", heavy_every=3)] == [1, 1, 3, 3, 1, 3]
    for bad, match in (("nope", "unknown instrument 'nope'"), ("tax@x", "schedule 'x'"),
                       ("default@2", "preset takes no @"),
                       ("gradlab.core.objectives:get", "not a gradlab.instruments.Instrument"),
                       (f"{ROOT / 'examples' / 'own_instrument.py'}:Nope", "no callable 'Nope'")):
        with pytest.raises(ValueError, match=match):
            gi.resolve(bad)

    class Twin(gi.Instrument):
        name = "residual"

    with pytest.raises(ValueError, match="already"):
        gi.register(Twin)


def test_presets_equal_their_instruments_at_tax_every(tmp_path):
    """"default" is what a run measures unless told, and "full" is the same instruments spelled
    out, the sparse ones every tax_every steps: the same metrics, bitwise."""
    k = SMALL["tax_every"]
    train(RunConfig(out=str(tmp_path / "unset"), **SMALL))
    train(RunConfig(out=str(tmp_path / "default"), instruments="default", **SMALL))
    _same(_rows(tmp_path / "unset"), _rows(tmp_path / "default"))
    spelled = f"modulation,residual,attribution@{k},tax@{k},drift,drift_divergent@{k},flips@{k}"
    train(RunConfig(out=str(tmp_path / "spelled"), instruments=spelled, **{**SMALL, "steps": 1}))
    train(RunConfig(out=str(tmp_path / "full"), instruments="full", **{**SMALL, "steps": 1}))
    _same(_rows(tmp_path / "spelled"), _rows(tmp_path / "full"))
    more = _rows(tmp_path / "default")[0].keys() - {"rho_prefix", "tax_share"}
    cheap = tmp_path / "cheap"
    train(RunConfig(out=str(cheap), instruments="cheap", **{**SMALL, "steps": 1}))
    row = _rows(cheap)[0]
    assert "rho_prefix" in row and "tax_share" not in row and "drift_node_kl_mean" not in row
    assert more  # the default run measured more
    names = [r["name"] for r in json.loads((cheap / "instruments.json").read_text())]
    assert names == ["loop", "modulation", "residual"]  # the loop's own records first
    with pytest.raises(ConfigError, match="--instruments"):
        train(RunConfig(out=str(tmp_path / "bad"), instruments="nope", **SMALL))


@pytest.fixture(scope="module")
def step():
    model, tok = load_policy()
    ro = generate(model, tok, ArithmeticTask().problems(4, seed=3), G=4, max_new_tokens=12,
                  row_keys=torch.arange(16))
    ro.rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0])
    return model, ro


def _measured(model, ro, inst, lr: float = 0.1) -> dict:
    """One real optimizer step (SGD) of GSPO on every row, measured by `inst` (one or a list)."""
    import copy

    m = copy.deepcopy(model).train()
    learner = Learner("gspo", objectives.get("gspo"), m, torch.optim.SGD(m.parameters(), lr=lr),
                      torch.Generator())
    insts = inst if isinstance(inst, list) else [inst]
    acc = StepMetrics()
    work = StepWork(ro, advantages(ro.rewards, ro.group), torch.arange(16), 0)
    optimizer_step(learner, RunConfig(G=4, progress=False), work, acc, gi.InstrumentSet(insts),
                   Dist())
    return acc.finish()


def _reference(model, ro) -> float:
    """Independently: W in closed form on the same batch, full-group nodes, float64 sums."""
    from gradlab.loop.numerics.logprobs import token_logps

    rows = torch.arange(16)
    with torch.no_grad():
        lp = token_logps(model.train(), ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                         ro.response_mask)
    b = gradlab.TokenBatch(ro.response_ids, ro.response_mask, lp, ro.old_logps,
                           advantages(ro.rewards, ro.group), ro.group[rows])
    W = objectives.get("gspo").modulation(b).double().abs() * b.mask
    at = shared_nodes(b, "prefix").node >= 0
    return float((W * at).sum() / W.sum())


def test_own_instrument_equals_an_independent_computation(step):
    from gradlab.core.userloss import load_loss

    own = load_loss(OWN)  # as `--instruments path.py:Class` imports it
    model, ro = step
    got = _measured(model, ro, own())["shared_mass_share"]
    ref = _reference(model, ro)
    assert 0 < ref < 1 and got == pytest.approx(ref, rel=1e-5)

    class Misplaced(own):  # an injected bug: trie nodes where full-group nodes were meant
        def measure(self, view):
            shared = view.nodes()["trie"].node >= 0
            mass = view.W.abs() * view.batch.mask
            return gi.Readings(sums={"shared_mass": (mass * shared).sum(), "total_mass": mass.sum()})

    assert _measured(model, ro, Misplaced())["shared_mass_share"] != pytest.approx(ref, rel=1e-5)


def test_own_instrument_in_the_loop_is_scheduled_and_drawn(tmp_path):
    run = tmp_path / "run"
    train(RunConfig(out=str(run), instruments=f"cheap,{OWN}@2", **SMALL))
    rows = _rows(run)
    have = {(r["objective"], r["step"]): r.get("shared_mass_share") for r in rows}
    assert all(v is not None and 0 <= v <= 1 for (o, s), v in have.items() if s % 2 == 0)
    assert all(v is None for (o, s), v in have.items() if s % 2)  # @2: steps 0, 2 only
    man = json.loads((run / "instruments.json").read_text())
    assert man[-1]["curves"] == [["shared_mass_share", "share of |W| on full-group tokens"]]
    page = view(run).read_text()
    assert "share of |W| on full-group tokens" in page  # its panel in the page's SVG


def test_manifest_names_every_metric_of_a_full_run(tmp_path):
    """Every metric a run of the `full` preset writes into metrics.jsonl is named in its
    instruments.json (by name, or by the family of a rule whose names are known at run time),
    with a unit; every ratio with the reason it can be undefined."""
    run = tmp_path / "full"
    train(RunConfig(out=str(run), instruments="full", **{**SMALL, "objectives": ["grpo"],
                                                         "steps": 1, "tax_every": 1}))
    keys = set().union(*(r.keys() for r in _rows(run))) - {"step", "objective", "seed", "tokens",
                                                            "undefined"}
    entries = [q for row in json.loads((run / "instruments.json").read_text())
               for q in row.get("metrics", [])]
    names = {q["name"]: q for q in entries if "name" in q}
    families = [q for q in entries if "family" in q]

    def entry(k: str) -> dict | None:
        return names.get(k) or next((q for q in families if k.startswith(q["family"])), None)

    assert any(k.startswith("flips/") for k in keys) and "tax_share" in keys  # the full preset
    unnamed = sorted(k for k in keys if entry(k) is None)
    assert not unnamed, f"metrics.jsonl keys the manifest does not name: {unnamed[:12]}"
    assert all(entry(k)["unit"] for k in keys)
    ratios = [q for q in entries if "name" in q and not q.get("part_of") and q["unit"] == "ratio"]
    assert ratios and all(q["undefined"] for q in ratios)
    assert names["rho_prefix"]["undefined"] == gi.Residual().quantities()[0].undefined
    assert names["entropy"]["unit"] == "nats" and names["accuracy"]["unit"] == "share"


def test_own_instrument_in_trl_equals_the_window_computation(tmp_path):
    pytest.importorskip("trl")
    from test_trl import run as trl_run

    from gradlab.integrations.trl import GradlabConfig

    gl = GradlabConfig(store=str(tmp_path / "store"), keep_windows=True, instruments=OWN)
    tr = trl_run(tmp_path, "dr_grpo", "token", gl=gl)
    tr.gradlab_store.close()  # release the run folder's lock (other tests check none is held)
    assert tr.gradlab_windows
    for w in tr.gradlab_windows:
        W = w.W.double().abs() * w.batch.mask
        at = shared_nodes(w.batch, "prefix").node >= 0
        ref = float((W * at).sum() / W.sum()) if float(W.sum()) else math.nan
        # the instrument sums W in its float32, the reference in float64: round-off only
        assert w.metrics["shared_mass_share"] == pytest.approx(ref, rel=1e-6, nan_ok=True)
    logged = gradlab.load_run(tmp_path / "store", wide=True)
    assert "shared_mass_share" in logged.columns
    assert "share of |W| on full-group tokens" in view(tmp_path / "store").read_text()
    assert GradlabConfig(instruments="tax").instrument_set()  # TRL gives the model and grads
    with pytest.raises(ValueError, match="unknown instrument 'taxx'"):
        GradlabConfig(instruments="taxx")


def test_the_guide_shows_the_example_as_it_runs():
    ex = (ROOT / "examples" / "own_instrument.py").read_text()
    page = (ROOT / "docs" / "guides" / "own-instrument.md").read_text()
    assert ex[ex.index("import gradlab.instruments"):] in page
    body = ex[ex.index("@gi.register"):]
    assert len([x for x in body.splitlines() if x.strip()]) <= 22  # about 20 lines


def test_fisher_kl_is_the_drift_kl_and_the_quadratic_form_on_a_small_step(step):
    """The Fisher instrument's KL (float64, functional forward) equals the drift instrument's
    KL at the same nodes (float32, the loop's batched forward); on a small step it equals
    ½ δᵀFδ (Prop. 3.1), on a large one it does not."""
    model, ro = step
    out = _measured(model, ro, [gi.Drift(), gi.Fisher(nodes=1000)], lr=0.3)
    assert out["fisher_nodes"] == out["drift_node_kl_count"] > 0  # every node, both
    kl = out["fisher_kl_sum"] / out["fisher_nodes"]
    assert kl > 0 and kl == pytest.approx(out["drift_node_kl_mean"], rel=1e-3)
    small = _measured(model, ro, gi.Fisher(nodes=4), lr=1e-3)
    assert small["fisher_nodes"] == 4 and small["fisher_kl_ratio"] == pytest.approx(1.0, abs=0.02)
    assert abs(out["fisher_kl_ratio"] - 1) > abs(small["fisher_kl_ratio"] - 1)
    with pytest.raises(ValueError, match="--fsdp"):
        from gradlab.loop.update.view import loop_instruments

        loop_instruments(RunConfig(fsdp=True, instruments="fisher"))


def test_overhead_table_is_the_committed_measurement_and_the_benchmark_runs(capsys):
    """The docs' overhead table is the rendering of figures/instrument_overhead.json (each
    number quoted has that source), and the benchmark that writes it runs (quick sizes)."""
    from analyses.benchmarks import bench_instruments as bench
    from analyses.tools.quoted_data import replace_table

    data = json.loads((ROOT / "figures" / "instrument_overhead.json").read_text())
    page = (ROOT / "docs" / "concepts" / "instruments.md").read_text()
    assert replace_table(page, "instrument-overhead", bench.table(data)) == page
    assert set(data["models"][0]["cpu_s"]) == set(bench.configs())
    bench.main(["--quick"])
    assert "| fisher |" in capsys.readouterr().out


def test_w_is_measured_only_when_a_due_instrument_or_the_tracer_reads_it(step, tmp_path):
    """The W hook of the forward/backward is registered for the presets that read W (cheap),
    not for instruments="off" — unless the step is traced (the token traces carry W)."""
    import copy

    from gradlab.loop.runs.traces import TraceWriter
    from gradlab.loop.update.step import _forward_backward
    from gradlab.loop.update.view import loop_instruments, step_view

    model, ro = step
    m = copy.deepcopy(model).train()
    learner = Learner("gspo", objectives.get("gspo"), m, torch.optim.SGD(m.parameters(), lr=0.1),
                      torch.Generator())
    rows = torch.arange(16)
    work = StepWork(ro, advantages(ro.rewards, ro.group), rows, 1)
    for spec, traced, measured in (("off", False, False), ("cheap", False, True),
                                   ("off", True, True)):
        cfg = RunConfig(G=4, progress=False, instruments=spec)
        learner.tracer = TraceWriter(tmp_path, 1, 2) if traced else None
        view = step_view(m, cfg, ro, rows, Dist(), objective=learner.objective)
        _forward_backward(learner, cfg, work, view, loop_instruments(cfg), Dist())
        assert (view.W is not None) == measured, (spec, traced)
        if measured:  # the hook's W is the closed form's (GSPO), on the step's batch
            torch.testing.assert_close(view.W, learner.objective.modulation(view.batch))
        m.zero_grad(set_to_none=True)
