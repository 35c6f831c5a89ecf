"""Pipeline parallelism that runs: GPipe, 1F1B and circular schedules in one ``shard_map``.

Four modules, one concept each: ``_schedule`` (which stage does what at each tick),
``_layout`` (where each layer of a stack lives: stage, round, slot, FSDP dimension),
``_runner`` (:class:`Pipeline`: microbatches and the kernels that run a schedule) and
``_microbatch`` (:func:`microbatch_index`: which microbatch a stage is computing).
"""

from substrax.pipeline._microbatch import microbatch_index as microbatch_index
from substrax.pipeline._runner import Pipeline as Pipeline
from substrax.pipeline._schedule import SCHEDULES as SCHEDULES
from substrax.pipeline._schedule import ScheduleSlot as ScheduleSlot

__all__ = ["SCHEDULES", "Pipeline", "ScheduleSlot", "microbatch_index"]
