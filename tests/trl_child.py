"""The TRL runs of test_trl_multiprocess, as one script: `python tests/trl_child.py OUT` (one
process) or `torchrun --nproc_per_node=2 tests/trl_child.py OUT` (two, gloo on CPU).

Each case trains a `GradlabGRPOTrainer` on the shipped tiny policy, 4 prompts × G = 8 per
generation batch (3 in `ibpo_split`, where a group straddles the two processes), with the same
global batch on any number of processes: per-device batch rows / (processes × steps_per_generation). Two things make the runs layout-free, so one and two
processes train on identical completions:
- sampling: Gumbel-max on the policy's logits with noise keyed on (optimizer step at generation,
  global row, position) instead of TRL's generate (whose RNG stream depends on the rank);
- the split of a generation batch into loss calls: TRL's row shuffle is replaced by a fixed
  order whose k-th loss call holds the same global rows on one process as on two.
Rank 0 writes OUT/<case>/: the run store (store/), the windows' W, mask and tokens
(windows.safetensors), TRL's log history (log.json) and the final weights (model.safetensors).
`--case NAME --resume STEP`: continue OUT/NAME from its checkpoint-STEP.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file
from trl.trainer import grpo_trainer as _grpo_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradlab.integrations.audit.trl import WORKLOADS, grpo_args, make_trainer, quiet  # noqa: E402
from gradlab.integrations.trl.trainer import ROW_KEY, GradlabConfig, GradlabGRPOTrainer  # noqa: E402

G = 8
LAYOUT = 2  # the loss-call split is the one two processes make
LR = 0.1  # plain SGD: the update is the gradient itself (Adam would hide its scale)

IBPO = {"loss": "ibpo[form=togo,reweight=sqrt]"}
# name: (loss_type, steps_per_generation, gradient_accumulation_steps, optimizer steps, prompts,
#        gradlab)
CASES = {
    "dapo": ("dapo", 1, 1, 3, 4, {}),
    "grpo_accum": ("grpo", 2, 2, 2, 4, {}),  # 2 loss calls accumulated into 1 optimizer step
    "dapo_offpolicy": ("dapo", 2, 1, 4, 4, {}),  # 2 optimizer steps per generation batch
    "dfpo": ("grpo", 1, 1, 2, 4, {"dfpo": "orth"}),
    "ibpo": ("dapo", 1, 1, 2, 4, IBPO),
    "ibpo_split": ("grpo", 1, 1, 2, 3, IBPO),  # 24 rows: group 1 is rows 8-15, on both processes
}


def keyed_completions(tr, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Sample every row's completion from the current policy with Gumbel noise keyed on (global
    step, global row, position): the same tokens whatever process holds the row."""
    model = tr.accelerator.unwrap_model(tr.model)
    eos, T = set(tr.eos_token_ids), tr.max_completion_length
    V = model.config.vocab_size
    first = tr.accelerator.process_index * len(prompt_ids)
    out: list[list[int]] = [[] for _ in prompt_ids]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompt_ids):  # rows of one prompt length need no padding
        by_len.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for rows in by_len.values():
            ids = torch.tensor([prompt_ids[i] for i in rows])
            u = torch.stack([torch.rand(T, V, generator=torch.Generator().manual_seed(
                1_000_003 * tr.state.global_step + first + i)) for i in rows])
            gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7)))
            for t in range(T):
                logits = model(input_ids=ids).logits[:, -1].float() / tr.temperature
                ids = torch.cat([ids, (logits + gumbel[:, t]).argmax(-1, keepdim=True)], dim=1)
            for j, i in enumerate(rows):
                for tok in ids[j, len(prompt_ids[i]):].tolist():
                    out[i].append(tok)
                    if tok in eos:
                        break
    return out


def layout_free_order(d: dict, rank: int, spg: int, rows_all: int) -> dict:
    """Stand-in for TRL's shuffle: loss call k takes, on every layout, the global rows that the
    k-th loss call of LAYOUT processes takes (each of those processes in row order)."""
    rows = d[ROW_KEY]
    glob = rank * rows.numel() + rows.cpu()  # processes hold consecutive blocks of rows
    call = (glob % (rows_all // LAYOUT)) // (rows_all // (LAYOUT * spg))
    perm = torch.argsort(call * rows_all + glob)
    return {k: (v[perm.to(v.device)] if isinstance(v, torch.Tensor) and v.ndim else
                [v[i] for i in perm.tolist()] if isinstance(v, list) else v) for k, v in d.items()}



class KeyedTrainer(GradlabGRPOTrainer):
    """GradlabGRPOTrainer with the layout-free sampler and loss-call split (module doc)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        return keyed_completions(self, prompt_ids), None

    def _prepare_inputs(self, generation_batch):
        order = functools.partial(layout_free_order, rank=self.accelerator.process_index,
                                  spg=self.args.steps_per_generation,
                                  rows_all=self.args.generation_batch_size)
        with mock.patch.object(_grpo_module, "shuffle_sequence_dict", order):
            return super()._prepare_inputs(generation_batch)


def run_case(name: str, out: Path, resume: int | None) -> None:
    loss_type, spg, accum, steps, prompts, gl = CASES[name]
    P = int(os.environ.get("WORLD_SIZE", "1"))
    d = out / name
    args = grpo_args(loss_type, "token", spg, steps, str(d / "trl"),
                     per_device_train_batch_size=prompts * G // (P * spg), prompts=prompts,
                     gradient_accumulation_steps=accum, logging_steps=1, optim="sgd", lr=LR,
                     save_strategy="steps" if name == "dapo" else "no", save_steps=2)
    cfg = GradlabConfig(store=str(d / "store"), keep_windows=True, resume=resume is not None,
                        **gl)
    tr = make_trainer(args, WORKLOADS["arithmetic"], cfg, cls=KeyedTrainer)
    ckpt = None if resume is None else str(d / "trl" / f"checkpoint-{resume}")
    tr.train(resume_from_checkpoint=ckpt)
    if not tr.accelerator.is_main_process:
        return
    tag = "" if resume is None else "resumed_"
    win = {}
    for w in tr.gradlab_windows:
        win[f"{w.index}/W"] = w.W.contiguous()
        win[f"{w.index}/mask"] = w.batch.mask.to(torch.uint8).contiguous()
        win[f"{w.index}/tokens"] = w.batch.tokens.contiguous()
        if w.W_base is not None:
            win[f"{w.index}/W_base"] = w.W_base.contiguous()
    save_file(win, str(d / f"{tag}windows.safetensors"))
    (d / f"{tag}log.json").write_text(json.dumps(tr.state.log_history))
    model = tr.accelerator.unwrap_model(tr.model)
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
              str(d / f"{tag}model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--resume", type=int, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with quiet():
        for name in a.case or list(CASES):
            run_case(name, a.out, a.resume)


if __name__ == "__main__":
    main()
