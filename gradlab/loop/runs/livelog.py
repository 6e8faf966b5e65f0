"""Live logging: stream each rollout step's metrics as the run trains (`--log tensorboard`).

Keyed like the run store: one TensorBoard run per objective (run/tb/<objective>/), one scalar
tag per metric, x = the rollout step — so TensorBoard overlays the objectives on one chart per
metric. `tensorboard --logdir RUN/tb`. trackio (`--log trackio`, when installed): one trackio
run per objective in project "gradlab", metrics logged with step = the rollout step.
Only numbers are streamed (the run store keeps everything); rank 0 alone writes.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path

from ..config import ConfigError

ID_KEYS = ("step", "objective", "seed", "tokens")


def scalars(rec: dict) -> dict[str, float]:
    """The finite numeric metrics of a run-store record (ids and non-numbers dropped)."""
    out = {}
    for k, v in rec.items():
        if k in ID_KEYS or isinstance(v, bool) or not isinstance(v, numbers.Real):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class LiveLogger:
    """`kinds`: comma-separated "tensorboard", "trackio" ("" = off). `log(rec)` per record."""

    def __init__(self, kinds: str, run: str | Path, config: dict | None = None,
                 write: bool = True, start: int = 0) -> None:
        """start: first rollout step of this process; on resume TensorBoard drops the events
        of steps ≥ start written before the crash (purge_step), like the run store."""
        self.kinds = [k for k in kinds.split(",") if k] if write else []
        self.run, self.config, self.start = Path(run), config or {}, start
        self._tb: dict[str, object] = {}
        self._trackio: dict[str, object] = {}
        if "tensorboard" in self.kinds:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError:
                raise ConfigError("--log tensorboard: the tensorboard package is not installed "
                                  "(pip install 'gradlab[live]')") from None
        if "trackio" in self.kinds:
            try:
                import trackio  # noqa: F401
            except ImportError:
                raise ConfigError("--log trackio: the trackio package is not installed "
                                  "(pip install trackio)") from None

    def log(self, rec: dict) -> None:
        """Stream one (step, objective) record; flushed so a live viewer sees it now."""
        if not self.kinds:
            return
        obj, step, vals = str(rec.get("objective", "run")), int(rec.get("step", 0)), scalars(rec)
        if "tensorboard" in self.kinds:
            w = self._tb.get(obj) or self._tb_writer(obj)
            for k, v in vals.items():
                w.add_scalar(k, v, step)
            w.flush()
        if "trackio" in self.kinds:
            t = self._trackio.get(obj) or self._trackio_run(obj)
            t.log(vals, step=step)

    def _tb_writer(self, obj: str):
        from torch.utils.tensorboard import SummaryWriter

        self._tb[obj] = SummaryWriter(log_dir=str(self.run / "tb" / obj),
                                      purge_step=self.start or None)
        return self._tb[obj]

    def _trackio_run(self, obj: str):
        import trackio

        self._trackio[obj] = trackio.init(project="gradlab", name=f"{self.run.name}/{obj}",
                                          config=self.config)
        return self._trackio[obj]

    def close(self) -> None:
        for w in self._tb.values():
            w.close()
        for t in self._trackio.values():
            t.finish()
        self._tb, self._trackio = {}, {}
