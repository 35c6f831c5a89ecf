"""Pipeline schedules: which stage does what at each tick, for GPipe, 1F1B and circular."""

from __future__ import annotations

import dataclasses

__all__ = ["SCHEDULES", "Schedule", "ScheduleSlot"]

SCHEDULES = ("gpipe", "1f1b", "circular")
"""The schedules :class:`~substrax.pipeline.Pipeline` runs."""


@dataclasses.dataclass(frozen=True)
class ScheduleSlot:
    """One unit of work of a schedule: what a stage does at a tick.

    Attributes:
      tick: The tick (time step) of the loop.
      stage: The stage.
      op: ``"forward"`` or ``"backward"``.
      microbatch: The microbatch.
      repeat: The round of the ring (circular schedules; 0 otherwise).
    """

    tick: int
    stage: int
    op: str
    microbatch: int
    repeat: int = 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule of ``num_microbatches`` microbatches over ``num_stages`` stages.

    Attributes:
      name: ``"gpipe"``, ``"1f1b"`` or ``"circular"``.
      num_stages: Stages.
      num_microbatches: Microbatches per batch.
      repeats: Rounds of the ring (circular; 1 otherwise).
    """

    name: str
    num_stages: int
    num_microbatches: int
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"Unknown schedule {self.name!r}; choose one of {SCHEDULES}.")
        if self.num_microbatches < 1 or self.repeats < 1:
            raise ValueError(
                f"num_microbatches and repeats must be positive, got {self.num_microbatches} "
                f"and {self.repeats}."
            )
        if self.repeats != 1 and self.name != "circular":
            raise ValueError(
                f"repeats={self.repeats} needs schedule='circular', not {self.name!r}."
            )
        if self.name == "circular" and self.repeats > 1 and self.num_microbatches < self.num_stages:
            raise ValueError(
                f"A circular schedule needs at least as many microbatches as stages: got "
                f"{self.num_microbatches} microbatches for {self.num_stages} stages."
            )

    @property
    def num_ticks(self) -> int:
        """Ticks of the pipeline loop."""
        stages, micro = self.num_stages, self.num_microbatches
        if self.name == "1f1b":
            return micro + 2 * (stages - 1)
        return self.repeats * micro + stages - 1

    def table(self) -> list[ScheduleSlot]:
        """Every unit of work, in tick order (GPipe and circular: their forward ticks).

        Returns:
          The slots.
        """
        stages, micro = self.num_stages, self.num_microbatches
        slots = []
        for tick in range(self.num_ticks):
            for stage in range(stages):
                if self.name == "1f1b":
                    if 0 <= tick - stage < micro:
                        slots.append(ScheduleSlot(tick, stage, "forward", tick - stage))
                    back = tick - 2 * (stages - 1) + stage
                    if 0 <= back < micro:
                        slots.append(ScheduleSlot(tick, stage, "backward", back))
                elif 0 <= tick - stage < self.repeats * micro:
                    item = tick - stage
                    slots.append(ScheduleSlot(tick, stage, "forward", item % micro, item // micro))
        return slots

    def idle_fraction(self) -> float:
        """The share of (stage, tick, op) slots with no work, counted from :meth:`table`.

        Returns:
          The idle fraction.
        """
        per_tick = 2 if self.name == "1f1b" else 1
        return 1 - len(self.table()) / (self.num_ticks * self.num_stages * per_tick)
