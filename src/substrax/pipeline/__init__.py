"""Pipeline parallelism that runs: GPipe, circular, 1F1B, interleaved, ZB-H1 in one shard_map.

Five modules, one concept each: ``_schedule`` (which stage does what at each tick),
``_layout`` (where each layer of a stack lives: stage, round, slot, FSDP dimension),
``_runner`` (:class:`Pipeline`: microbatches and the kernels that run a schedule),
``_split`` (the split schedules' loop: one op per stage and tick) and
``_microbatch`` (:func:`microbatch_index`: which microbatch a stage is computing).
"""

from typing import TYPE_CHECKING

from substrax._lazy import attach

if TYPE_CHECKING:
    from substrax.pipeline._microbatch import microbatch_index as microbatch_index
    from substrax.pipeline._runner import Pipeline as Pipeline
    from substrax.pipeline._schedule import SCHEDULES as SCHEDULES
    from substrax.pipeline._schedule import Schedule as Schedule
    from substrax.pipeline._schedule import ScheduleSlot as ScheduleSlot

__getattr__, __dir__ = attach(__name__, __file__)

__all__ = ["SCHEDULES", "Pipeline", "Schedule", "ScheduleSlot", "microbatch_index"]
