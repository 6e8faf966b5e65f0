"""Resuming an instrumented TRL run: what TRL does not save, gradlab does.

TRL restarts its micro-step counter at 0 on `train(resume_from_checkpoint=...)`, so without
this the run store's `step` (window index) and `tokens` would restart at 0. Each checkpoint
gets `gradlab_state.<rank>.json` (loss tokens of all processes, windows begun; the same on every
process); loading the checkpoint restores them and drops store rows written after it (a crash
after the checkpoint).
"""

from __future__ import annotations

import json
import logging
import os

from ... import jsonio
from ...loop.runs.lock import RunInUseError
from ...loop.runs.store import RunStore

log = logging.getLogger("gradlab")


def open_store(path: str, config: dict, resume: bool) -> RunStore:
    """The TRL run's store; a folder holding a run without resume=True is one line naming
    `GradlabConfig(resume=True)` (the TRL-side switch, not the CLI's --resume)."""
    try:
        return RunStore(path, config, resume=resume, check_config=False)
    except RunInUseError:
        raise
    except FileExistsError:
        raise FileExistsError(
            f"gradlab store {path} already holds a run: pass GradlabConfig(resume=True) to "
            "continue it (with trainer.train(resume_from_checkpoint=...)), or choose another "
            "GradlabConfig(store=...)") from None


class ResumeMixin:
    """Part of `GradlabMixin` (needs _gl_tokens, _gl_win0, gradlab_store, TRL's _step)."""

    def _save_checkpoint(self, model, trial) -> None:
        """TRL's checkpoint, plus gradlab's counters (tokens, windows) in gradlab_state.json."""
        super()._save_checkpoint(model, trial)
        d = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        spg = self.args.steps_per_generation
        state = {"tokens": self._gl_tokens, "global_step": self.state.global_step,
                 "windows": self._gl_win0 + -(-self._step // spg)}  # windows begun so far
        rank = self.accelerator.process_index  # every process writes its own (same) counters
        with open(os.path.join(d, f"gradlab_state.{rank}.json"), "w") as f:
            f.write(jsonio.dumps(state))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Continue the store's step (window index) and tokens where the checkpoint left them,
        and drop store rows written after it (a crash after the checkpoint)."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        rank = self.accelerator.process_index
        p = os.path.join(resume_from_checkpoint, f"gradlab_state.{rank}.json")
        if not os.path.isfile(p):  # a checkpoint made without gradlab: counters start at 0
            log.warning("gradlab: %s has no gradlab_state.%d.json: store step and tokens restart "
                        "at 0", resume_from_checkpoint, rank)
            return
        with open(p) as f:
            state = json.load(f)
        self._gl_tokens, self._gl_win0 = int(state["tokens"]), int(state["windows"])
        if self.gradlab_store is not None:
            self.gradlab_store.truncate_after(self._gl_win0 - 1)
