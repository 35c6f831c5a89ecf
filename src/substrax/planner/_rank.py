"""plan(): every candidate layout of a model on a device count, ranked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from substrax.planner._architectures import (
    Leaf,
    TransformerConfig,
    architecture,
    transformer_leaves,
)
from substrax.planner._efficiency import SPREAD
from substrax.planner._estimate import (
    CHUNKED,
    GATHER,
    Candidate,
    Hardware,
    Workload,
    evaluate_prepared,
    prepare,
)
from substrax.planner._layouts import STRATEGIES, layouts
from substrax.spmd import REMAT

__all__ = [
    "CHUNK_CHOICES", "CLOSE_TIMES", "HEADROOM", "MICROBATCH_CHOICES", "SCHEDULE_CHOICES", "Plan",
    "plan",
]  # fmt: skip

MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
"""Microbatch counts :func:`plan` tries when the workload leaves them open."""

SCHEDULE_CHOICES = ("gpipe", "1f1b", "zb-h1", "interleaved")
"""Pipeline schedules :func:`plan` tries when the workload leaves the schedule open."""

CHUNK_CHOICES = (2, 4, 8)
"""Chunks per stage :func:`plan` tries for ``"interleaved"`` when the workload leaves them open."""

HEADROOM = 0.10
"""The share of device memory :func:`plan` keeps free when a layout almost as fast allows."""

CLOSE_TIMES = 0.03
"""Estimated times within this share of the fastest count as a tie for headroom."""

SAME_TIMES = 0.005
"""Estimated times within this share of the fastest count as the same time."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Candidates for a model on a device count, best first.

    Attributes:
      model: The model's name.
      devices: The device count.
      total_params: Parameters of the model.
      candidates: The candidates, those that fit first, then by estimated time (when hardware
        speeds are known) or peak memory.
      why: Why the first candidate is first, against the next one, in a sentence.
    """

    model: str
    devices: int
    total_params: int
    candidates: tuple[Candidate, ...]
    why: str = ""

    @property
    def best(self) -> Candidate:
        """The first candidate."""
        return self.candidates[0]

    def as_dict(self) -> dict:
        """JSON-ready: ``model``, ``devices``, ``total_params``, ``candidates`` and ``why``.

        Returns:
          The dict.
        """
        return {
            "model": self.model,
            "devices": self.devices,
            "total_params": self.total_params,
            "candidates": [c.as_dict() for c in self.candidates],
            "why": self.why,
        }

    def no_fit_message(self) -> str | None:
        """Why nothing fits, or None when something does.

        Returns:
          The smallest peak found and what dominates it.
        """
        if any(c.fits for c in self.candidates):
            return None
        least = min(self.candidates, key=lambda c: c.bytes_per_device["peak"])
        parts = {k: v for k, v in least.bytes_per_device.items() if k not in ("peak", "host")}
        biggest = max(parts, key=parts.get)
        host = least.bytes_per_device.get("host", 0.0)
        room = least.hardware.host_memory_bytes if least.hardware is not None else 0
        beyond = (
            f"; remat offload keeps {host / 2**30:.1f} GiB per device in the host's memory, "
            f"more than its {room / 2**30:.1f} GiB"
            if room and host > room
            else ""
        )
        return (
            f"No layout of {self.model} fits on {self.devices} devices: the smallest peak is "
            f"{least.bytes_per_device['peak'] / 2**30:.1f} GiB per device ({least.layout.label}), "
            f"dominated by {biggest} ({parts[biggest] / 2**30:.1f} GiB){beyond}."
        )


def plan(
    model: str | TransformerConfig,
    devices: int,
    hardware: Hardware,
    workload: Workload,
    *,
    strategies: Sequence[str] = STRATEGIES,
    leaves: Sequence[Leaf] | None = None,
    headroom: float = HEADROOM,
) -> Plan:
    """Ranks every layout of ``model`` on ``devices`` devices. No device, no compile.

    Args:
      model: A name from :data:`substrax.planner.ARCHITECTURES` or a configuration.
      devices: The device count.
      hardware: Memory per device (and optional speeds).
      workload: Batch, sequence, precision, optimizer, remat.
      strategies: Which of :data:`~substrax.planner.STRATEGIES` to consider (``cp`` and
        ``ep`` only where the sequence and the experts allow them).
      leaves: The parameters, for a model that is not a built-in transformer (its closed
        forms still use ``model``'s configuration).
      headroom: The share of device memory to keep free: a fastest layout that keeps less
        is passed over for the layout within :data:`CLOSE_TIMES` of its time that keeps the
        most; one that keeps this much only for a layout within :data:`SAME_TIMES` that
        keeps more (estimates are estimates; fragmentation and buffers are not modelled).

    Layouts whose batch degree does not divide the batch's sequences are left out (jax shards
    a dimension only evenly: 96 sequences do not split over 64 devices), so are those whose
    replicas' sequences a fixed ``workload.microbatches`` does not divide, and
    context-parallel ones join only where the sequence needs them (:func:`_needed_context`).
    Candidates that fit come first, then by estimated time when the hardware's speeds are
    known, else by FLOPs per device over the pipeline's busy fraction; on a near-tie the one
    keeping the most memory free may go first (see ``headroom``). When nothing fits, the one
    with the smallest peak comes first. Each candidate's remat policy, microbatch count,
    ``gather`` (on FSDP layouts) and pipeline schedule (with its chunks) are ``workload``'s,
    or, where it leaves them None, searched: per layout, the cheapest setting that fits (by
    estimated time when the hardware's speeds are known, else by FLOPs over the pipeline's
    busy fraction, times within :data:`SAME_TIMES` counting as equal; then less
    recomputation, fewer microbatches, ``"keep"``, the smaller peak), or the one with the
    smallest peak when none fits.
    Microbatches are searched among the :data:`MICROBATCH_CHOICES` that divide the sequences
    of one data-parallel replica; a pipeline tries only the most: the largest divisor of
    those sequences up to the largest choice (fewer only add bubble, larger microbatches to
    hold and more bytes per tick).

    Returns:
      The :class:`Plan`.

    Raises:
      TypeError: If ``hardware`` or ``workload`` is of another type.
      ValueError: For an unknown architecture, a non-positive device count, no layout (or
        none that splits the batch evenly, or none whose replicas' sequences a fixed
        ``workload.microbatches`` divides), or a ``headroom`` outside ``[0, 1)``.
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a share of device memory in [0, 1), got {headroom!r}.")
    if not isinstance(hardware, Hardware):
        raise TypeError(
            f"hardware must be a Hardware, got {type(hardware).__name__} {hardware!r:.60}; a "
            "named profile is HARDWARE[name] (such as HARDWARE['h100'])."
        )
    if not isinstance(workload, Workload):
        raise TypeError(
            "workload must be a Workload(batch_tokens=..., seq=...), got "
            f"{type(workload).__name__}."
        )
    name = model if isinstance(model, str) else "custom"
    config = architecture(model) if isinstance(model, str) else model
    leaves = list(leaves) if leaves is not None else transformer_leaves(config)
    options = layouts(
        devices, config, devices_per_host=hardware.devices_per_host, strategies=strategies,
        seq=workload.seq,
    )  # fmt: skip
    if not options:
        raise ValueError(f"No layout of {devices} devices uses only {list(strategies)}.")
    feasible = [o for o in options if workload.batch % o.batch_degree == 0]
    if not feasible:
        degrees = sorted({o.batch_degree for o in options})
        raise ValueError(
            f"No layout of {devices} devices splits the batch's {workload.batch} sequences "
            f"evenly: their batch degrees are {degrees[:8]}{' ...' if len(degrees) > 8 else ''}"
            "; use a batch one of them divides, or allow tp/pp in strategies."
        )
    feasible = _divided(feasible, workload)
    timed = hardware.flops > 0

    def estimated(context: bool) -> list[Candidate]:
        chosen = [layout for layout in feasible if (layout.cp > 1) == context]
        return [_cheapest(config, leaves, layout, workload, hardware, timed) for layout in chosen]

    candidates = estimated(context=False)
    if any(layout.cp > 1 for layout in feasible):
        candidates += _needed_context(candidates, lambda: estimated(context=True), timed)
    if any(c.fits for c in candidates):
        candidates.sort(key=lambda c: (not c.fits, *_cost(c, timed), c.bytes_per_device["peak"]))
    else:  # nothing fits: the least memory first, as the why line says
        candidates.sort(key=lambda c: (c.bytes_per_device["peak"], *_cost(c, timed)))
    margin = headroom * hardware.memory_bytes
    why = _prefer_headroom(candidates, margin) if timed else ""
    total = sum(math.prod(leaf.shape) for leaf in leaves)
    return Plan(name, devices, total, tuple(candidates), why or _why(candidates, timed))


