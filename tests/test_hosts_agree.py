"""Every host hands the instruments the same primitives, so every quantity agrees.

One fixed generation batch on the shipped tiny policy (prompts of one length: TRL's forward takes
no position ids, gradlab's derives them from the mask, and the two agree only without padding),
one GSPO loss and its accumulated gradient. gradlab's loop (`step_view`: its own forward at the
run's temperature) and TRL's trainer (`trl_view`: TRL's own `_get_per_token_logps_and_entropies`
and the step's rows as TRL's loss calls hand them over) each build their view of the step; the
same instrument objects of the `full` preset (+ fisher) measure both around the same optimizer
step. Every metric agrees to round-off — and a perturbed primitive of one host is caught.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

from gradlab.instruments import InstrumentSet, reduce_readings, resolve  # noqa: E402
from gradlab.integrations.audit.trl_setup import WORKLOADS, grpo_args, make_trainer, quiet  # noqa: E402
from gradlab.integrations.trl import host as trl_host  # noqa: E402
from gradlab.integrations.trl.host import closed_form, trl_view  # noqa: E402
from gradlab.loop.config import RunConfig  # noqa: E402
from gradlab.loop.numerics.logprobs import token_logps  # noqa: E402
from gradlab.loop.rollouts.rollout import generate  # noqa: E402
from gradlab.loop.scale.dist import Dist  # noqa: E402
from gradlab.loop.setup.task import ArithmeticTask  # noqa: E402
from gradlab.loop.update.view import step_view  # noqa: E402

G = 4
SPEC = "full,fisher"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    with quiet():
        args = grpo_args("grpo", "sequence", 1, 1, str(tmp_path_factory.mktemp("trl")), G=G,
                         prompts=3)
        tr = make_trainer(args, WORKLOADS["lengths"], None)
    model, tok = tr.model, tr.processing_class
    task = ArithmeticTask()
    problems = task.problems(64, seed=3)
    lengths = [len(tok(p.prompt)["input_ids"]) for p in problems]
    common = max(set(lengths), key=lengths.count)
    chosen = [p for p, n in zip(problems, lengths) if n == common][:3]
    g = torch.Generator().manual_seed(1)
    ro = generate(model, tok, chosen, G, 24, 1.0, generator=g)
    assert bool(ro.prompt_mask.all()), "the fixture needs prompts without padding"
    # unequal lengths (the tiny policy runs to the cap): cut row i after 24 − 3·(i mod 5) tokens
    for i in range(ro.response_ids.shape[0]):
        cut = 24 - 3 * (i % 5)
        ro.response_mask[i, cut:] = False
        ro.response_ids[i, cut:] = tok.pad_token_id
    return tr, ro


def measure(tr, ro, perturb: str | None = None, monkeypatch=None) -> tuple[dict, dict]:
    """Both hosts' metrics of one optimizer step on the fixed batch: (loop, trl)."""
    model = tr.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    B = ro.response_ids.shape[0]
    rows = torch.arange(B)
    cfg = RunConfig(temperature=tr.temperature, progress=False)
    obj = closed_form("grpo", "sequence", tr.args)
    rewards = torch.arange(B, dtype=torch.float32) % 3  # no tied group
    A = (rewards - rewards.view(-1, G).mean(1).repeat_interleave(G))
    model.zero_grad(set_to_none=True)
    lp = token_logps(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask,
                     cfg.temperature)
    b = ro.token_batch(lp, A, old_logps=lp.detach(), validate=False)
    loss = obj.loss(b)
    W = -torch.autograd.grad(loss, lp, retain_graph=True)[0]
    loss.backward()
    frozen = ro.token_batch(lp.detach(), A, old_logps=lp.detach(), validate=False)
    gen = {"prompt_ids": ro.prompt_ids, "prompt_mask": ro.prompt_mask, "tokens": ro.response_ids,
           "mask": ro.response_mask.bool(), "advantages": A, "group": ro.group}
    parts = [{"row": rows, "logps": lp.detach(), "old": None, "W": W.detach()}]
    if perturb == "W" and monkeypatch is not None:
        real = trl_host.step_batch
        monkeypatch.setattr(trl_host, "step_batch", lambda gen, parts: (
            lambda r: (r[0], r[1], r[2] * 1.001, r[3]))(real(gen, parts)))
    if perturb == "rows" and monkeypatch is not None:  # TRL's forward reads the wrong rows
        real_policy = trl_host.trl_policy
        monkeypatch.setattr(trl_host, "trl_policy", lambda t, gen, r: real_policy(t, gen, r.roll(1)))
    views = {"loop": step_view(model, cfg, ro, rows, Dist(), batch=frozen, W=W.detach(),
                               objective=obj),
             "trl": trl_view(tr, gen, parts, obj)}
    sets = {h: InstrumentSet(resolve(SPEC)) for h in views}
    readings = {h: [sets[h].measure(v, 0)] for h, v in views.items()}
    for h, v in views.items():
        for inst in sets[h].due(0, "update"):
            if (r := inst.before(v)) is not None:
                readings[h].append(r)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad / (p.grad.norm() + 1e-12)
    for h, v in views.items():
        for inst in sets[h].due(0, "update"):
            readings[h].append(inst.after(v))
    model.load_state_dict(state)
    n = float(ro.response_mask.sum())
    return tuple(reduce_readings(readings[h], sets[h].quantities(), {"n_tokens": n})
                 for h in ("loop", "trl"))


def disagreements(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    out = [f"{k}: only one host" for k in sorted(set(a) ^ set(b))]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if math.isnan(x) and math.isnan(y):
            continue
        if not (abs(x - y) <= atol + rtol * max(abs(x), abs(y))):
            out.append(f"{k}: loop {x!r} vs trl {y!r}")
    return out


def test_loop_and_trl_measure_the_same_step_alike(setup):
    tr, ro = setup
    loop, trl = measure(tr, ro)
    assert not disagreements(loop, trl), disagreements(loop, trl)[:10]
    # the comparison covers what `full` measures, defined where the batch allows
    for k in ("w_dev", "rho_prefix", "tax_share", "drift_node_kl_mean", "attr_coupling",
              "flips/signed/all/all/flipped_share", "fisher_kl_ratio"):
        assert k in loop and not math.isnan(loop[k]), k
    assert loop["w_dev"] < 1e-5  # TRL's closed form is the loss that made W
    assert 0.5 < loop["fisher_kl_ratio"] < 2  # a small step: KL ≈ ½ δᵀFδ (Prop. 3.1)


@pytest.mark.parametrize("perturb", ["W", "rows"])
def test_a_perturbed_host_primitive_is_caught(setup, monkeypatch, perturb):
    tr, ro = setup
    loop, trl = measure(tr, ro, perturb, monkeypatch)
    assert disagreements(loop, trl)


if __name__ == "__main__":  # the numbers, by hand
    import tempfile

    class _F:
        def mktemp(self, name):
            return tempfile.mkdtemp()

    tr, ro = setup.__wrapped__(_F())
    loop, trl = measure(tr, ro)
    for k in sorted(loop):
        if not k.startswith("flips/"):
            print(k, loop[k], trl.get(k))
