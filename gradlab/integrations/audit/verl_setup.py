"""The setup `gradlab audit verl` and its option rows share: the mini-batch shape, the verl
ActorConfig a policy loss reads, and the micro-batch cut (whole groups or a seeded shuffle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

G, N_GROUPS, MICRO = 4, 4, 6  # group size, groups per mini-batch, rows per split micro-batch


def actor_config(loss_mode: str, rollout_n: int = G):
    """The minimal real verl ActorConfig a policy loss reads (clip ratios, policy_loss,
    rollout_n, global_batch_info); verl's defaults otherwise (clip 0.2, clip_ratio_c 3)."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    return ActorConfig(strategy="fsdp", rollout_n=rollout_n, ppo_mini_batch_size=N_GROUPS,
                       ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.1))


def micro_rows(group: torch.Tensor, split: bool, seed: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch: whole = two whole groups per micro-batch; split = a
    seeded shuffle cut every MICRO rows (groups of G straddle micro-batches)."""
    import torch

    if not split:
        order = torch.argsort(group, stable=True)
        return list(order.split(2 * G))
    order = torch.randperm(group.numel(), generator=torch.Generator().manual_seed(seed))
    return list(order.split(MICRO))
