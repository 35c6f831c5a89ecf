"""Pipeline schedules: which stage does what at each tick.

GPipe and circular are differentiated by ``jax.grad`` through their forward loop, so their
table lists forward ticks. The other schedules run their own backward, split in two as
zero-bubble pipelines split it: ``"backward"`` (the input's gradient, which the stage before
waits for) and ``"weight"`` (the parameters' gradient, which nobody waits for). A tick runs at
most one of forward, backward or weight on each stage; their tables are built by
:func:`_simulate`, a list scheduler that gives each stage, at each tick, the ready op its
schedule prefers:

* ``"1f1b"``: weight straight after its backward, then backward, then forward, with at most
  ``S - s`` microbatches held on stage ``s`` (PipeDream-Flush): idle ``(S-1)/(M+S-1)``.
* ``"interleaved"``: 1F1B over ``v = repeats`` chunks per stage (virtual stage ``r S + s`` on
  stage ``s``), forwards in groups of ``S`` microbatches chunk by chunk (Megatron's order),
  at most ``2 (S - s - 1) + (v - 1) S + 1`` chunks held, weight ops deferred into the
  bubbles: idle at most the textbook ``(S-1)/(v M+S-1)``.
* ``"zb-h1"``: backward before forward before weight, 1F1B's ``S - s`` microbatches between
  forward and backward and at most ``S + 1`` held: the weight ops fill the bubbles, idle
  ``(S-1)/(3 M+S-1)`` (Qi et al., Zero Bubble Pipeline Parallelism, 2024).

The split schedules' idle is at most the textbook 1F1B ``(S-1)/(M+S-1)``: a stage sends its
input's gradient back before computing its weights' gradient, so the backward's critical path
is the backward ops alone.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by _tables: the planner reads only counts
    import numpy as np

__all__ = ["SCHEDULES", "SPLIT", "Schedule", "ScheduleSlot", "Tables"]

SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved", "zb-h1")
"""The schedules :class:`~substrax.pipeline.Pipeline` runs."""

SPLIT = ("1f1b", "interleaved", "zb-h1")
"""The schedules that run their own backward, one op per stage and tick."""

OPS = ("idle", "forward", "backward", "weight")
"""Op codes of :class:`Tables` (their index)."""


@dataclasses.dataclass(frozen=True)
class ScheduleSlot:
    """One unit of work of a schedule: what a stage does at a tick.

    Attributes:
      tick: The tick (time step) of the loop.
      stage: The stage.
      op: ``"forward"``, ``"backward"`` (the input's gradient) or ``"weight"`` (the
        parameters' gradient).
      microbatch: The microbatch.
      repeat: The round of the ring: the chunk of layers (circular, interleaved; 0 otherwise).
    """

    tick: int
    stage: int
    op: str
    microbatch: int
    repeat: int = 0


@dataclasses.dataclass(frozen=True)
class Tables:
    """A split schedule as ``[ticks, stages]`` integer arrays, for the loop to index.

    Buffers are ring slots allocated per stage from the table, so their depth is what the
    schedule holds at once, not the microbatch count. Slot ``depth`` of each buffer is a
    spare one that writes with nothing to keep go to.

    Attributes:
      op: Index into :data:`OPS`.
      microbatch: The op's microbatch (0 when idle).
      chunk: The op's chunk of layers (its round).
      stash: Forward: the slot its residuals go to; backward and weight: where they are.
      cotangent: Backward: the slot its layers' output cotangents go to; weight: where.
      take: Forward: the activation slot it reads (-1: the batch's microbatch);
        backward: the gradient slot it reads.
      loss_slot: Forward of the last virtual stage: the gradient slot its loss's cotangent goes
        to (the spare slot otherwise).
      receive: The activation slot the forward value arriving this tick goes to.
      receive_grad: The gradient slot the input gradient arriving this tick goes to.
      depths: Slots of each buffer: ``{"stash", "cotangent", "activation", "gradient"}``.
    """

    op: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    stash: np.ndarray
    cotangent: np.ndarray
    take: np.ndarray
    loss_slot: np.ndarray
    receive: np.ndarray
    receive_grad: np.ndarray
    depths: dict


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule of ``num_microbatches`` microbatches over ``num_stages`` stages.

    Attributes:
      name: One of :data:`SCHEDULES`.
      num_stages: Stages.
      num_microbatches: Microbatches per batch.
      repeats: Chunks of layers per stage (circular, interleaved; 1 otherwise).
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
        if self.repeats != 1 and self.name not in ("circular", "interleaved"):
            raise ValueError(
                f"repeats={self.repeats} needs schedule='circular' or 'interleaved', not "
                f"{self.name!r}."
            )
        if self.name == "circular" and self.repeats > 1 and self.num_microbatches < self.num_stages:
            raise ValueError(
                f"A circular schedule needs at least as many microbatches as stages: got "
                f"{self.num_microbatches} microbatches for {self.num_stages} stages."
            )

    @property
    def split(self) -> bool:
        """Whether the schedule runs its own split backward (see :data:`SPLIT`)."""
        return self.name in SPLIT

    @property
    def num_ticks(self) -> int:
        """Ticks of the pipeline loop."""
        if self.split:
            return _simulate(self.name, self.num_stages, self.num_microbatches, self.repeats)[0]
        return self.repeats * self.num_microbatches + self.num_stages - 1

    def table(self) -> list[ScheduleSlot]:
        """Every unit of work, in tick order (GPipe and circular: their forward ticks).

        Returns:
          The slots.
        """
        if self.split:
            slots = _simulate(self.name, self.num_stages, self.num_microbatches, self.repeats)[1]
            return [ScheduleSlot(*slot) for slot in slots]
        stages, micro = self.num_stages, self.num_microbatches
        return [
            ScheduleSlot(tick, stage, "forward", (tick - stage) % micro, (tick - stage) // micro)
            for tick in range(self.num_ticks)
            for stage in range(stages)
            if 0 <= tick - stage < self.repeats * micro
        ]

    def idle_fraction(self) -> float:
        """The share of (stage, tick) slots with no work, counted from :meth:`table`.

        Split schedules count a tick per forward, backward and weight op (about the same
        work each for matrix products); GPipe and circular a tick per forward, their backward
        being the reverse of their loop.

        Returns:
          The idle fraction.
        """
        ops = 3 if self.split else 1  # forward, backward and weight; or the forward
        work = ops * self.num_microbatches * self.repeats * self.num_stages
        return 1 - work / (self.num_ticks * self.num_stages)

    def held(self) -> int:
        """The most microbatches' residuals one stage holds at once, in chunks (split schedules).

        Returns:
          The stash depth (GPipe and circular: every microbatch and round).
        """
        if not self.split:
            return self.num_microbatches * self.repeats
        return _simulate(self.name, self.num_stages, self.num_microbatches, self.repeats)[2]

    def waiting(self) -> int:
        """The most weight ops one stage has waiting at once (their cotangents are kept).

        Returns:
          The count (0 for GPipe and circular).
        """
        if not self.split:
            return 0
        return _simulate(self.name, self.num_stages, self.num_microbatches, self.repeats)[3]

    def render(self, width: int = 96) -> str:
        """The table as text: a row per stage, a column per tick.

        ``F`` is a forward, ``B`` a backward, ``W`` a weight op, ``.`` idle (GPipe and
        circular: their forward loop).

        Args:
          width: The most ticks shown; longer tables show their first and last ticks.

        Returns:
          The text, with the idle share and the ticks.
        """
        grid = [["."] * self.num_ticks for _ in range(self.num_stages)]
        for slot in self.table():
            grid[slot.stage][slot.tick] = slot.op[0].upper()
        rows = []
        for stage, row in enumerate(grid):
            text = "".join(row)
            if len(text) > width:
                text = text[: width // 2 - 2] + " .. " + text[-(width // 2 - 2) :]
            rows.append(f"stage {stage:>2} {text}")
        head = (f"{self.name}" + (f" x {self.repeats} chunks" if self.repeats > 1 else "")
                + f", {self.num_microbatches} microbatches on {self.num_stages} stages: "
                f"{self.num_ticks} ticks, idle {self.idle_fraction():.3f}")  # fmt: skip
        return "\n".join([head, *rows])

    def tables(self) -> Tables:
        """The split schedule as arrays for the loop (see :class:`Tables`).

        Returns:
          The tables.

        Raises:
          ValueError: For GPipe and circular, which ``jax.grad`` differentiates.
        """
        if not self.split:
            raise ValueError(f"Schedule {self.name!r} has no split tables; one of {SPLIT} has.")
        return _tables(self.name, self.num_stages, self.num_microbatches, self.repeats)


def _order(name: str, stages: int, micro: int, repeats: int, stage: int, op: str) -> list:
    """The order a stage runs its forwards (or backwards) in: ``[(microbatch, chunk)]``.

    Interleaved takes groups of ``S`` microbatches chunk by chunk (Megatron's order; the
    backwards take the chunks in reverse); the others take the microbatches in order.
    """
    chunks = range(repeats) if op == "forward" else range(repeats - 1, -1, -1)
    group = stages if name == "interleaved" else micro
    return [(m, c) for start in range(0, micro, group) for c in chunks
            for m in range(start, min(start + group, micro))]  # fmt: skip


@functools.cache
def _simulate(name: str, stages: int, micro: int, repeats: int):
    """``(ticks, slots, most held, most waiting)`` of a split schedule.

    Each stage runs its preferred ready op. Forwards and backwards run in their stage's
    :func:`_order`, within :func:`_room_limit`; a weight op may run once its backward has. 1F1B
    prefers weight, then backward, then forward (a weight op straight after its backward);
    interleaved and ZB-H1 prefer backward, then forward, then weight (the weight ops fill the
    bubbles). ``slots`` are ``(tick, stage, op, microbatch, chunk)`` tuples in tick order
    (:meth:`Schedule.table` makes them :class:`ScheduleSlot` objects): the planner simulates
    hundreds of schedules and reads only their counts.
    """
    virtual = stages * repeats
    last, never = virtual - 1, 1 << 62
    # the tick each op of (microbatch m, virtual stage k) ran, at m * virtual + k
    forward_at, backward_at = [never] * (micro * virtual), [never] * (micro * virtual)
    held, open_ = [0] * stages, [0] * stages  # forward done and weight (backward) not
    forwards = [_keys(name, stages, micro, repeats, stage, "forward") for stage in range(stages)]
    backwards = [_keys(name, stages, micro, repeats, stage, "backward") for stage in range(stages)]
    next_f, next_b = [0] * stages, [0] * stages
    # weight ops in their backward's order: the oldest is the first that may be ready
    weights = [collections.deque() for _ in range(stages)]
    weight_first = name == "1f1b"
    rooms = [_room_limit(name, stages, stage, repeats) for stage in range(stages)]
    zb = name == "zb-h1"
    # the most held and waiting grow only where a forward and a backward run: kept there
    slots, tick, total, most, waiting = [], 0, 3 * micro * virtual, 0, 0
    while len(slots) < total:
        for stage in range(stages):
            queue = weights[stage]
            weight = queue[0] if queue and backward_at[queue[0]] < tick else None
            if weight is not None and weight_first:
                _run_weight(slots, tick, stage, weight, queue, held, virtual, stages)
                continue
            i = next_b[stage]
            if i < len(backwards[stage]):
                key = backwards[stage][i]
                k = key % virtual
                if forward_at[key] < tick and (k == last or backward_at[key + 1] < tick):
                    backward_at[key] = tick
                    next_b[stage] = i + 1
                    open_[stage] -= 1
                    queue.append(key)
                    waiting = max(waiting, len(queue))
                    slots.append((tick, stage, "backward", key // virtual, k // stages))
                    continue
            i = next_f[stage]
            if (
                i < len(forwards[stage])
                and held[stage] < rooms[stage]
                and (not zb or open_[stage] < stages - stage)
            ):
                key = forwards[stage][i]
                k = key % virtual
                if k == 0 or forward_at[key - 1] < tick:
                    forward_at[key] = tick
                    next_f[stage] = i + 1
                    held[stage] += 1
                    most = max(most, held[stage])
                    open_[stage] += 1
                    slots.append((tick, stage, "forward", key // virtual, k // stages))
                    continue
            if weight is not None:
                _run_weight(slots, tick, stage, weight, queue, held, virtual, stages)
        if tick > 4 * total + 8:
            raise AssertionError(f"schedule {name!r} deadlocked at tick {tick}")
        tick += 1
    return tick, tuple(slots), most, waiting


def _run_weight(slots, tick, stage, key, queue, held, virtual, stages) -> None:
    """Runs the oldest waiting weight op of ``stage`` at ``tick``."""
    queue.popleft()
    held[stage] -= 1
    slots.append((tick, stage, "weight", key // virtual, key % virtual // stages))


def _keys(name: str, stages: int, micro: int, repeats: int, stage: int, op: str) -> list[int]:
    """:func:`_order` of a stage as ``microbatch * virtual stages + virtual stage`` keys."""
    virtual = stages * repeats
    order = _order(name, stages, micro, repeats, stage, op)
    return [m * virtual + c * stages + stage for m, c in order]


def _room_limit(name: str, stages: int, stage: int, repeats: int) -> int:
    """The most chunks ``stage`` may hold before its next forward, in chunks of microbatches.

    ``held`` counts the chunks whose forward ran and weight op has not (their residuals are
    stashed). 1F1B holds at most ``S - s``; interleaved Megatron's ``2 (S - s - 1) + (v - 1)
    S + 1`` chunks; ZB-H1 at most ``S + 1`` (its deferred weight ops fill the tail) and keeps
    1F1B's ``S - s`` open (forward run, backward not), which :func:`_simulate` checks.
    """
    if name == "zb-h1":
        return stages + 1
    if name == "interleaved":
        return 2 * (stages - stage - 1) + (repeats - 1) * stages + 1
    return stages - stage


class _Slots:
    """Ring slots of one buffer on one stage: the lowest free one, freed after its last read."""

    def __init__(self):
        self.free_after: list[int] = []

    def take(self, start: int, end: int) -> int:
        for slot, free in enumerate(self.free_after):
            if free < start:
                self.free_after[slot] = end
                return slot
        self.free_after.append(end)
        return len(self.free_after) - 1


@functools.cache
def _tables(name: str, stages: int, micro: int, repeats: int) -> Tables:
    import numpy as np

    ticks, raw, _, _ = _simulate(name, stages, micro, repeats)
    slots = [ScheduleSlot(*slot) for slot in raw]
    last = stages * repeats - 1
    when = {(s.op, s.microbatch, s.repeat * stages + s.stage): s.tick for s in slots}
    shape = (ticks, stages)
    # fields that may name no slot (-1) and the buffer whose spare slot then stands in
    spare = {"take": "activation", "loss_slot": "gradient", "receive": "activation",
             "receive_grad": "gradient"}  # fmt: skip
    arrays = {f: np.zeros(shape, np.int32) for f in ("op", "microbatch", "chunk", "stash",
                                                     "cotangent")}  # fmt: skip
    arrays.update({f: np.full(shape, -1, np.int32) for f in spare})
    pools = {b: [_Slots() for _ in range(stages)]
             for b in ("stash", "cotangent", "activation", "gradient")}  # fmt: skip
    place: dict[tuple, int] = {}
    for s in sorted(slots, key=lambda s: s.tick):
        k = s.repeat * stages + s.stage
        m, t, at = s.microbatch, s.tick, (s.tick, s.stage)
        arrays["op"][at] = OPS.index(s.op)
        arrays["microbatch"][at], arrays["chunk"][at] = m, s.repeat
        if s.op == "forward":
            stash = pools["stash"][s.stage].take(t, when[("weight", m, k)])
            place[("stash", m, k)] = arrays["stash"][at] = stash
            arrays["take"][at] = place.pop(("activation", m, k), -1)  # -1: the batch
            if k == last:  # the loss's cotangent waits for this stage's backward
                grad = pools["gradient"][s.stage].take(t, when[("backward", m, k)])
                place[("gradient", m, k)] = arrays["loss_slot"][at] = grad
            else:
                receiver = (k + 1) % stages
                slot = pools["activation"][receiver].take(t + 1, when[("forward", m, k + 1)])
                place[("activation", m, k + 1)] = slot
                arrays["receive"][t + 1, receiver] = slot
        elif s.op == "backward":
            arrays["stash"][at] = place[("stash", m, k)]
            arrays["take"][at] = place.pop(("gradient", m, k))
            cot = pools["cotangent"][s.stage].take(t, when[("weight", m, k)])
            place[("cotangent", m, k)] = arrays["cotangent"][at] = cot
            if k > 0:
                sender_to = (k - 1) % stages
                slot = pools["gradient"][sender_to].take(t + 1, when[("backward", m, k - 1)])
                place[("gradient", m, k - 1)] = slot
                arrays["receive_grad"][t + 1, sender_to] = slot
        else:
            arrays["stash"][at] = place.pop(("stash", m, k))
            arrays["cotangent"][at] = place.pop(("cotangent", m, k))
    depths = {b: max(len(p.free_after) for p in pool) for b, pool in pools.items()}
    for field, buffer in spare.items():
        arrays[field] = np.where(arrays[field] < 0, depths[buffer], arrays[field])
    return Tables(**arrays, depths=depths)
