"""What this jax/XLA cannot compile in a manual region: one list, read by the step and the planner.

Each entry was observed on a given jax version and on the platforms it names; it is gated by
the platform the step is compiled for (its mesh's devices: a TPU slice's when compiling for
one from this machine with the Flax adapter's ``compile_for``), so the train step's plan (in the
Flax adapter) and the planner (:mod:`substrax.planner`) take the same path for the same
layout and target. Recheck an entry when jax moves (``tests/test_target.py`` fails when the
installed jax is not :data:`OBSERVED_ON`): until a version is known to fix it, it applies (an
XLA ``CHECK`` aborts the process, which no ``try`` can catch).

Rechecked on jax 0.10.2 with libtpu 0.0.42.1 (compiled for ``v5p:2x2x2``, deviceless):

* the two-free-axes ``CHECK`` aborts XLA:TPU's SPMD partitioner too (``fsdp 2 x cp 2 x tp 2``):
  every platform;
* the 16-bit all-reduce abort is XLA:CPU's alone: XLA:TPU compiles ``fsdp 4 x tp 2`` at
  ``precision="mixed"`` in the manual region;
* Shardy's refusal of stacked experts' nested region is raised at lowering, before any
  backend: every platform;
* XLA:TPU compiles a reduce-scatter whose group is every device of the program as an
  all-reduce and a slice (8, 16, 32 and 64 chips of v5p), and keeps one over a sub-group:
  :func:`scatter_stages` stages it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["OBSERVED_ON", "looped_region_obstacle", "region_obstacle", "scatter_stages"]

#: The jax version the entries below were observed on (XLA:CPU, and XLA:TPU from libtpu 0.0.42.1).
OBSERVED_ON = "0.10.2"


@functools.cache
def _installed_jax() -> str:
    """The installed jax's version, read without importing jax (the planner asks)."""
    return importlib.metadata.version("jax")


def region_obstacle(
    axis_sizes: Mapping[str, int],
    region_axes: tuple[str, ...],
    compute_dtype: np.dtype | None = None,
    platform: str = "cpu",
) -> str | None:
    """Why XLA cannot compile a manual region over ``region_axes`` here, or None.

    * XLA's SPMD partitioner fails a ``CHECK`` (``spmd_partitioner_util``) on a region that
      leaves two or more mesh axes of size > 1 outside it (tensor with context or expert axes),
      on XLA:CPU and XLA:TPU alike.
    * XLA's CPU compiler aborts on a 16-bit all-reduce over the axes a region leaves outside
      (XLA:TPU compiles it).

    Args:
      axis_sizes: The mesh's axis sizes.
      region_axes: The axes the region is manual over (the batch axes it splits).
      compute_dtype: The step's compute dtype (None: as stored, float32).
      platform: The devices' platform (``"cpu"``, ``"gpu"``, ``"tpu"``).

    Returns:
      A sentence naming the obstacle and the jax version it was seen on, or None.
    """
    free = tuple(a for a, size in axis_sizes.items() if size > 1 and a not in region_axes)
    if len(free) > 1:
        return (
            f"XLA (jax {OBSERVED_ON}, {_installed_jax()} here) fails a CHECK in its SPMD "
            f"partitioner on a manual region that leaves two mesh axes of size > 1 outside "
            f"it, here {free}"
        )
    if compute_dtype is None or not free or platform != "cpu":
        return None
    import numpy as np  # here: the planner asks without a dtype and imports no numpy

    dtype = np.dtype(compute_dtype)
    if dtype.itemsize < 4:
        return (
            f"XLA's CPU compiler (jax {OBSERVED_ON}) aborts on {dtype.name} "
            f"all-reduces over the axes {free} that a manual region leaves outside it"
        )
    return None


def looped_region_obstacle(what: str, axes: tuple[str, ...]) -> str | None:
    """Why a layer's own region over ``axes`` inside a loop cannot run in a manual region.

    * Shardy rejects a ``shard_map`` nested in a loop (an ``nnx.scan`` over stacked layers)
      within a manual region that leaves the nested region's axes out ("manual axes must
      come before free axes"): stacked experts over expert axes under ``fsdp+ep``, and
      stacked attention layers over context axes under ``fsdp+cp`` (ring attention), on
      every platform (it is raised at lowering).

    Args:
      what: The layer, as the message names it (``"the stacked experts (blocks/moe/w_in)"``).
      axes: The axes of size > 1 its region spans that the manual region leaves out.

    Returns:
      A sentence naming the obstacle and the jax version it was seen on, or None.
    """
    if not axes:
        return None
    return (
        f"{what} enter a region over the mesh axes {axes} inside the layers' loop, which "
        f"Shardy (jax {OBSERVED_ON}) rejects within a manual region that leaves those axes out"
    )


def scatter_stages(
    axis_sizes: Mapping[str, int], axes: tuple[str, ...], platform: str = "cpu"
) -> tuple[int, int] | None:
    """How to stage a reduce-scatter over ``axes`` that XLA would compile as an all-reduce.

    * XLA:TPU (jax 0.10.2, libtpu 0.0.42.1) compiles a reduce-scatter whose group is every
      device of the program as an all-reduce and a slice: twice a reduce-scatter's bytes
      (seen on v5p with 8, 16, 32 and 64 chips). Over a sub-group (FSDP beside tensor or
      replica axes) it keeps the reduce-scatter. Two reduce-scatters over index groups
      (:func:`~substrax.spmd.reduce_scatter`) stay reduce-scatters and move one ring's
      bytes: 1.00x on ``v5p:2x4x4`` (4 x 8) and ``v5p:4x4x4`` (8 x 8), 1.01x on ``v5p:2x2x2``
      (4 x 2). XLA:CPU keeps every reduce-scatter an all-reduce, staged or not.

    Args:
      axis_sizes: The mesh's axis sizes.
      axes: The axes the reduce-scatter sums over.
      platform: The platform the program is compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``).

    Returns:
      ``(outer, inner)``, ``inner`` the largest divisor of the group's devices that is at
      most their square root; None where one reduce-scatter stays one (another platform, a
      sub-group, or a prime number of devices).
    """
    size = math.prod(axis_sizes[a] for a in axes)
    if platform != "tpu" or size != math.prod(axis_sizes.values()):
        return None
    inner = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    return None if inner == 1 else (size // inner, inner)
