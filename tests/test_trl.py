"""TRL integration: W measured on GRPOTrainer's own loss, groups, cancellation, DFPO drop-in, audit.

Real (tiny, CPU, offline) TRL runs: 4 prompts × G = 8 per generation batch, a few steps each.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from tolerance import assert_close_f32
from trl import GRPOTrainer

import gradlab
from gradlab import objectives
from gradlab.core.batch import TokenBatch
from gradlab.integrations.audit import trl as trl_audit
from gradlab.integrations.audit.trl import WORKLOADS, grpo_args, pool_windows, quiet
from gradlab.integrations.trl.host import closed_form
from gradlab.integrations.trl.trainer import (
    GROUP_KEY,
    ROW_KEY,
    GradlabConfig,
    GradlabGRPOTrainer,
    reconstruct_groups,
)

G = 8


class Capturing(GradlabGRPOTrainer):
    """Keeps (model state, inputs) of every training loss call, taken before its backward."""

    def __init__(self, *args, **kwargs) -> None:
        self.captured = []
        super().__init__(*args, **kwargs)

    def _compute_loss(self, model, inputs):
        if model.training:
            self.captured.append((copy.deepcopy(model.state_dict()), dict(inputs)))
        return super()._compute_loss(model, inputs)


def run(tmp_path, loss_type="dr_grpo", level="token", spg=1, gens=2, workload="arithmetic",
        cls=GradlabGRPOTrainer, gl=None, **extra):
    """Train `gens` generation batches of `spg` optimizer steps; returns the trainer."""
    with quiet():
        args = grpo_args(loss_type, level, spg, gens * spg, str(tmp_path / "out"), **extra)
        gl = gl or GradlabConfig(store=str(tmp_path / "store"), keep_windows=True)
        tr = trl_audit.make_trainer(args, WORKLOADS[workload], gl, cls=cls)
        tr.train()
    return tr


def trl_autograd_W(tr, state: dict, inputs: dict) -> torch.Tensor:
    """−∂loss/∂logps of TRL's own `_compute_loss`, by torch.autograd.grad (no hooks)."""
    model = copy.deepcopy(tr.model)
    model.load_state_dict(state)
    got = {}

    def spy(*a, **k):  # keeps the grad-carrying log-probs the loss is built from
        out = GRPOTrainer._get_per_token_logps_and_entropies(tr, *a, **k)
        if out[0].requires_grad and "lp" not in got:
            got["lp"] = out[0]
        return out

    tr._get_per_token_logps_and_entropies = spy
    try:
        loss = GRPOTrainer._compute_loss(tr, model, inputs)
    finally:
        del tr._get_per_token_logps_and_entropies
    return -torch.autograd.grad(loss, got["lp"])[0]


class Lengths(GradlabGRPOTrainer):
    """Keeps the length of every generated completion (TRL's own lists, before padding)."""

    def __init__(self, *args, **kwargs) -> None:
        self.lengths = []
        super().__init__(*args, **kwargs)

    def _generate(self, prompts):
        out = super()._generate(prompts)
        self.lengths.append([len(c) for c in out[1]])  # (prompt_ids, completion_ids, ...)
        return out


