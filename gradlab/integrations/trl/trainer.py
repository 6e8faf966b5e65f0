"""gradlab on TRL's `GRPOTrainer`: W and the cancellation residual of TRL's *own* loss, and DFPO.

    from gradlab.integrations.trl import GradlabConfig, GradlabGRPOTrainer
    trainer = GradlabGRPOTrainer(model=..., reward_funcs=..., args=grpo_args, train_dataset=...,
                                 gradlab=GradlabConfig(dfpo=None))      # dfpo="orth": DFPO on
    trainer.train()   # `gradlab/*` keys in TRL's logs + a run store that gradlab.load_run reads

Your own `GRPOTrainer` subclass: `class T(GradlabMixin, MyGRPOTrainer): pass`.

How, without copying TRL's loss (docs/concepts/modulation.md): `_compute_loss` is wrapped to arm a flag; the first
grad-carrying result of `_get_per_token_logps_and_entropies` inside it (the (B, T) policy
log-probs; old/ref log-probs come under no_grad) gets a backward hook, which receives −W for
any `loss_type`, `importance_sampling_level`, clipping or normaliser.

Groups: TRL's inputs carry no group id. In `_generate_and_score_completions` the batch is still
in `RepeatSampler` order (a prompt's G copies consecutive): groups are runs of equal prompt ids,
cut every `num_generations` rows, and a (B,) row index and group label are added to the batch,
which TRL's shuffle and split carry along. W is gathered over the `steps_per_generation` loss
calls of one pass over the generation batch (a *window*) and over processes, then reported.

DFPO drop-in: `DFPOGradientTransform` on the same log-probs (w = W/A: any TRL loss_type with
beta = 0). Each group must be whole inside one loss call: with dfpo set, TRL's row shuffle is
replaced by a group shuffle, so micro-batches hold whole groups when per_device_train_batch_size
is a multiple of num_generations; a group cut anyway (e.g. across processes) raises.

IBPO: `GradlabConfig(loss="ibpo[form=togo]")` replaces TRL's (B,) advantages of each training
generation batch by (B, T) IBPO token advantages from the rewards TRL computed (captured from
`_calculate_rewards`) and the completion ids, per reconstructed group (`ibpo.py`); TRL's own
`_compute_loss` runs on them and the hook measures its W. Not with DFPO.

Several processes (torchrun, accelerate; DDP): the hook reads each process's loss before the
gradients are averaged, so W is divided by the process count (the gradient of the global
objective, equal to one process's on the same completions); windows are gathered over processes,
token counts are global, and rank 0 writes the store.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from unittest import mock

import torch
from torch import Tensor
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.trainer import grpo_trainer as _grpo_module

from ...core.batch import TokenBatch, split_share
from ...core.dfpo import SCOPES, TRANSFORMS
from ...core.nodes import NODE_KINDS
from ...instruments import InstrumentSet, Readings, reduce_readings, resolve
from ...instruments.host import HOSTS
from ...instruments.manifest import write_manifest
from ...loop.runs.store import RunStore
from ...loop.runs.traces import trace_window
from ...probes import DFPOGradientTransform, ModulationProbe
from .host import closed_form, trl_view
from .ibpo import IBPOLoss, check_trainer, local_advantages, parse_loss
from .resume import ResumeMixin, open_store
from .window import (
    GROUP_KEY,
    ROW_KEY,
    Window,
    grouped_shuffle,
    reconstruct_groups,
    tied_share,
)

log = logging.getLogger("gradlab")


@dataclass
class GradlabConfig:
    """What the instrumented trainer does.

    store: run-store folder; "auto" = <output_dir>/gradlab; None = TRL's logs only. A folder
        that already holds a run raises FileExistsError unless resume=True (then appends).
    dfpo: None, or a DFPO transform "min" | "orth" | "scale" applied to TRL's gradient, at
        `dfpo_nodes` ("prefix" | "trie") with `dfpo_scope` ("shared" | "all").
    every: measure every k-th generation batch (DFPO, when on, acts on every step).
    keep_windows: keep every `Window` in
        `trainer.gradlab_windows` (the last one is always in `trainer.gradlab_window`).
    objective: label in the run store (default "trl-<loss_type>-<level>[+dfpo-<t>]").
    trace_every, trace_groups: token traces (gradlab.load_traces) of every k-th measured window
        for that many groups, in the run store (0 = none).
    loss: None (TRL's GRPO advantages) or "ibpo[form=..., reweight=..., scale=...]": IBPO token
        advantages fed to TRL's loss (module doc; `gradlab.integrations.trl.ibpo`).
    instruments: what is measured, a spec string (`gradlab.instruments.resolve`: a preset
        "off" | "cheap" | "default" | "full", names with "@k" schedules, "my.mod:Spread"): the
        loop's own instrument objects, run on every optimizer step of a measured window
        (schedules count windows, as the loop's count rollout steps), reduced over the window
        and logged as `gradlab/<metric>` under the loop's names; `gradlab view` draws them.
        Instruments that need the objective (modulation, attribution) need a TRL loss gradlab
        has a closed form of (`host.closed_form`); "residual" runs with any loss.
    """

    store: str | None = "auto"
    dfpo: str | None = None
    dfpo_nodes: str = "prefix"
    dfpo_scope: str = "shared"
    every: int = 1
    keep_windows: bool = False
    objective: str | None = None
    resume: bool = False
    trace_every: int = 1
    trace_groups: int = 2
    loss: str | None = None
    instruments: str = "cheap"

    def __post_init__(self) -> None:
        for name, valid in (("dfpo", (None, *TRANSFORMS)), ("dfpo_nodes", NODE_KINDS),
                            ("dfpo_scope", SCOPES), ("every", range(1, 1 << 30))):
            if getattr(self, name) not in valid:
                shown = "≥ 1" if name == "every" else valid
                raise ValueError(f"GradlabConfig: {name}={getattr(self, name)!r}; valid: {shown}")
        if min(self.trace_every, self.trace_groups) < 0:
            raise ValueError(f"GradlabConfig: trace_every={self.trace_every}, trace_groups="
                             f"{self.trace_groups}; valid: ≥ 0 (0 = no traces)")
        self.instrument_set()  # an unknown name or an unmet need raises here, naming it
        if self.loss is not None:
            parse_loss(self.loss)
            if self.dfpo is not None:
                raise ValueError(f"GradlabConfig: loss={self.loss!r} with dfpo={self.dfpo!r}; DFPO "
                                 "needs one advantage per sequence, IBPO gives one per token")

    def instrument_set(self) -> InstrumentSet:
        """The instruments (`instruments`), checked against what TRL's trainer gives."""
        chosen = InstrumentSet(resolve(self.instruments))
        chosen.check(set(HOSTS["trl"]), "TRL's trainer")
        return chosen

    @property
    def ibpo(self) -> IBPOLoss | None:
        return None if self.loss is None else parse_loss(self.loss)


class GradlabMixin(ResumeMixin):
    """Mix into any `GRPOTrainer` (sub)class: `class T(GradlabMixin, GRPOTrainer)`.

    Extra keyword `gradlab: GradlabConfig`. After training: `gradlab_window` (last `Window`),
    `gradlab_windows` (all, with keep_windows), `gradlab_store` (RunStore or None).
    """

    def __init__(self, *args, gradlab: GradlabConfig | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gradlab = gradlab if gradlab is not None else GradlabConfig()
        self._gl_instruments = self.gradlab.instrument_set()
        self._gl_objective = closed_form(self.loss_type, self.importance_sampling_level, self.args)
        self._gl_check()
        self._gl_readings: list[Readings] = []  # the current window's optimizer steps
        self._gl_view = None  # the optimizer step in flight (its update-phase instruments)
        self._gl_close_after = False  # the window closes after that optimizer step
        self.add_callback(_AfterOptimizerStep(self))
        self._gl_gen: dict | None = None  # local unshuffled generation batch
        self._gl_parts: list[dict] = []  # one per loss call of the current window
        self._gl_armed, self._gl_inputs = False, None
        self._gl_tokens = 0
        self._gl_win0 = 0  # windows of earlier runs this one resumes (gradlab_state.json)
        self.gradlab_window: Window | None = None
        self.gradlab_windows: list[Window] = []
        self.gradlab_store = self._gl_make_store()

    # --- setup -------------------------------------------------------------------------
    def _gl_check(self) -> None:
        a = self.args
        if getattr(a, "use_liger_kernel", False):
            raise ValueError("gradlab: use_liger_kernel=True computes TRL's loss fused, without "
                             "per-token log-probs, so no hook can see W; set it to False")
        if self.gradlab.loss is not None:
            check_trainer(self, self.gradlab.loss)
        for inst in self._gl_instruments:
            if "objective" in inst.needs and self._gl_objective is None:
                raise ValueError(
                    f"GradlabConfig: instrument {inst.name!r} needs the objective's closed form, "
                    f"and gradlab has none of TRL's loss_type={self.loss_type!r} at "
                    f"importance_sampling_level={self.importance_sampling_level!r}; measure "
                    "without it (e.g. instruments=\"residual\")")
            if inst.phase == "update" and self.accelerator.num_processes > 1:
                raise ValueError(
                    f"GradlabConfig: instrument {inst.name!r} reads the policy around the "
                    f"optimizer step, in one process; this run has "
                    f"{self.accelerator.num_processes} (measure step-phase instruments only, "
                    "e.g. instruments=\"cheap\")")
        if self.gradlab.dfpo is None:
            return
        if self.beta != 0.0:
            raise ValueError(f"gradlab DFPO: beta={self.beta}; the drop-in derives w = W/A, "
                             "which needs W = A·w (no KL term): set beta=0")
        if a.per_device_train_batch_size % self.num_generations:
            raise ValueError(
                f"gradlab DFPO: per_device_train_batch_size={a.per_device_train_batch_size} is "
                f"not a multiple of num_generations={self.num_generations}; DFPO needs every "
                "group whole inside one micro-batch")
        if not hasattr(_grpo_module, "shuffle_sequence_dict"):
            raise RuntimeError("gradlab DFPO: this TRL has no grpo_trainer.shuffle_sequence_dict "
                               "to replace with a group shuffle; please report the TRL version")

    def _gl_label(self) -> str:
        g = self.gradlab
        if g.objective:
            return g.objective
        base = f"trl-{self.loss_type}-{self.importance_sampling_level}"
        return base + (f"+dfpo-{g.dfpo}" if g.dfpo else "") + (f"+{g.loss}" if g.loss else "")

    def _gl_make_store(self) -> RunStore | None:
        path = self.gradlab.store
        if path is None or not self.accelerator.is_main_process:
            return None
        path = os.path.join(self.args.output_dir, "gradlab") if path == "auto" else path
        trl_cfg = {k: v for k, v in self.args.to_dict().items() if isinstance(v, (int, float, str))}
        store = open_store(path, {"trl": trl_cfg, "gradlab": asdict(self.gradlab),
                                  "objective": self._gl_label()}, self.gradlab.resume)
        write_manifest(store.path, list(self._gl_instruments))  # curves for `gradlab view`
        return store

    # --- TRL overrides -----------------------------------------------------------------
    def _calculate_rewards(self, *args, **kwargs):
        out = super()._calculate_rewards(*args, **kwargs)  # (B, n_funcs), all processes
        self._gl_rewards = out
        return out

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            cids = out["completion_ids"]
            group = reconstruct_groups(out["prompt_ids"], out["prompt_mask"], self.num_generations)
            out[ROW_KEY] = torch.arange(cids.shape[0], device=cids.device)
            out[GROUP_KEY] = group
            # Nodes come from every sampled token; TRL's loss mask only makes W = 0 (module doc).
            cut = self.args.mask_truncated_completions  # only then is the pad id needed
            mask = _sampled_mask(out, cut, _pad_token_id(self.processing_class) if cut else None)
            loss = _loss_mask(out)
            if self.gradlab.loss is not None:
                A = local_advantages(self, self._gl_rewards, out, mask, group)
                out["advantages"] = A.to(out["advantages"].dtype)
            self._gl_gen = {"prompt_ids": out["prompt_ids"], "prompt_mask": out["prompt_mask"],
                            "tokens": cids, "mask": mask, "loss_mask": loss,
                            "advantages": out["advantages"], "group": group}
            if self.accelerator.num_processes > 1:  # labels over every process's rows
                self._gl_gen["global_group"] = self._gl_global_groups(out)
            self._gl_tokens += int(self.accelerator.gather(loss.sum()).sum())  # all processes
        return out

    def _prepare_inputs(self, generation_batch):
        if self.gradlab.dfpo is None:
            return super()._prepare_inputs(generation_batch)
        # Keep groups whole: TRL's row shuffle → a group shuffle, for this call only.
        with mock.patch.object(_grpo_module, "shuffle_sequence_dict", grouped_shuffle):
            return super()._prepare_inputs(generation_batch)

    def _compute_loss(self, model, inputs):
        if not self.model.training or ROW_KEY not in inputs:
            return super()._compute_loss(model, inputs)
        self._gl_armed, self._gl_inputs = True, inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._gl_armed, self._gl_inputs = False, None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if not self._gl_armed or not out[0].requires_grad:
            return out
        self._gl_armed = False  # the first grad-carrying call is the policy's log-probs
        logps = self._gl_watch(out[0], self._gl_inputs)
        if self._gl_parts and self._gl_parts[-1]["micro"] == self._step and out[1] is not None:
            self._gl_parts[-1]["entropy"] = out[1].detach()
        return (logps, *out[1:])

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, inputs, num_items_in_batch)
        if self._gl_parts and "hooks" in self._gl_parts[-1]:
            self._gl_harvest(self._gl_parts[-1])
        if self._gl_parts and self.accelerator.sync_gradients:  # this call ends an optimizer step
            self._gl_step()
        if self._gl_parts and self._step % self.args.steps_per_generation == 0:
            if self._gl_view is not None:  # the step's update-phase readings come after it
                self._gl_close_after = True
            else:
                self._gl_close_window()
        return out

    # --- per optimizer step ------------------------------------------------------------
    def _gl_step(self) -> None:
        """The optimizer step's loss calls are done, its gradient accumulated (not yet clipped):
        run the due instruments on the step's view; the update-phase ones read the policy now
        and again after the optimizer step (`_AfterOptimizerStep`)."""
        parts = [p for p in self._gl_parts if not p.get("stepped")]
        for p in parts:
            p["stepped"] = True
        if not parts or not all(p["measure"] for p in parts) or self._gl_gen is None:
            return
        k = self._gl_win0 + parts[0]["micro"] // self.args.steps_per_generation  # window index
        view = trl_view(self, self._gl_gen, parts, self._gl_objective)
        if self.accelerator.num_processes > 1:
            view = self._gl_gathered(view, parts)
        self._gl_readings.append(self._gl_instruments.measure(view, k))
        updating = self._gl_instruments.due(k, "update")
        for inst in updating:
            if (r := inst.before(view)) is not None:
                self._gl_readings.append(r)
        self._gl_view = (view, updating) if updating else None

    def _gl_after_step(self) -> None:
        """After TRL's optimizer step: the update-phase instruments' second reading."""
        if self._gl_view is None:
            return
        view, updating = self._gl_view
        self._gl_view = None
        for inst in updating:
            self._gl_readings.append(inst.after(view))
        if self._gl_close_after:  # the window's last optimizer step: its readings are complete
            self._gl_close_after = False
            self._gl_close_window()

    def _gl_gathered(self, view, parts: list[dict]):
        """Data parallelism: the step's rows of every process, so that a group whose rows sit
        on several processes is one group (labels of the gathered generation batch)."""
        acc, b = self.accelerator, view.batch

        def g(v: Tensor) -> Tensor:
            v = v.long() if v.dtype == torch.bool else v
            return acc.gather(acc.pad_across_processes(v, dim=1) if v.dim() == 2 else v)

        rows = torch.cat([p["row"] for p in parts])
        group = g(self._gl_gen["global_group"][rows])
        view.batch = TokenBatch(tokens=g(b.tokens), mask=g(b.mask).bool(), logps=g(b.logps),
                                old_logps=g(b.old_logps), advantages=g(b.advantages),
                                group=torch.unique(group, return_inverse=True)[1], validate=False)
        view.W, view.trained_batch, view._nodes = g(view.W), None, None
        view.entropy = g(view.entropy) if view.entropy is not None else None
        return view

    # --- per loss call -----------------------------------------------------------------
    def _gl_watch(self, logps: Tensor, inputs: dict) -> Tensor:
        """Hook the (B, T) policy log-probs of one loss call; returns the tensor to use."""
        spg, n_it = self.args.steps_per_generation, self.num_iterations
        measure = (self._step // (spg * n_it)) % self.gradlab.every == 0
        if not measure and self.gradlab.dfpo is None:
            return logps
        old = inputs.get("old_per_token_logps")
        part = {"row": inputs[ROW_KEY], "micro": self._step, "logps": logps.detach(),
                "old": None if old is None else old.detach(), "measure": measure}
        if self.gradlab.dfpo is not None:
            g = self.gradlab
            t = DFPOGradientTransform(self._gl_micro_batch(logps, inputs), g.dfpo, g.dfpo_nodes,
                                      g.dfpo_scope)
            logps = t.watch(logps)
            part["hooks"] = t
        else:
            p = ModulationProbe()
            logps = p.watch(logps)
            part["hooks"] = p
        self._gl_parts.append(part)
        return logps

    def _gl_micro_batch(self, logps: Tensor, inputs: dict) -> TokenBatch:
        """TokenBatch of one loss call for DFPO; raises when a group is not whole in it."""
        group, adv = inputs[GROUP_KEY], inputs["advantages"]
        if adv.dim() != 1:
            raise ValueError("gradlab DFPO: needs per-sequence advantages (B,), got "
                             f"{tuple(adv.shape)}")
        full = torch.bincount(self._gl_gen["group"])
        here = torch.bincount(group, minlength=full.numel())
        cut = ((here > 0) & (here != full)).nonzero().squeeze(-1)
        if cut.numel() or bool((full[group] != self.num_generations).any()):
            g = int(cut[0]) if cut.numel() else int(group[0])
            raise ValueError(
                f"gradlab DFPO: group {g} has {int(here[g])} of its rows in this micro-batch "
                f"(group size {int(full[g])}, num_generations={self.num_generations}); DFPO needs "
                "each group whole in one loss call and on one process")
        # Nodes over every sampled token; a token outside TRL's loss mask (a truncated row under
        # mask_truncated_completions, a tool result) gets A = 0 here, so the transform leaves it
        # out of its node (its W is 0 and w = W/A undefined) and keeps its W̃ = 0.
        rows = inputs[ROW_KEY]
        adv = adv.detach()[:, None] * _loss_mask(inputs).to(adv.dtype)
        lp = logps.detach()
        return TokenBatch(tokens=inputs["completion_ids"], mask=self._gl_gen["mask"][rows],
                          logps=lp, old_logps=lp, advantages=adv, group=group, validate=False)

    def _gl_harvest(self, part: dict) -> None:
        """After the backward: keep W (and W_base under DFPO), drop the hooks."""
        h = part.pop("hooks")
        h.close()
        dfpo = isinstance(h, DFPOGradientTransform)
        W, W_base = (h.W_tilde, h.W) if dfpo else (h.W, None)
        # The hook reads this process's loss before the gradients are averaged over the P
        # processes (DDP, FSDP and DeepSpeed all take the mean): the global objective's W is 1/P
        # of it. TRL scales each loss for that mean (dapo divides by the global token count / P),
        # so W / P is what one process computes on the same completions.
        P = self.accelerator.num_processes
        if W is None:  # the backward never reached the log-probs: no gradient from these rows
            log.warning("gradlab: TRL's backward of loss call %d did not reach the policy "
                        "log-probs the hook watches; its rows' W is recorded as 0", part["micro"])
        part["W"] = torch.zeros_like(part["logps"]) if W is None else W / P
        part["W_base"] = None if W_base is None else W_base / P

    # --- per window --------------------------------------------------------------------
    def _gl_global_groups(self, out: dict) -> Tensor:
        """(B,) group labels of this process's rows among every process's rows (rank-major,
        the global sampler order), so a group cut over processes keeps one label."""
        acc = self.accelerator
        ids = acc.gather(acc.pad_across_processes(out["prompt_ids"], dim=1, pad_first=True))
        am = acc.gather(acc.pad_across_processes(out["prompt_mask"], dim=1, pad_first=True))
        B = out["prompt_ids"].shape[0]
        return reconstruct_groups(ids, am, self.num_generations)[acc.process_index * B:][:B]

    def _gl_close_window(self) -> None:
        parts, self._gl_parts = self._gl_parts, []
        readings, self._gl_readings = self._gl_readings, []
        gen = self._gl_gen
        if gen is None or not all(p["measure"] for p in parts):
            return
        w = self._gl_assemble(parts, gen)
        if w is None:
            return
        # the loop's reduction of its optimizer steps' readings: the same names and numbers
        w.metrics = reduce_readings(readings, self._gl_instruments.quantities(),
                                    {"n_tokens": float(w.loss_mask.sum())})
        w.metrics.update(split_share=split_share(w.batch.group, w.opt),
                         zero_std_share=tied_share(w.batch))
        self.gradlab_window = w
        if self.gradlab.keep_windows:
            self.gradlab_windows.append(w)
        for k, v in w.metrics.items():  # TRL averages each key over the windows that report
            if not math.isnan(v):  # it: an undefined ρ is left out, never a NaN or 0 in the mean
                self._metrics["train"][f"gradlab/{k}"].append(v)
        if self.gradlab_store is not None:
            self.gradlab_store.log({
                "step": w.index, "objective": self._gl_label(), "seed": self.args.seed,
                "tokens": self._gl_tokens, "iteration": w.iteration,
                "global_step": self.state.global_step, **w.metrics})
            if self.gradlab.trace_every and w.index % self.gradlab.trace_every == 0:  # loop/runs/traces.py
                trace_window(self.gradlab_store.path, self._gl_label(), w, self.processing_class,
                             self.gradlab.trace_groups)

    def _gl_assemble(self, parts: list[dict], gen: dict) -> Window | None:
        """Scatter the loss calls' rows back into generation-batch order (and gather ranks)."""
        tok, cols = gen["tokens"], ("W", "W_base", "logps", "old")
        micro = torch.full((tok.shape[0],), -1, dtype=torch.long, device=tok.device)
        t = {"tokens": tok, "mask": gen["mask"], "loss": gen["loss_mask"],
             "adv": gen["advantages"], "group": gen["group"], "micro": micro}
        for c in cols:
            have = all(p.get(c) is not None for p in parts)
            t[c] = tok.new_zeros(tok.shape, dtype=parts[0]["W"].dtype) if have else None
        for p in parts:
            micro[p["row"]] = p["micro"]
            for c in cols:
                if t[c] is not None:
                    t[c][p["row"]] = p[c].to(t[c].dtype)
        if bool((micro < 0).any()):  # e.g. resumed mid-window: not every row was seen
            return None
        t["old"] = t["old"] if t["old"] is not None else t["logps"]  # on-policy: old = current
        if self.accelerator.num_processes > 1:
            t = self._gl_gather(t, gen)
        batch = TokenBatch(tokens=t["tokens"], mask=t["mask"].bool(), logps=t["logps"],
                           old_logps=t["old"], advantages=t["adv"].to(t["W"].dtype),
                           group=t["group"], validate=False)
        k = self._gl_win0 + parts[0]["micro"] // self.args.steps_per_generation  # window index
        return Window(batch, t["W"], t["W_base"], t["micro"],
                      t["micro"] // self.args.gradient_accumulation_steps,
                      index=k, iteration=k % self.num_iterations, loss_mask=t["loss"].bool())

    def _gl_gather(self, t: dict, gen: dict) -> dict:
        """Data parallelism: rows of all processes, rank-major (= the global sampler order),
        padded to the longest completion; groups reconstructed on the gathered prompts."""
        acc = self.accelerator

        def g(v: Tensor, left: bool = False) -> Tensor:
            v = v.long() if v.dtype == torch.bool else v
            return acc.gather(acc.pad_across_processes(v, dim=1, pad_first=left) if v.dim() == 2 else v)

        out = {k: (g(v) if v is not None and k != "group" else v) for k, v in t.items()}
        out["group"] = reconstruct_groups(g(gen["prompt_ids"], True), g(gen["prompt_mask"], True),
                                          self.num_generations)
        return out


def _loss_mask(inputs: dict) -> Tensor:
    """(B, T) bool — the tokens TRL's loss counts (completion mask × tool mask)."""
    m = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        m = m * inputs["tool_mask"]
    return m.bool()


def _sampled_mask(inputs: dict, masked_truncated: bool, pad_id: int | None) -> Tensor:
    """(B, T) bool — every token of each completion (tool results included), whether or not
    TRL's loss counts it: the completion mask, except on the rows that
    `mask_truncated_completions` zeroed whole (`masked_truncated`). TRL truncates a row whose
    last token is neither EOS nor pad, so such a row runs up to its last non-pad token
    (completions are right-padded with `pad_id`); a completion holds at least one token, so no
    other row has an all-zero completion mask."""
    m = inputs["completion_mask"].bool()
    if not masked_truncated:
        return m
    ids = inputs["completion_ids"]
    pos = torch.arange(ids.shape[1], device=ids.device)
    last = torch.where(ids != pad_id, pos, -1).amax(-1, keepdim=True)  # (B, 1)
    return torch.where(m.any(-1, keepdim=True), m, pos <= last)


def _pad_token_id(processing_class) -> int:
    """The pad id TRL pads completions with (a processor's is its tokenizer's)."""
    tok = getattr(processing_class, "tokenizer", processing_class)  # a processor wraps one
    if tok.pad_token_id is None:
        raise ValueError("gradlab: the tokenizer has no pad_token_id; TRL pads completions "
                         "with it (set tokenizer.pad_token)")
    return int(tok.pad_token_id)


class _AfterOptimizerStep(TrainerCallback):
    """Calls the trainer's update-phase instruments right after TRL's optimizer step."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._gl_after_step()


class GradlabGRPOTrainer(GradlabMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` with gradlab's probes (and DFPO when `GradlabConfig.dfpo` is set)."""
