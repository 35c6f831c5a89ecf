"""plan(): every candidate layout of a model on a device count, ranked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from substrax.planner._architectures import (
    ARCHITECTURES,
    Leaf,
    TransformerConfig,
    architecture,
    transformer_leaves,
)
from substrax.planner._plan import Candidate, Hardware, Workload, evaluate, layouts

__all__ = ["Plan", "parse_bytes", "parse_count", "plan"]

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}  # fmt: skip


def _parse(text: str | int | float, suffix: str, what: str) -> int:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip().upper().replace(" ", "")
        raw = raw[: -len(suffix)] if suffix and raw.endswith(suffix) else raw
        number = raw.rstrip("KMGTI")
        unit = raw[len(number) :]
        if unit not in _UNITS or not number:
            raise ValueError(
                f"Cannot read {what} {text!r}: use a number with an optional K, M, G or T "
                f"(or Ki, Mi, Gi, Ti){' and ' + suffix if suffix else ''}, e.g. '80GB'."
            )
        try:
            value = float(number) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"Cannot read {what} {text!r}: {number!r} is not a number.") from None
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be positive, got {text!r}.")
    return int(value)


def parse_bytes(text: str | int) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30.

    Args:
      text: A byte count, optionally with K/M/G/T (decimal) or Ki/Mi/Gi/Ti (binary) and ``B``.

    Returns:
      The byte count.

    Raises:
      ValueError: For anything else, or a count that is not positive.
    """
    return _parse(text, "B", "memory")


def parse_count(text: str | int) -> int:
    """``"4M"`` -> 4_000_000 (tokens, devices, ...).

    Args:
      text: A count, optionally with K/M/G/T.

    Returns:
      The count.

    Raises:
      ValueError: For anything else, or a count that is not positive.
    """
    return _parse(text, "", "count")


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

    def validate(self, rank: int = 0, *, devices: int | None = None) -> dict:
        """Compiles a scaled-down twin of a candidate and compares the estimate with XLA.

        Needs ``substrax-flax`` (the twin trains through its train step); see
        :func:`substrax_flax.validate_candidate` for what is compared.

        Args:
          rank: Which candidate (0: the best).
          devices: Devices for the twin; all available when None.

        Returns:
          The comparison, ``{figure: (estimate, compiled)}``.

        Raises:
          ValueError: For a pipeline candidate, or a plan of a custom model.
        """
        from substrax_flax import validate_candidate

        if self.model not in ARCHITECTURES:
            raise ValueError(f"Only built-in architectures can be twinned, not {self.model!r}.")
        layout = self.candidates[rank].layout
        return validate_candidate(architecture(self.model), layout, devices=devices)

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
            f"{least.bytes_per_device['peak'] / 2**30:.1f} GiB per device ({least.layout.name}), "
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
