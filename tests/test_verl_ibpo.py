"""verl integration of IBPO: the `gradlab_ibpo*` advantage estimators in verl's registry.

Like tests/test_verl.py, the cases run in a child python that sees .verl-site (.ci/run makes it);
the child runs with VERL_USE_EXTERNAL_MODULES=gradlab.integrations.verl, as verl's processes do.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerance import assert_close_f32
from verl_child import run_in_verl_env

EXTERNAL = "gradlab.integrations.verl"
try:
    from verl.trainer.ppo import core_algos

    HAVE_VERL = True
    # before this file imports gradlab's verl module itself: did `import verl` register ours?
    REGISTERED_BY_VERL_IMPORT = "gradlab_ibpo" in core_algos.ADV_ESTIMATOR_REGISTRY
except ImportError:
    HAVE_VERL = False

needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl not importable here; these cases run "
                                "in the child of test_verl_ibpo_cases_in_verl_env")


def test_verl_ibpo_cases_in_verl_env():
    run_in_verl_env(__file__, HAVE_VERL, VERL_USE_EXTERNAL_MODULES=EXTERNAL)


# ----------------------------------------------------------------------------- helpers


def _verl_batch(seed=0, n_groups=3, G=5, T=10):
    """A batch as verl holds it: uid strings (numpy object array), rows of a group scattered,
    right padding, the terminal reward on the last response token (float32)."""
    from gradlab.testing import random_batch

    b = random_batch(n_groups=n_groups, G=G, T=T, prefix=2, vocab=2, seed=seed)
    R = (b.rewards + 0.25 * torch.arange(b.B) % 3).float()  # a few distinct reward levels
    last = b.mask.sum(-1) - 1
    tlr = torch.zeros(b.B, T).index_put_((torch.arange(b.B), last), R)
    uid = np.array([f"uid-{int(g) * 7 + 3}" for g in b.group], dtype=object)
    return b, R, tlr, uid


def _algo(by_std: bool):
    from verl.trainer.config import AlgoConfig

    return AlgoConfig(norm_adv_by_std_in_grpo=by_std)


def _verl_compute_advantage():
    """verl's own `compute_advantage` (and `compute_response_mask`), run from the source of
    verl/trainer/ppo/ray_trainer.py: importing that module needs verl's serving stack (ray
    serve, fastapi, peft, ...), which this environment does not install."""
    from typing import Optional

    from verl import DataProto
    from verl.trainer.config import AlgoConfig

    path = Path(core_algos.__file__).with_name("ray_trainer.py")
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef)
            and n.name in ("compute_advantage", "compute_response_mask")]
    assert len(keep) == 2, "verl's ray_trainer.py no longer defines compute_advantage"
    ns = {"torch": torch, "np": np, "DataProto": DataProto, "core_algos": core_algos,
          "AdvantageEstimator": core_algos.AdvantageEstimator, "Optional": Optional,
          "AlgoConfig": AlgoConfig}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)
    return ns["compute_advantage"]


# ----------------------------------------------------------------------------- cases


@needs_verl
def test_import_registers_every_estimator_and_the_hooks():
    if EXTERNAL in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
        assert REGISTERED_BY_VERL_IMPORT  # verl's own import of its external modules did it
    import gradlab.integrations.verl  # noqa: F401
    from gradlab.integrations.verl import ibpo as vi

    names = vi.estimator_names()
    assert len(names) == 9 and "gradlab_ibpo:togo:sqrt" in names
    for n in names:
        assert core_algos.get_adv_estimator_fn(n) is core_algos.ADV_ESTIMATOR_REGISTRY[n]
    assert vi.register() == names  # idempotent
    # verl's trainer modules are not importable here: their patches wait for the import
    for mod in ("verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.trainer_base"):
        assert mod in sys.modules or mod in vi._HOOK.pending
    assert vi._HOOK in sys.meta_path


@needs_verl
def test_after_import_hook_runs_on_a_real_import(tmp_path, monkeypatch):
    from gradlab.integrations.verl import ibpo as vi

    (tmp_path / "gl_probe_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    vi.after_import("gl_probe_mod", lambda m: seen.append(m.X))
    assert seen == []
    import gl_probe_mod  # noqa: F401

    assert seen == [1] and "gl_probe_mod" not in vi._HOOK.pending
    vi.after_import("gl_probe_mod", lambda m: seen.append(m.X + 1))  # already imported: at once
    assert seen == [1, 2]


@needs_verl
@pytest.mark.parametrize("by_std", [True, False])
def test_estimator_equals_process_advantages(by_std):
    """Every registered name, called as verl calls it, = process_advantages ÷ the group scale
    on the same batch, bitwise; returns = advantages; 0 off the mask."""
    import gradlab
    from gradlab.core.credit import reward_scale
    from gradlab.integrations.verl.ibpo import advantage_inputs

    b, R, tlr, uid = _verl_batch(seed=1)
    labels = {u: k for k, u in enumerate(dict.fromkeys(uid.tolist()))}
    group = torch.tensor([labels[u] for u in uid.tolist()])
    div = reward_scale(R, group, "group" if by_std else "none", eps=1e-6)
    for name in [n for n in core_algos.ADV_ESTIMATOR_REGISTRY if n.startswith("gradlab_ibpo")]:
        parts = name.split(":")[1:]
        form, rw = (parts + ["ga+la"])[0], (parts[1:] + ["none"])[0]
        with advantage_inputs(b.tokens):
            adv, ret = core_algos.get_adv_estimator_fn(name)(
                token_level_rewards=tlr, response_mask=b.mask.long(), index=uid,
                config=_algo(by_std))
        ref = gradlab.process_advantages(b.tokens, b.mask, group, R, form, rw) / div.unsqueeze(-1)
        assert adv.shape == (b.B, b.T) and adv.dtype == torch.float32
        assert torch.equal(adv, ref), name
        assert ret is adv and bool((adv[~b.mask] == 0).all())
        assert bool((adv != adv[:, :1]).any()), name  # really token-level on this batch


@needs_verl
@pytest.mark.parametrize("by_std", [True, False])
def test_ga_without_shared_tokens_is_verls_grpo(by_std):
    """Independent check: when every row of a group starts with its own token, form ga is
    verl's GRPO advantage (its own compute_grpo_outcome_advantage) on every token."""
    from gradlab.integrations.verl.ibpo import advantage_inputs

    b, R, tlr, uid = _verl_batch(seed=2, G=4)
    tokens = b.tokens.clone()
    rank = torch.zeros(b.B, dtype=torch.long)
    for g in b.group.unique():
        rows = (b.group == g).nonzero().squeeze(-1)
        rank[rows] = torch.arange(rows.numel())
    tokens[:, 0] = 100 + rank  # distinct first token within each group
    with advantage_inputs(tokens):
        adv, _ = core_algos.get_adv_estimator_fn("gradlab_ibpo:ga")(
            token_level_rewards=tlr, response_mask=b.mask.long(), index=uid, config=_algo(by_std))
    ref, _ = core_algos.compute_grpo_outcome_advantage(tlr, b.mask.long(), uid,
                                                       norm_adv_by_std_in_grpo=by_std)
    assert_close_f32(adv, ref, msg="advantages")


