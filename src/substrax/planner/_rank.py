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
from substrax.planner._estimate import Candidate, Hardware, Workload, evaluate, layouts

__all__ = ["Plan", "plan"]


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
    strategies: Sequence[str] = ("dp", "fsdp", "tp", "pp"),
    leaves: Sequence[Leaf] | None = None,
) -> Plan:
    """Ranks every layout of ``model`` on ``devices`` devices. No device, no compile.

    Args:
      model: A name from :data:`substrax.planner.ARCHITECTURES` or a configuration.
      devices: The device count.
      hardware: Memory per device (and optional speeds).
      workload: Batch, sequence, precision, optimizer, remat.
      strategies: Which of ``dp``, ``fsdp``, ``tp``, ``pp`` to consider.
      leaves: The parameters, for a model that is not a built-in transformer (its closed
        forms still use ``model``'s configuration).

    Returns:
      The :class:`Plan`.

    Raises:
      ValueError: For an unknown architecture, a non-positive device count, or no layout.
    """
    name = model if isinstance(model, str) else "custom"
    config = architecture(model) if isinstance(model, str) else model
    leaves = list(leaves) if leaves is not None else transformer_leaves(config)
    options = layouts(
        devices, config, devices_per_host=hardware.devices_per_host, strategies=strategies
    )
    candidates = [evaluate(config, leaves, layout, workload, hardware) for layout in options]
    if not candidates:
        raise ValueError(f"No layout of {devices} devices uses only {list(strategies)}.")
    timed = hardware.flops > 0
    candidates.sort(
        key=lambda c: (not c.fits, c.time_s if timed else 0.0, c.bytes_per_device["peak"])
    )
    total = sum(math.prod(leaf.shape) for leaf in leaves)
    return Plan(name, devices, total, tuple(candidates))