def test_truncated_completions_stay_in_the_nodes_with_W_zero(tmp_path):
    """mask_truncated_completions: a completion cut at max_completion_length carries no loss
    but keeps its tokens in its group's nodes with W = 0, so ρ counts the gradient its group
    lost there. W and ρ equal gradlab's closed form (dr_grpo: A_i / (B·L) on the loss tokens)
    on the same batch, nodes built from every sampled token."""
    from gradlab.core.cancellation import cancellation
    from gradlab.core.nodes import shared_nodes

    L = 12  # the "lengths" workload's responses run 7..15 tokens: some groups lose a few rows
    tr = run(tmp_path, "dr_grpo", "token", spg=1, gens=1, workload="lengths", cls=Lengths,
             max_completion_length=L, mask_truncated_completions=True)
    w = tr.gradlab_window
    n = torch.tensor(tr.lengths[-1])
    sampled = torch.arange(w.batch.T) < n[:, None]
    last = w.batch.tokens.gather(1, (n - 1)[:, None]).squeeze(1)
    truncated = (n == L) & (last != tr.processing_class.eos_token_id)  # TRL's rule
    assert 0 < int(truncated.sum()) < len(n)
    assert torch.equal(w.batch.mask, sampled)  # the nodes see every sampled token
    assert torch.equal(w.loss_mask, sampled & ~truncated[:, None])  # TRL's loss: not these
    assert bool((w.W[truncated] == 0).all()) and bool((w.W[~truncated] != 0).any())
    sn = shared_nodes(w.batch, "prefix")
    assert bool((sn.node[truncated] >= 0).any())  # truncated rows are members of full-group nodes
    assert w.metrics["n_shared_prefix"] == int((sn.node >= 0).sum())  # one optimizer step
    # gradlab's closed form on the same batch: W from the loss tokens, ρ at every sampled token
    W_cf = closed_form("dr_grpo", "token", tr.args).modulation(
        w.batch.replace(mask=w.loss_mask))
    assert_close_f32(w.W, W_cf, msg="hooked W vs dr_grpo closed form")
    c = cancellation(W_cf, w.batch, sn=sn)
    assert c.ratio > 1e-3  # on-policy dr_grpo cancels but for the dropped rows' share
    assert w.metrics["rho_prefix"] == pytest.approx(c.ratio, rel=1e-4)
    assert w.metrics["mass_prefix"] == pytest.approx(c.mass, rel=1e-4)


class Detached(GradlabGRPOTrainer):
    """A loss whose backward never reaches the log-probs (its value kept, its graph cut)."""

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        return loss.detach() + 0 * next(model.parameters()).sum()


def test_a_loss_call_the_backward_never_reached_is_named(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="gradlab"):
        tr = run(tmp_path, "dr_grpo", "token", spg=1, gens=1, cls=Detached)
    assert (tr.gradlab_window.W == 0).all()
    assert "did not reach the policy log-probs" in caplog.text


def test_dfpo_acts_on_groups_with_a_truncated_completion_and_leaves_it_at_zero(tmp_path):
    """DFPO with mask_truncated_completions: the group of a dropped completion keeps its
    full-group nodes, the transform acts there on the rows that carry loss, and the dropped
    row's W̃ stays 0 (no gradient into a row TRL's loss leaves out)."""
    from gradlab.core.nodes import shared_nodes

    gl = GradlabConfig(store=None, dfpo="orth", keep_windows=True)
    tr = run(tmp_path, "grpo", "sequence", spg=4, gens=1, lr=3e-3, gl=gl, workload="lengths",
             max_completion_length=12, mask_truncated_completions=True)
    w = tr.gradlab_window
    dropped = ~w.loss_mask.any(-1)
    assert bool(dropped.any()) and bool((w.W[dropped] == 0).all())
    hit = torch.isin(w.batch.group, w.batch.group[dropped]) & ~dropped  # rows beside them
    at_node = shared_nodes(w.batch, "prefix").node >= 0
    assert bool((at_node & hit[:, None]).any())
    assert float((w.W - w.W_base)[at_node & hit[:, None]].abs().max()) > 0  # transformed


def test_sampled_mask_recovers_the_rows_trl_dropped():
    """The nodes' mask from TRL's padded batch: every token of each completion, tool results
    included, on the rows mask_truncated_completions zeroed too (pad id = EOS id here, and a
    pad id inside a truncated completion)."""
    from gradlab.integrations.trl.trainer import _loss_mask, _sampled_mask

    pad = eos = 1
    rows = [[5, 6, 1], [5, 1, 7, 8], [5, 6, 7, 8], [4, 9, 9, 1]]  # rows 1, 2: truncated
    tools = [[1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1], [1, 0, 1, 1]]
    T = 4
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    sampled = torch.arange(T) < lengths[:, None]
    cut = torch.tensor([r[-1] not in (eos, pad) for r in rows])
    tool = torch.tensor([t + [1] * (T - len(t)) for t in tools])
    out = {"completion_ids": ids, "completion_mask": (sampled & ~cut[:, None]).long(),
           "tool_mask": tool * (~cut).long()[:, None]}
    assert torch.equal(_sampled_mask(out, True, pad), sampled)
    assert torch.equal(_sampled_mask(out, False, pad), sampled & ~cut[:, None])  # flag off: TRL's
    assert torch.equal(_loss_mask(out), sampled & ~cut[:, None] & tool.bool())


