"""Feeding gradlab's verl losses the token and group ids verl's actor does not pass them.

verl ≥ 0.9's actor computes each micro-batch's loss with `verl.workers.utils.losses.ppo_loss(
config, model_output, data)`, which calls the registered policy loss with log-probs only.
`gradlab_ppo_loss` is a drop-in for it: it reads the micro-batch's `responses` (dense or nested)
and group ids — `uid` when the micro-batch carries it, else rows with identical `prompts` (a
prompt drawn twice in one mini-batch then counts as one group: *our* fallback) — enters
`gradlab.integrations.verl.micro_batch(...)` and calls verl's `ppo_loss` unchanged. The
mini-batch is closed (its instruments' `gradlab/*` figures reported) when this process has seen
`global_batch_size / dp_size` rows, verl's own mini-batch size.

`install()` points verl's actor at it (`verl.workers.utils.losses.ppo_loss` and, when already
imported, `verl.workers.engine_workers.ppo_loss`, which the worker looks up when it builds its
loss function); `import gradlab.integrations.verl` calls it, so
`VERL_USE_EXTERNAL_MODULES=gradlab.integrations.verl` is all a worker needs. Tested here on
verl's real `ppo_loss` with real TensorDict micro-batches; inside a Ray/FSDP worker it is not
(that needs a GPU cluster).
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import Tensor

_ORIGINAL: dict = {}


_GRADLAB: dict = {}  # set by install()


def _dense(x: Tensor, width: int | None = None) -> Tensor:
    """(B, T) from a dense or nested (jagged) tensor, right-padded with 0 to `width`."""
    if x.is_nested:
        x = x.to_padded_tensor(0)
    if width is not None and width > x.shape[1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
    return x


def _group_ids(data, B: int) -> list:
    """uid per row when the micro-batch has it, else the prompt's token ids as a tuple."""
    from verl.utils import tensordict_utils as tu

    uid = tu.get_non_tensor_data(data, "uid", None) if "uid" in data.keys() else None
    if uid is not None:
        return uid.tolist() if hasattr(uid, "tolist") else list(uid)
    if "prompts" not in data.keys():
        raise ValueError("gradlab_ppo_loss: the micro-batch has neither 'uid' nor 'prompts'; "
                         "gradlab cannot rebuild the groups")
    p = data["prompts"]
    rows = [r for r in p.unbind(0)] if p.is_nested else list(p)
    if "attention_mask" in data.keys() and not p.is_nested:  # drop left padding
        m = data["attention_mask"][:, : p.shape[1]].bool()
        rows = [r[mm] for r, mm in zip(rows, m)]
    assert len(rows) == B
    return [tuple(r.tolist()) for r in rows]


def gradlab_ppo_loss(config, model_output, data, dp_group=None):
    """verl's `ppo_loss`, called inside `micro_batch(...)` with this micro-batch's ids."""
    from verl.utils import tensordict_utils as tu

    gv = _GRADLAB["verl"]  # gradlab.integrations.verl, handed over by install()
    original = _ORIGINAL.get("ppo_loss") or importlib.import_module(
        "verl.workers.utils.losses").ppo_loss
    width = tu.get_non_tensor_data(data, "max_response_len", -1)
    resp = _dense(data["responses"], width if width and width > 0 else None)
    B = resp.shape[0]
    gbs, dp = data.get("global_batch_size", None), data.get("dp_size", None)
    gbs, dp = tu.unwrap_non_tensor_data(gbs), tu.unwrap_non_tensor_data(dp) or 1
    mini = getattr(gv._state, "mini", None)
    seen = B + (sum(p["batch"].B for p in mini.parts) if mini is not None else 0)
    last = gbs is None or seen >= int(gbs) // int(dp)  # no size known: each call its own
    with gv.micro_batch(resp, _group_ids(data, B), last=last):
        return original(config, model_output, data, dp_group)


def install(gradlab_verl) -> bool:
    """Route verl's actor loss through `gradlab_ppo_loss`; False when verl's workers package
    cannot be imported here (then call `gradlab.integrations.verl.micro_batch` yourself).
    `gradlab_verl` is the `gradlab.integrations.verl` module (passed in, so this module does not
    import it: no import circle)."""
    _GRADLAB["verl"] = gradlab_verl
    try:
        losses = importlib.import_module("verl.workers.utils.losses")
    except ImportError:
        return False
    if losses.ppo_loss is not gradlab_ppo_loss:
        _ORIGINAL["ppo_loss"] = losses.ppo_loss
        losses.ppo_loss = gradlab_ppo_loss
    ew = sys.modules.get("verl.workers.engine_workers")
    if ew is not None and getattr(ew, "ppo_loss", None) is _ORIGINAL["ppo_loss"]:
        ew.ppo_loss = gradlab_ppo_loss
    return True


def uninstall() -> None:
    """Undo `install()`."""
    if "ppo_loss" not in _ORIGINAL:
        return
    importlib.import_module("verl.workers.utils.losses").ppo_loss = _ORIGINAL["ppo_loss"]
    ew = sys.modules.get("verl.workers.engine_workers")
    if ew is not None and getattr(ew, "ppo_loss", None) is gradlab_ppo_loss:
        ew.ppo_loss = _ORIGINAL["ppo_loss"]
