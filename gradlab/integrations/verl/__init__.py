"""gradlab inside verl (verl ≥ 0.9; docs/guides/verl.md). Importing this package registers
gradlab's policy losses and IBPO advantage estimators in verl's registries, in every worker
that imports it: `VERL_USE_EXTERNAL_MODULES=gradlab.integrations.verl`.

    losses.py  `gradlab_measure:<base>` and `gradlab_dfpo[:<base>[:<transform>]]`: the host that
               hands gradlab's instruments verl's W and batch; DFPO on verl's own losses
    actor.py   verl's `ppo_loss` routed through `micro_batch` (token and group ids)
    ibpo.py    the `gradlab_ibpo[:<form>[:sqrt]]` advantage estimators
    parts.py   closed forms of verl's losses and DFPO's Δ, pure tensor functions
"""

from .losses import (
    SETTINGS,
    base_losses,
    last_modulation,
    micro_batch,
    register,
    reset,
    use_instruments,
)

__all__ = ["SETTINGS", "base_losses", "last_modulation", "micro_batch", "register", "reset",
           "use_instruments"]