def _rows(workload: Workload, layout) -> int:
    """Sequences of one data-parallel replica (the batch degree divides the batch)."""
    return workload.batch // layout.batch_degree


def _divided(layouts_: list, workload: Workload) -> list:
    """The layouts whose replicas' sequences a fixed microbatch count divides.

    Raises:
      ValueError: If it divides none of them.
    """
    micro = workload.microbatches
    if not micro:  # searched (None) or none (0)
        return layouts_
    kept = [o for o in layouts_ if _rows(workload, o) % micro == 0]
    if not kept:
        counts = sorted({_rows(workload, o) for o in layouts_})
        raise ValueError(
            f"microbatches={micro} divides no layout's sequences per replica (the batch's "
            f"{workload.batch} sequences give {counts[:8]}{' ...' if len(counts) > 8 else ''}); "
            "use a divisor of one of them, or microbatches=None to search."
        )
    return kept


def _prefer_headroom(candidates: list[Candidate], margin: float) -> str:
    """On a near-tie, puts the layout with the most memory free first; says so.

    Layouts within :data:`CLOSE_TIMES` of the fastest are a tie for the estimate. When the
    fastest keeps less than ``margin`` free, the tie that keeps the most memory free (the one
    that replicates the least) goes first. When it keeps enough, more room is worth little:
    only a tie within :data:`SAME_TIMES` (the same time, in effect) that keeps more goes first.
    """
    fitting = [c for c in candidates if c.fits]
    if len(fitting) < 2:
        return ""
    first = fitting[0]
    within = CLOSE_TIMES if first.headroom_bytes < margin else SAME_TIMES
    close = [c for c in fitting[1:] if c.time_s <= first.time_s * (1 + within)]
    roomy = max(close, key=lambda c: c.headroom_bytes, default=None)
    if roomy is None or roomy.headroom_bytes <= first.headroom_bytes:
        return ""
    candidates.remove(roomy)
    candidates.insert(0, roomy)
    return (
        f"{roomy.layout.label} keeps {roomy.headroom_bytes / 2**30:.1f} GiB free per device, "
        f"the most of the layouts within {within:.1%} of the fastest (a tie for the estimate): "
        f"{roomy.time_s / first.time_s - 1:.1%} slower than {first.layout.label} "
        f"({_seconds(first.time_s)}), which keeps {first.headroom_bytes / 2**30:.1f} GiB."
    )


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value >= 0.1 else f"{value * 1e3:.3g} ms"


