"""plan(): every candidate layout of a model on a device count, ranked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from substrax.planner._architectures import (
    Leaf,
    TransformerConfig,
    architecture,
    transformer_leaves,
)
from substrax.planner._estimate import Candidate, Hardware, Workload, evaluate
from substrax.planner._layouts import STRATEGIES, layouts
from substrax.spmd import REMAT

__all__ = ["MICROBATCH_CHOICES", "Plan", "plan"]

MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
"""Microbatch counts :func:`plan` tries when the workload leaves them open."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Candidates for a model on a device count, best first.

    Attributes:
      model: The model's name.
      devices: The device count.
      total_params: Parameters of the model.
      candidates: The candidates, those that fit first, then by estimated time (when hardware
        speeds are known) or peak memory.
    """

    model: str
    devices: int
    total_params: int
    candidates: tuple[Candidate, ...]

    @property
    def best(self) -> Candidate:
        """The first candidate."""
        return self.candidates[0]

    def as_dict(self) -> dict:
        """JSON-ready: ``model``, ``devices``, ``total_params`` and ``candidates``.

        Returns:
          The dict.
        """
        return {
            "model": self.model,
            "devices": self.devices,
            "total_params": self.total_params,
            "candidates": [c.as_dict() for c in self.candidates],
        }

    def no_fit_message(self) -> str | None:
        """Why nothing fits, or None when something does.

        Returns:
          The smallest peak found and what dominates it.
        """
        if any(c.fits for c in self.candidates):
            return None
        least = min(self.candidates, key=lambda c: c.bytes_per_device["peak"])
        parts = {k: v for k, v in least.bytes_per_device.items() if k != "peak"}
        biggest = max(parts, key=parts.get)
        return (
            f"No layout of {self.model} fits on {self.devices} devices: the smallest peak is "
            f"{least.bytes_per_device['peak'] / 2**30:.1f} GiB per device ({least.layout.label}), "
            f"dominated by {biggest} ({parts[biggest] / 2**30:.1f} GiB)."
        )


def plan(
    model: str | TransformerConfig,
    devices: int,
    hardware: Hardware,
    workload: Workload,
    *,
    strategies: Sequence[str] = STRATEGIES,
    leaves: Sequence[Leaf] | None = None,
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

    Layouts with more data-parallel devices than the batch has sequences are left out.
    Candidates that fit come first, then by estimated time when the hardware's speeds are
    known, else by FLOPs per device over the pipeline's busy fraction. Each candidate's remat
    policy and microbatch count are ``workload``'s, or, where it leaves
    them None, searched: per layout, the cheapest setting that fits (by estimated time when
    the hardware's speeds are known, else by FLOPs over the pipeline's busy fraction; then less
    recomputation, fewer microbatches), or the one with the smallest peak when none fits.
    Microbatches are searched among :data:`MICROBATCH_CHOICES` up to the sequences of one
    data-parallel replica (a count that does not divide them means uneven microbatches, as
    estimated).

    Returns:
      The :class:`Plan`.

    Raises:
      ValueError: For an unknown architecture, a non-positive device count, or no layout
        (or none that splits the batch).
    """
    name = model if isinstance(model, str) else "custom"
    config = architecture(model) if isinstance(model, str) else model
    leaves = list(leaves) if leaves is not None else transformer_leaves(config)
    options = layouts(
        devices, config, devices_per_host=hardware.devices_per_host, strategies=strategies,
        seq=workload.seq,
    )  # fmt: skip
    if not options:
        raise ValueError(f"No layout of {devices} devices uses only {list(strategies)}.")
    feasible = [o for o in options if o.batch_degree <= workload.batch]
    if not feasible:
        raise ValueError(
            f"Every layout of {devices} devices has more data-parallel devices than the batch "
            f"has sequences ({workload.batch}); use a larger batch, or allow tp/pp in "
            "strategies."
        )
    timed = hardware.flops > 0
    candidates = [
        _cheapest(config, leaves, layout, workload, hardware, timed) for layout in feasible
    ]
    candidates.sort(key=lambda c: (not c.fits, *_cost(c, timed), c.bytes_per_device["peak"]))
    total = sum(math.prod(leaf.shape) for leaf in leaves)
    return Plan(name, devices, total, tuple(candidates))


def _settings(workload: Workload, layout) -> list[Workload]:
    """The workloads to try on ``layout``: ``workload`` with each open choice filled in."""
    remats = REMAT if workload.remat is None else (workload.remat,)
    if workload.microbatches is None:
        rows = max(workload.batch // layout.batch_degree, 1)
        micros = tuple(m for m in MICROBATCH_CHOICES if m <= rows) or (1,)
    else:
        micros = (workload.microbatches,)
    return [dataclasses.replace(workload, remat=r, microbatches=m) for r in remats for m in micros]


def _cheapest(config, leaves, layout, workload, hardware, timed: bool) -> Candidate:
    """The cheapest setting of ``layout`` that fits, else the one with the smallest peak."""
    options = [evaluate(config, leaves, layout, w, hardware) for w in _settings(workload, layout)]
    fitting = [c for c in options if c.fits]
    if not fitting:
        return min(options, key=lambda c: c.bytes_per_device["peak"])

    return min(fitting, key=lambda c: _cost(c, timed))


def _cost(c: Candidate, timed: bool) -> tuple:
    """Estimated time (else FLOPs over the pipeline's busy fraction), then less recompute."""
    work = c.time_s if timed else c.flops_per_device / (1 - c.bubble)
    return (work, REMAT.index(c.workload.remat), c.workload.microbatches)
