"""gradlab on TRL's `GRPOTrainer` (`pip install gradlab[trl]`; docs/guides/trl.md).

    from gradlab.integrations.trl import GradlabConfig, GradlabGRPOTrainer

    trainer.py  `GradlabGRPOTrainer` / `GradlabMixin`: the host that hands gradlab's instruments
                TRL's W, batch and forwards; DFPO as a drop-in gradient transform
    window.py   a generation batch's loss calls as one window; groups from TRL's inputs
    ibpo.py     IBPO token advantages fed to TRL's loss
    resume.py   the run store across TRL's checkpoint resume
"""

from .trainer import GradlabConfig, GradlabGRPOTrainer, GradlabMixin

__all__ = ["GradlabConfig", "GradlabGRPOTrainer", "GradlabMixin"]
