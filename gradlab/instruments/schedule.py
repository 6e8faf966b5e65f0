"""When an instrument runs: a schedule over the loop's rollout steps (a TRL or verl window).

    Schedule()                 every step
    Schedule(every=5)          steps 0, 5, 10, …
    Schedule(every=1, first=3) steps 0, 1, 2
    Schedule.off()             never
    Schedule.parse("5")        the `@5` of an instrument spec: every 5th step ("off" = never)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """Steps start, start + every, start + 2·every, … (only the first `first` of them when set);
    every = 0 means never. Use: `ModulationProbe(enabled=schedule.active(step))`."""

    every: int = 1
    start: int = 0
    first: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"Schedule: every must be an int ≥ 0 (0 = never), got {self.every!r}")
        if self.start < 0:
            raise ValueError(f"Schedule: start must be ≥ 0, got {self.start}")
        if self.first is not None and self.first < 0:
            raise ValueError(f"Schedule: first must be ≥ 0, got {self.first}")

    @classmethod
    def off(cls) -> Schedule:
        return cls(every=0)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """"5" → every 5th step, "off" or "0" → never; anything else raises naming it."""
        if text.strip() == "off":
            return cls.off()
        try:
            return cls(every=int(text))
        except ValueError:
            raise ValueError(f"schedule {text!r}: expected an int ≥ 0 (every k-th step) "
                             "or 'off'") from None

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.first != 0

    def active(self, step: int) -> bool:
        """Whether the instrument runs at rollout step `step` (0-based)."""
        if not self.enabled or step < self.start:
            return False
        if self.first is not None and step >= self.start + self.first * self.every:
            return False
        return (step - self.start) % self.every == 0
