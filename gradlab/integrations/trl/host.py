"""TRL's primitives as gradlab's `HostView`: one optimizer step of `GradlabGRPOTrainer`.

TRL gives what gradlab's loop gives (`gradlab.instruments.host.HOSTS["trl"]`):
- W and the batch of the step's loss calls (the hook's W, rows in the order TRL trained them,
  groups relabelled 0..k−1: a group cut by TRL's row shuffle is the part of it in this step);
- entropy, where TRL computed it;
- the objective: gradlab's closed form of TRL's loss (`closed_form`), where gradlab has one;
- the `Policy`: TRL's own `_get_per_token_logps_and_entropies` (at TRL's temperature: the
  log-probs its loss differentiates) and gradlab's context forward on TRL's inputs;
- the step's accumulated gradient (the parameters' `.grad` before TRL clips it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core import objectives
from ...core.batch import TokenBatch
from ...instruments.forwards import Policy
from ...instruments.host import HostView
from ...loop.numerics.logprobs import context_logprobs, context_logprobs_fn


def closed_form(loss_type: str, level: str, args):
    """gradlab's closed-form objective of a TRL loss setting (`loss_type`, importance sampling
    `level`, the epsilons of `args`), or None where gradlab has none."""
    eps = (args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    if level == "sequence":
        return objectives.get("gspo", eps=eps) if loss_type == "grpo" else None
    norm = {"grpo": "seq", "bnpo": "token", "dapo": "token", "dr_grpo": "const"}.get(loss_type)
    if norm is None:
        return None
    return objectives.get("grpo", eps=eps, norm=norm,
                          max_len=args.max_completion_length if norm == "const" else None)


def step_batch(gen: dict, parts: list[dict]) -> tuple[Tensor, TokenBatch, Tensor, Tensor | None]:
    """(rows (B,), TokenBatch (B, T), W (B, T), entropy (B, T) or None) of one optimizer step's
    loss calls `parts` on this process: rows index the generation batch `gen`; the batch holds
    every sampled token, its log-probs in the loss call, TRL's old log-probs (= the same when
    TRL keeps none: on-policy), advantages, and groups relabelled 0..k−1."""
    rows = torch.cat([p["row"] for p in parts])
    lp = torch.cat([p["logps"] for p in parts])
    old = torch.cat([p["old"] if p.get("old") is not None else p["logps"] for p in parts])
    W = torch.cat([p["W"] for p in parts]).to(lp.dtype)
    ent = [p.get("entropy") for p in parts]
    entropy = torch.cat(ent).to(lp.dtype) if all(e is not None for e in ent) else None
    group = torch.unique(gen["group"][rows], return_inverse=True)[1]
    batch = TokenBatch(tokens=gen["tokens"][rows], mask=gen["mask"][rows], logps=lp, old_logps=old,
                       advantages=gen["advantages"][rows].to(lp.dtype), group=group,
                       validate=False)
    return rows, batch, W, entropy


def trl_policy(trainer, gen: dict, rows: Tensor) -> Policy:
    """TRL's forwards over the step's rows (local row i = generation-batch row rows[i])."""

    def inputs(local: Tensor, t_max: int | None):
        r = rows[local]
        cut = slice(None) if t_max is None else slice(None, t_max)
        # attention over every sampled token: a row TRL's loss drops still has its completion
        return gen["prompt_ids"][r], gen["prompt_mask"][r], gen["tokens"][r, cut], gen["mask"][r, cut].long()

    def token_logps(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature):
        ids = torch.cat([prompt_ids, response_ids], dim=1)
        attn = torch.cat([prompt_mask, response_mask], dim=1)
        # TRL's own forward (its temperature): the log-probs its loss differentiates
        return trainer._get_per_token_logps_and_entropies(model, ids, attn, response_ids.shape[1])[0]

    return Policy(model=trainer.accelerator.unwrap_model(trainer.model), inputs=inputs,
                  token_logps=token_logps, context_logprobs=context_logprobs,
                  context_logprobs_fn=context_logprobs_fn,
                  temperature=trainer.temperature, chunk=trainer.args.per_device_train_batch_size)


def trl_view(trainer, gen: dict, parts: list[dict], objective) -> HostView:
    """The `HostView` of one optimizer step (its loss calls `parts`) on one process."""
    rows, batch, W, entropy = step_batch(gen, parts)
    return HostView(batch=batch, W=W, entropy=entropy, objective=objective,
                    policy=trl_policy(trainer, gen, rows),
                    grads=trainer.accelerator.unwrap_model(trainer.model))
