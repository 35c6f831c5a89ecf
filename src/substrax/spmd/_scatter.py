"""A reduce-scatter inside a ``shard_map`` region, in one collective or in two stages.

XLA:TPU compiles a reduce-scatter whose group is every device of the program as an
all-reduce and a slice, twice the bytes (:func:`~substrax.spmd.scatter_stages` says when).
The same sum then goes in two reduce-scatters over index groups of the same axes: the first
over ``outer`` devices ``inner`` apart, which leaves each device the block of ``inner`` chunks
its neighbours will share, the second over those ``inner`` neighbours. Each device ends with
the chunk a single reduce-scatter gives it, and the two together move a single ring's bytes.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["reduce_scatter"]


def reduce_scatter(
    x: jax.Array, axes: str | tuple[str, ...], *, dimension: int, stages: tuple[int, int] | None
) -> jax.Array:
    """``x`` summed over ``axes`` and split along ``dimension``, this device's chunk kept.

    Equal to ``jax.lax.psum_scatter(x, axes, scatter_dimension=dimension, tiled=True)``.

    Args:
      x: This device's addend, inside a region manual over ``axes``.
      axes: The mesh axes to sum over (one name or a tuple, as ``psum_scatter`` takes).
      dimension: The dimension to split; its size must divide by the devices over ``axes``.
      stages: ``(outer, inner)`` with ``outer x inner`` the devices over ``axes``: two
        reduce-scatters over index groups; None for one.

    Returns:
      This device's chunk of the sum.

    Raises:
      ValueError: If ``stages`` does not multiply to the devices over ``axes``.
    """
    if stages is None:
        return jax.lax.psum_scatter(x, axes, scatter_dimension=dimension, tiled=True)
    outer, inner = stages
    size = jax.lax.axis_size(axes)
    if outer * inner != size:
        raise ValueError(
            f"stages {stages} must multiply to the {size} devices over {axes!r}, e.g. "
            f"(1, {size}) or None for one reduce-scatter."
        )
    ids = np.arange(size).reshape(outer, inner)
    apart = [[int(i) for i in column] for column in ids.T]  # outer devices, inner apart
    neighbours = [[int(i) for i in row] for row in ids]
    for groups in (apart, neighbours):
        x = jax.lax.psum_scatter(
            x, axes, scatter_dimension=dimension, tiled=True, axis_index_groups=groups
        )
    return x
