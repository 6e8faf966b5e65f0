"""Live logging: a tiny run with --log tensorboard streams every metric of the run store."""

import pytest

import gradlab
from gradlab.loop.config import RunConfig
from gradlab.loop.runs.livelog import LiveLogger, scalars
from gradlab.loop.train import train


def test_tensorboard_events_match_the_run_store(tmp_path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "run"
    train(RunConfig(out=str(out), objectives=["grpo", "gspo"], steps=2, prompts=2, G=4,
                    minibatches=2, probe_contexts=2, tax_every=1, progress=False,
                    trace_every=0, log="tensorboard"))
    wide = gradlab.load_run(out, wide=True)
    for obj in ("grpo", "gspo"):
        ea = ea_mod.EventAccumulator(str(out / "tb" / obj))
        ea.Reload()
        tags = set(ea.Tags()["scalars"])
        assert {"reward", "rho_prefix", "loss", "tax_share"} <= tags
        for tag in ("reward", "rho_prefix", "probe_kl"):
            ev = ea.Scalars(tag)
            assert [e.step for e in ev] == [0, 1]
            store = wide[wide["objective"] == obj].sort_values("step")[tag].to_numpy()
            assert [e.value for e in ev] == pytest.approx(store.tolist(), rel=1e-6)
    assert not (out / "traces").exists()  # --trace-every 0: no traces


def test_scalars_keep_finite_numbers_only():
    rec = {"step": 3, "objective": "grpo", "reward": 0.5, "x": float("nan"), "s": "text",
           "flag": True, "n": 2}
    assert scalars(rec) == {"reward": 0.5, "n": 2.0}
    LiveLogger("", "unused").log(rec)  # off: a no-op, no folder


def test_resume_replaces_the_events_written_after_the_checkpoint(tmp_path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "run"
    kw = dict(out=str(out), objectives=["grpo"], prompts=2, G=4, minibatches=2, probe_contexts=2,
              tax_every=0, trace_every=0, progress=False, ckpt_every=1, log="tensorboard")
    train(RunConfig(steps=2, **kw))
    stale = LiveLogger("tensorboard", out)  # as if step 2 was logged, then a crash
    stale.log({"step": 2, "objective": "grpo", "reward": 99.0})
    stale.close()
    train(RunConfig(steps=3, **kw), resume=True)
    ea = ea_mod.EventAccumulator(str(out / "tb" / "grpo"))
    ea.Reload()
    wide = gradlab.load_run(out, wide=True).sort_values("step")
    ev = ea.Scalars("reward")
    assert [e.step for e in ev] == [0, 1, 2]
    assert [e.value for e in ev] == pytest.approx(wide["reward"].tolist())