def test_hook_W_is_the_gradient_of_trls_loss(tmp_path):
    # Sequence-level IS, 2 optimizer steps per generation: the 2nd call is off-policy (s_i ≠ 1).
    tr = run(tmp_path, "grpo", "sequence", spg=2, gens=1, cls=Capturing, lr=3e-3)
    w = tr.gradlab_window
    assert len(tr.captured) == 2 and w is not None
    gspo = objectives.get("gspo", eps=(tr.args.epsilon, tr.args.epsilon_high))
    for state, inputs in tr.captured:
        rows = inputs[ROW_KEY]
        W_ref = trl_autograd_W(tr, state, inputs)
        assert W_ref.abs().max() > 0
        assert_close_f32(w.W[rows], W_ref, msg="hooked W vs TRL's autograd W")
        # and gradlab's closed form (GSPO) on the same rows agrees with both
        b = w.batch.rows(rows)
        assert_close_f32(gspo.modulation(b), W_ref, msg="GSPO closed form vs TRL's autograd W")
    assert not torch.equal(w.batch.logps, w.batch.old_logps)  # really off-policy


def test_reconstructed_groups_are_the_true_groups(tmp_path):
    # Unit: runs of equal prompts, cut every G rows (a prompt drawn twice gives two groups).
    ids = torch.tensor([[0, 5], [0, 5], [7, 5], [7, 5], [7, 5], [7, 5], [0, 5], [0, 5]])
    mask = torch.tensor([[0, 1], [0, 1], [1, 1], [1, 1], [1, 1], [1, 1], [0, 1], [0, 1]])
    assert reconstruct_groups(ids, mask, 2).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # Real run, off-policy (TRL shuffles rows over 4 optimizer steps): RepeatSampler's layout
    # puts row r of the generation batch in group r // G; our labels must be exactly that.
    tr = run(tmp_path, "dapo", "token", spg=4, gens=2)
    for w in tr.gradlab_windows:
        B = w.batch.tokens.shape[0]
        assert torch.equal(w.batch.group, torch.arange(B) // G)
        sums = torch.zeros(B // G).index_add_(0, w.batch.group, w.batch.advantages)
        assert sums.abs().max() < 1e-4  # Σ A = 0 in every group
        assert w.metrics["split_share"] > 0  # TRL's shuffle spreads groups over the steps
    # the group tag travelled with the rows through TRL's shuffle and split
    prompts = tr._gl_gen["prompt_ids"]
    for g in range(B // G):
        assert (prompts[w.batch.group == g] == prompts[w.batch.group == g][0]).all()


def test_dr_grpo_on_policy_cancels_and_logs(tmp_path):
    tr = run(tmp_path, "dr_grpo", "token", spg=1, gens=3)
    pooled = pool_windows(tr.gradlab_windows)
    assert pooled["rho"] < 1e-5 and pooled["rho_trie"] < 1e-5
    assert all(w.metrics["n_shared_prefix"] > 0 for w in tr.gradlab_windows)
    # metrics in TRL's own logs and in a run store that load_run reads
    assert any("gradlab/rho_prefix" in h for h in tr.state.log_history)
    df = gradlab.load_run(tmp_path / "store")
    rho = df[df.metric == "rho_prefix"]
    assert len(rho) == 3 and rho.value.max() < 1e-5
    assert set(df.objective) == {"trl-dr_grpo-token"}


def test_grpo_with_unequal_lengths_does_not_cancel(tmp_path):
    tr = run(tmp_path, "grpo", "token", spg=1, gens=3, workload="lengths")
    pooled = pool_windows(tr.gradlab_windows, closed_form("grpo", "token", tr.args))
    assert pooled["rho"] > 1e-3
    assert pooled["attr_length"] == pytest.approx(1.0)  # on-policy: all of it is 1/T_i
    assert pooled["rho_closed_form"] == pytest.approx(pooled["rho"], rel=1e-3)


def test_sequence_is_off_policy_does_not_cancel(tmp_path):
    tr = run(tmp_path, "grpo", "sequence", spg=4, gens=1, lr=3e-3)
    pooled = pool_windows(tr.gradlab_windows)
    assert pooled["rho"] > 0.05 and pooled["rho_step"] >= pooled["rho"] - 1e-9
    assert pooled["split"] > 0


def test_rho_is_per_optimizer_step_on_the_steps_rows(tmp_path):
    """TRL's row shuffle cuts groups over 4 optimizer steps: the window's ρ pools the steps',
    each over the nodes of that step's rows with a group's rows in the step as its group
    (Σ_k residual_k / Σ_k mass_k), as gradlab's loop computes ρ of one optimizer step."""
    from gradlab.core.cancellation import cancellation

    tr = run(tmp_path, "grpo", "sequence", spg=4, gens=1, lr=3e-3)
    w = tr.gradlab_window
    assert w.metrics["split_share"] > 0
    res = mass = scale = n_shared = 0.0
    for k in torch.unique(w.opt):
        rows = (w.opt == k).nonzero().squeeze(-1)
        b = w.batch
        sub = TokenBatch(tokens=b.tokens[rows], mask=b.mask[rows], logps=b.logps[rows],
                         old_logps=b.old_logps[rows], advantages=b.advantages[rows],
                         group=torch.unique(b.group[rows], return_inverse=True)[1])
        c = cancellation(w.W[rows], sub)
        res, mass = res + c.residual, mass + c.mass
        scale += float(c.coef.scale.sum())  # ρ's normaliser
        n_shared += int((c.coef.sn.node >= 0).sum())
    assert w.metrics["n_shared_prefix"] == n_shared > 0
    assert w.metrics["mass_prefix"] == pytest.approx(mass, rel=1e-5)
    assert w.metrics["rho_prefix"] == pytest.approx(res / scale, rel=1e-4)


def test_dfpo_drop_in_cancels_with_groups_whole(tmp_path):
    """DFPO: ρ of the transformed W, per optimizer step, is round-off; the base (GSPO) W of the
    same rows does not cancel; every loss call holds whole groups."""
    from gradlab.core.batch import split_share
    from gradlab.core.cancellation import cancellation

    gl = GradlabConfig(store=None, dfpo="orth", keep_windows=True)
    tr = run(tmp_path, "grpo", "sequence", spg=4, gens=1, lr=3e-3, gl=gl)
    w = tr.gradlab_window
    assert w.metrics["rho_prefix"] < 1e-5
    # groups whole in each step: the window's nodes are the steps' nodes
    assert split_share(w.batch.group, w.micro) == 0 and w.metrics["split_share"] == 0
    assert cancellation(w.W_base, w.batch).ratio > 0.01  # the base (GSPO) gradient
    assert cancellation(w.W, w.batch).ratio < 1e-5
    assert torch.equal(w.batch.group, torch.arange(w.batch.tokens.shape[0]) // G)


def test_dfpo_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="multiple of num_generations"):
        run(tmp_path, "grpo", "sequence", spg=4, gens=1, prompts=3,
            gl=GradlabConfig(store=None, dfpo="min"))  # 24 rows / 4 steps = 6 < G
    with pytest.raises(ValueError, match="beta"):
        run(tmp_path, "grpo", "token", beta=0.1, gl=GradlabConfig(store=None, dfpo="min"))
    with pytest.raises(ValueError, match="dfpo"):
        GradlabConfig(dfpo="max")


class RowShuffled(GradlabGRPOTrainer):
    """DFPO on, but TRL's own row shuffle kept: groups get cut across loss calls."""

    def _prepare_inputs(self, generation_batch):
        return GRPOTrainer._prepare_inputs(self, generation_batch)


def test_dfpo_refuses_a_group_cut_across_loss_calls(tmp_path):
    with pytest.raises(ValueError, match="whole in one loss call"):
        run(tmp_path, "grpo", "sequence", spg=4, gens=1, cls=RowShuffled,
            gl=GradlabConfig(store=None, dfpo="orth"))


def test_instrumentation_does_not_change_training(tmp_path):
    finals = []
    for instrumented in (False, True):
        with quiet():
            args = grpo_args("dapo", "token", 2, 4, str(tmp_path / f"o{instrumented}"))
            tr = trl_audit.make_trainer(args, WORKLOADS["arithmetic"],
                                        GradlabConfig(store=None), instrumented=instrumented)
            tr.train()
        finals.append({k: v.detach().clone() for k, v in tr.model.state_dict().items()})
    for k in finals[0]:
        torch.testing.assert_close(finals[0][k], finals[1][k], rtol=0, atol=0)
    # the tags ride along as (B,) row tensors of every micro-batch
    assert all(b[GROUP_KEY].shape == b[ROW_KEY].shape == b["advantages"].shape
               for b in tr._buffered_inputs)


def test_audit_quick_end_to_end(tmp_path, capsys):
    from gradlab.cli.main import main

    assert main(["audit", "trl", "--quick", "--out", str(tmp_path)]) == 0
    import pandas as pd

    df = pd.read_csv(tmp_path / "trl_audit.csv")
    assert len(df) == 6 and {"rho", "rho_step", "split"} <= set(df.columns)
    dfpo = df[df.dfpo == "orth"]
    assert (dfpo.rho < 1e-5).all()
    assert df[(df.loss_type == "dr_grpo") & (df.policy == "on")].rho.iloc[0] < 1e-5
    assert "| loss_type |" in (tmp_path / "trl_audit.md").read_text()


@pytest.mark.parametrize("loss_type, level, form, reweight, scale", [
    ("dapo", "token", "ga+la", "sqrt", None), ("grpo", "sequence", "togo", "none", "none")])
def test_ibpo_loss_W_is_autograd_of_trls_loss_on_token_advantages(tmp_path, loss_type, level,
                                                                 form, reweight, scale):
    """loss="ibpo[...]": TRL's loss runs on (B, T) IBPO advantages computed from the rewards TRL
    logged; the hook's W is bitwise the autograd gradient of that loss, and (dapo) gradlab's
    token-level GRPO closed form on the same advantages agrees."""
    from gradlab.core.credit import reward_scale

    spec = f"ibpo[form={form},reweight={reweight}" + (f",scale={scale}]" if scale else "]")
    gl = GradlabConfig(store=str(tmp_path / "store"), keep_windows=True, loss=spec)
    tr = run(tmp_path, loss_type, level, spg=2, gens=1, cls=Capturing, lr=3e-3, gl=gl)
    w = tr.gradlab_window
    R = torch.tensor(list(tr._logs["rewards"][tr.reward_func_names[0]]))  # TRL's own record
    A = gradlab.process_advantages(w.batch.tokens, w.batch.mask, w.batch.group, R, form, reweight)
    A = A / reward_scale(R, w.batch.group, scale or "group", eps=1e-4).unsqueeze(-1)
    assert_close_f32(w.batch.advantages, A, msg="advantages")
    assert bool(((A != A[:, :1]) & w.batch.mask).any())  # token-level on this batch
    grpo = objectives.get("grpo", eps=(tr.epsilon_low, tr.epsilon_high), norm="token")
    # dapo divides by the generation batch's tokens × grad_accum / steps_per_generation (TRL)
    n_tok, spg = int(w.batch.mask.sum()), tr.args.steps_per_generation
    assert tr.args.gradient_accumulation_steps == 1 and n_tok % spg == 0
    assert len(tr.captured) == 2
    for state, inputs in tr.captured:
        rows = inputs[ROW_KEY]
        assert inputs["advantages"].shape == inputs["completion_ids"].shape
        W_ref = trl_autograd_W(tr, state, inputs)
        assert W_ref.abs().max() > 0
        assert torch.equal(w.W[rows], W_ref)  # bitwise
        b = w.batch.rows(rows).replace(advantages=A[rows], n_tokens=n_tok // spg)
        if loss_type == "dapo":
            assert_close_f32(grpo.modulation(b), W_ref, msg="dapo closed form vs TRL's W")
    assert not torch.equal(w.batch.logps, w.batch.old_logps)  # the 2nd call is off-policy
    df = gradlab.load_run(tmp_path / "store")
    assert set(df.objective) == {f"trl-{loss_type}-{level}+{spec}"}


def test_ibpo_loss_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="repair needs repair rollouts"):
        GradlabConfig(loss="ibpo[form=repair]")
    with pytest.raises(ValueError, match="parameter 'eps' not valid here.*TRL's own"):
        GradlabConfig(loss="ibpo[eps=0.2]")
    with pytest.raises(ValueError, match="valid: None .* or 'ibpo"):
        GradlabConfig(loss="grpo")
    with pytest.raises(ValueError, match="IBPO gives one per token"):
        GradlabConfig(loss="ibpo", dfpo="orth")
    assert GradlabConfig(loss="ibpo[form=togo, scale=none]").ibpo.form == "togo"


def test_every_group_tied_gives_undefined_rho_not_zero(tmp_path, monkeypatch):
    """A reward that rates every completion alike: A = 0, W ≡ 0. ρ is undefined: NaN in the
    window and the store (never 0), left out of TRL's logged means, and the end-of-run table
    prints "—" with the reason; the sums stay numbers."""
    import math

    from gradlab.integrations.audit import trl_setup as trl_audit_setup  # make_trainer's own module
    from gradlab.viz.summary import run_table

    make = trl_audit_setup.dataset_and_reward

    def tied(workload, n, seed=0):
        ds, _ = make(workload, n, seed)

        def same_reward(completions, **kw):
            return [1.0] * len(completions)

        return ds, same_reward

    monkeypatch.setattr(trl_audit_setup, "dataset_and_reward", tied)
    tr = run(tmp_path, "dr_grpo", "token", spg=1, gens=1)
    m = tr.gradlab_window.metrics
    assert m["zero_std_share"] == 1 and m["n_shared_prefix"] > 0 and m["mass_prefix"] == 0
    assert m["residual_prefix"] == 0 and m["mass_trie"] == 0
    for k in ("rho_prefix", "rho_trie"):
        assert math.isnan(m[k]), k
    assert not any("gradlab/rho_prefix" in h for h in tr.state.log_history)  # no 0, no NaN
    assert any(h.get("gradlab/mass_prefix") == 0 for h in tr.state.log_history)
    wide = gradlab.load_run(tmp_path / "store", wide=True)
    assert wide["rho_prefix"].isna().all() and (wide["mass_prefix"] == 0).all()
    table = run_table(tmp_path / "store")
    assert "| trl-dr_grpo-token | —¹ | —¹ | —² | —² | —¹ |" in table, table
    assert "—² undefined (no gradient: every group tied)" in table


def test_window_without_a_full_group_token_has_undefined_rho():
    """Every response of each group starts differently: no full-group node, ρ undefined (NaN)
    at full-group nodes while the trie, with shared pairs, is measured (the `residual`
    instrument TRL runs, reduced as the trainer reduces an optimizer step's readings)."""
    import math

    from gradlab.instruments import Residual, reduce_readings
    from gradlab.instruments.host import HostView

    tokens = torch.tensor([[1, 5, 6], [2, 5, 6], [3, 7, 8], [3, 7, 9]])
    b = TokenBatch(tokens=tokens, mask=torch.ones(4, 3, dtype=torch.bool),
                   logps=torch.full((4, 3), -1.0), old_logps=torch.full((4, 3), -1.0),
                   advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]),
                   group=torch.tensor([0, 0, 0, 0]))
    W = b.advantages[:, None].expand(4, 3) / 12
    inst = Residual()
    m = reduce_readings([inst.measure(HostView(batch=b, W=W))], inst.quantities(),
                        {"n_tokens": 12.0})
    assert m["n_shared_prefix"] == 0 and math.isnan(m["rho_prefix"])
    # rows 2 and 3 share "3 7" with A = +1 and −1: a trie node whose W sums to 0, so ρ = 0
    assert m["n_shared_trie"] > 0 and m["mass_trie"] > 0 and m["rho_trie"] == 0.0
