"""gradlab's own trainer: one folder per concern, imports flowing one way.

A step's data flow (docs/architecture.md draws it):

    setup (task, policy) → rollouts (groups) → core.batch (TokenBatch) → update (loss, W, tax,
    drift) → update.metrics → runs (store, traces) → viz and `gradlab view`

    faults/     bad input, non-finite steps, exit codes, pre-emption
    config.py   RunConfig: every option of a run, validated
    numerics/   log-probs through the model's own forward, precision, attention and dropout
    rollouts/   the sampler and the independent, tree and repair layouts
    setup/      tasks and verifiers, the held-out split, policies, the load-time self-check
    scale/      torchrun data parallelism and FSDP2
    runs/       the run folder: store, traces, lock, resume, live logs
    update/     one optimizer step in its phases, what its instruments see; metrics; probe contexts
    train.py    the loop, written out
    recipes/    loops built on train: the main job, its check, eval, variance, Prop. 3.1

A module imports only from the packages listed before its own (`LAYERS`; gradlab.core,
gradlab.probes and the rest of gradlab from anywhere). Modules of the earlier flat layout
(`gradlab.loop.task`, …) still import, with a DeprecationWarning, until the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

LAYERS = ("faults", "config", "numerics", "rollouts", "setup", "scale", "runs", "update",
          "train", "recipes")

# module of the flat layout → the package it lives in now
_PACKAGE_OF = {
    **dict.fromkeys(("errors", "untrusted", "guard", "exitcodes", "preempt"), "faults"),
    **dict.fromkeys(("logprobs", "precision", "arch"), "numerics"),
    **dict.fromkeys(("rollout", "tree", "repair", "layouts"), "rollouts"),
    **dict.fromkeys(("task", "heldout", "policy", "selfcheck", "realmodel", "archsweep"), "setup"),
    **dict.fromkeys(("dist", "fsdp"), "scale"),
    **dict.fromkeys(("store", "traces", "lock", "resume", "livelog"), "runs"),
    **dict.fromkeys(("step", "metrics", "probeset"), "update"),
    **dict.fromkeys(("reproduce", "reference", "evaluation", "variance", "prop31"), "recipes"),
}
# module of the flat layout → its module now (durable writes serve all of gradlab: gradlab.atomic)
MOVED = {leaf: f"{__name__}.{pkg}.{leaf}" for leaf, pkg in _PACKAGE_OF.items()}
MOVED["atomic"] = "gradlab.atomic"


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import gradlab.loop.<old>` gives the module at its new path (the same object, so
    attributes set on either are seen by both) and warns once per module."""

    def find_spec(self, name, path=None, target=None):
        head, _, leaf = name.rpartition(".")
        if head != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        leaf = spec.name.rpartition(".")[2]
        new = MOVED[leaf]
        warnings.warn(f"{spec.name} moved to {new}; the old path is removed in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system overwrites it; exec_module puts it back
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