def _why(candidates: list[Candidate], timed: bool) -> str:
    """The first candidate against the second, in a sentence."""
    first = candidates[0]
    if not first.fits:
        return f"nothing fits; {first.layout.label} needs the least memory."
    if len(candidates) == 1:
        return f"{first.layout.label} is the only layout."
    second = candidates[1]
    if not second.fits:
        return f"{first.layout.label} is the only layout that fits."
    if timed:
        if second.time_s <= first.time_s * 1.001:
            return (f"{first.layout.label} and {second.layout.label} take the same estimated "
                    f"time ({_seconds(first.time_s)}, within 0.1%); {first.layout.label} is first "
                    f"by {(second.time_s - first.time_s) * 1e3:.2f} ms, with "
                    f"{first.headroom_bytes / 2**30:.1f} GiB free per device against "
                    f"{second.headroom_bytes / 2**30:.1f}.")  # fmt: skip
        return (f"{first.layout.label} is estimated {second.time_s / first.time_s - 1:.1%} "
                f"faster than {second.layout.label} ({_seconds(first.time_s)} against "
                f"{_seconds(second.time_s)}).")  # fmt: skip
    return (f"{first.layout.label} does the fewest FLOPs per device over the pipeline's "
            f"busy fraction; {second.layout.label} is next (no speeds: no times).")  # fmt: skip


def _settings(workload: Workload, layout, layers: int, hardware: Hardware) -> list[Workload]:
    """The workloads to try on ``layout``: ``workload`` with each open choice filled in.

    Remat ``"offload"`` is tried only where the host link's bandwidth is known.
    """
    remats = REMAT if workload.remat is None else (workload.remat,)
    if workload.remat is None and not hardware.host_bandwidth:
        remats = tuple(r for r in remats if r != "offload")
    if workload.microbatches is None:  # microbatches that divide the replica's sequences
        rows = _rows(workload, layout)
        micros = tuple(m for m in MICROBATCH_CHOICES if m <= rows and rows % m == 0) or (1,)
        if layout.pp > 1:  # more microbatches: less bubble, smaller ones held, fewer bytes
            # passed per tick; the most dominates, so only it is tried: the largest divisor
            # of the replica's sequences up to the largest choice (24 for 24 sequences, as
            # Megatron's microbatches of one sequence)
            top = max(MICROBATCH_CHOICES)
            micros = (max(m for m in range(1, min(rows, top) + 1) if rows % m == 0),)
    else:
        micros = (workload.microbatches,)
    gathers = (workload.gather,) if workload.gather is not None else (
        GATHER if layout.fsdp > 1 else GATHER[:1]
    )  # fmt: skip
    return [
        dataclasses.replace(
            workload, remat=r, microbatches=m, schedule=name, chunks=chunks, gather=g
        )
        for r in remats
        for m in micros
        for g in gathers
        for name, chunks in _schedules(workload, layout, layers, m)
    ]