@needs_verl
def test_through_verls_own_compute_advantage():
    """verl's compute_advantage on a DataProto: through gradlab_compute_advantage the estimator
    gets the batch's responses; verl's function alone cannot give them (clear error)."""
    from verl import DataProto

    from gradlab.integrations.verl import ibpo as vi

    compute_advantage = _verl_compute_advantage()
    b, R, tlr, uid = _verl_batch(seed=3)

    def data():
        return DataProto.from_dict(
            tensors={"responses": b.tokens, "response_mask": b.mask.long(),
                     "token_level_rewards": tlr},
            non_tensors={"uid": uid})

    vi._ORIGINAL["compute_advantage"] = compute_advantage  # what the import hook stores
    for name in ("gradlab_ibpo", "gradlab_ibpo:togo:sqrt"):
        out = vi.gradlab_compute_advantage(data(), name, config=_algo(True))
        with vi.advantage_inputs(b.tokens):
            ref, _ = core_algos.get_adv_estimator_fn(name)(tlr, b.mask.long(), index=uid,
                                                           config=_algo(True))
        assert torch.equal(out.batch["advantages"], ref)
        assert torch.equal(out.batch["returns"], ref)
    grpo = vi.gradlab_compute_advantage(data(), "grpo", config=_algo(True))  # not ours: verl's
    assert torch.equal(grpo.batch["advantages"],
                       compute_advantage(data(), "grpo", config=_algo(True)).batch["advantages"])
    with pytest.raises(ValueError, match="gradlab_ibpo:ga\\+la: no response token ids"):
        compute_advantage(data(), "gradlab_ibpo", config=_algo(True))


@needs_verl
def test_clear_errors():
    from gradlab.integrations.verl.ibpo import advantage_inputs

    b, R, tlr, uid = _verl_batch(seed=4)
    fn = core_algos.get_adv_estimator_fn("gradlab_ibpo:la")
    with advantage_inputs(b.tokens[:, :-1]):
        with pytest.raises(ValueError, match="gradlab_ibpo:la: responses are .* response_mask is"):
            fn(token_level_rewards=tlr, response_mask=b.mask, index=uid, config=None)
    with pytest.raises(ValueError, match="verl passed no index"):
        fn(token_level_rewards=tlr, response_mask=b.mask, config=None, responses=b.tokens)
    with pytest.raises(ValueError, match="index has 3 entries, the batch 15 rows"):
        fn(token_level_rewards=tlr, response_mask=b.mask, index=uid[:3], responses=b.tokens)
    with pytest.raises(ValueError, match="responses must be a \\(bs, response_length\\) tensor"):
        with advantage_inputs(b.tokens[0]):
            pass
