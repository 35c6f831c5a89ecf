"""How close real training steps come to the datasheet: the planner's calibrated efficiencies.

A roofline (every FLOP at peak, every collective hidden but one layer's share) is not what
runs: published runs on H100s reach 26-67% of peak. :class:`Efficiency` holds the fractions
the planner's time estimate applies, per device kind:

- ``matmul``: the share of peak FLOP/s that the step's matrix products and elementwise work
  reach, end to end (kernels, launch gaps, the optimizer, data loading, logging);
- ``attention``: the same for attention's score and value products, counted causal (half
  the square, as flash kernels execute it);
- ``exposed``: per mesh axis kind, the share of that axis's collectives left on the critical
  path (``model``: tensor-parallel all-reduces with sequence parallelism, which Megatron and
  torchtitan partly overlap). Axes not listed keep the planner's overlap model: FSDP, context
  and data-parallel traffic hidden behind the other layers' compute but for one layer's share
  and whatever exceeds the compute; expert and pipeline traffic exposed whole.

:data:`CALIBRATED` was fitted by ``benchmarks/planner_published.py`` to the published runs of
:data:`substrax.planner._calibration.PUBLISHED` (torchtitan's Llama 3 8B/70B/405B rows and
Megatron-LM's GPT weak-scaling rows, all on H100s), minimising the squared log ratio of
estimate to published step time; that script prints the fit, and the tests pin it.
:data:`SPREAD` is the calibration's worst ratio, printed with each estimate. The named TPU
profiles use the same fractions: no TPU run is in the calibration set, so their times carry
the H100 spread at best.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["CALIBRATED", "CALIBRATION_RUNS", "ROOFLINE", "SPREAD", "Efficiency"]


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Shares of the datasheet a step reaches (see the module's docstring).

    Attributes:
      matmul: Share of peak FLOP/s for matrix products and elementwise work, in (0, 1].
      attention: Share of peak FLOP/s for causal attention's products, in (0, 1].
      exposed: Mesh axis kind (``"model"``, ``"expert"``, ``"pipe"``) -> share of its
        traffic on the critical path, in [0, 1]; an axis not listed keeps the default model.
    """

    matmul: float = 1.0
    attention: float = 1.0
    exposed: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("matmul", "attention"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {value!r}.")
        for axis, share in self.exposed.items():
            if not 0 <= share <= 1:
                raise ValueError(f"Efficiency.exposed[{axis!r}] must be in [0, 1], got {share!r}.")

    def __hash__(self) -> int:
        return hash((self.matmul, self.attention, tuple(sorted(self.exposed.items()))))


ROOFLINE = Efficiency()
"""Every FLOP at peak: what a :class:`~substrax.planner.Hardware` without a profile assumes."""

CALIBRATED = Efficiency(matmul=0.385, attention=0.385, exposed={"model": 0.95, "pipe": 0.0})
"""Fitted to :data:`~substrax.planner._calibration.PUBLISHED` (H100): the named profiles'."""

SPREAD = 0.33
"""The calibration's worst ``|estimate / published - 1|`` (0.322), rounded up to a percent."""

CALIBRATION_RUNS = 9
"""How many published runs :data:`CALIBRATED` was fitted to."""