def _schedules(workload: Workload, layout, layers: int, micro: int) -> list[tuple[str, int]]:
    """The ``(schedule, chunks)`` pairs to try: the workload's, or :data:`SCHEDULE_CHOICES`.

    Chunks come from :data:`CHUNK_CHOICES` where they leave every chunk a layer.
    """
    if layout.pp == 1:
        return [(workload.schedule or "zb-h1", workload.chunks or 1)]
    names = SCHEDULE_CHOICES if workload.schedule is None else (workload.schedule,)
    micro = micro or layout.pp
    pairs = []
    for name in names:
        if name not in CHUNKED:
            pairs.append((name, 1))
            continue
        options = CHUNK_CHOICES if workload.chunks is None else (workload.chunks,)
        pairs += [(name, v) for v in options if layout.pp * v <= layers
                  and (name != "circular" or micro >= layout.pp)]  # fmt: skip
    return pairs or [("zb-h1", 1)]


def _needed_context(
    plain: list[Candidate], context: Callable[[], list[Candidate]], timed: bool
) -> list[Candidate]:
    """The context-parallel candidates, where the sequence needs them; else none.

    ``context()`` estimates them, only when they may be needed. They are needed where no
    layout without context parallelism fits, or where one of them fits and is faster than
    every layout without it that fits by more than the estimate's own error
    (:data:`~substrax.planner._efficiency.SPREAD`): at 512K tokens Llama 3 8B fits only as a
    pipeline of one microbatch, idle 63% of its ticks, 3.5x the ring's time. None can be
    where the fastest that fits is within SPREAD of the least compute time among ``plain``
    without recomputation (a bound: splitting the sequence leaves each device its share of
    the same products); they are then not estimated (half of planning Llama 3 405B on 4,096
    devices).
    """
    fitting = [_cost(c, timed)[0] for c in plain if c.fits]
    if not fitting:
        return context()
    fastest = min(fitting)
    if timed and fastest <= min(_compute_floor(c) for c in plain) * (1 + SPREAD):
        return []
    candidates = context()
    faster = any(c.fits and _cost(c, timed)[0] * (1 + SPREAD) < fastest for c in candidates)
    return candidates if faster else []


def _compute_floor(c: Candidate) -> float:
    """``c``'s compute and attention time without its recomputation."""
    again = 4 / 3 if c.workload.remat == "full" else 1.0
    recomputed = c.workload.remat not in (None, "none")
    attention = c.time_breakdown["attention"] / (4 / 3 if recomputed else 1.0)
    return c.time_breakdown["compute"] / again + attention


def _cheapest(config, leaves, layout, workload, hardware, timed: bool) -> Candidate:
    """The cheapest setting of ``layout`` that fits, else the one with the smallest peak.

    Settings whose estimated time (or work) is within :data:`SAME_TIMES` of the fastest count
    as equally fast; among them less recomputation, fewer microbatches, the earlier
    :data:`~substrax.planner._estimate.GATHER` choice and the smaller peak decide.
    """
    pre = prepare(config, leaves, layout)
    options = [
        evaluate_prepared(pre, w, hardware)
        for w in _settings(workload, layout, config.layers, hardware)
    ]
    fitting = [c for c in options if c.fits]
    if not fitting:
        return min(options, key=lambda c: c.bytes_per_device["peak"])
    # Settings within SAME_TIMES of the fastest take the same time, in effect: the rest of the
    # cost decides (a float's last digit must not buy 8 microbatches with the model gathered).
    fastest = min(_cost(c, timed)[0] for c in fitting)
    same = [c for c in fitting if _cost(c, timed)[0] <= fastest * (1 + SAME_TIMES)]
    return min(same, key=lambda c: _cost(c, timed)[1:])


def _cost(c: Candidate, timed: bool) -> tuple:
    """Estimated time (else FLOPs over the pipeline's busy fraction), then less recompute."""
    work = c.time_s if timed else c.flops_per_device / (1 - c.bubble)
    peak = c.bytes_per_device["peak"]
    gather = GATHER.index(c.workload.gather or GATHER[0])
    return (work, REMAT.index(c.workload.remat), c.workload.microbatches, gather, peak)
